"""Lesson 05's exercises: the accumulation step and no_sync; the solutions score full points,
realistic wrong versions less, on 2, 3 and 4 of a 4-rank scratch cluster."""

from __future__ import annotations

import contextlib
import sys

import cloudpickle
import pytest
import torch

from conftest import full, less
from course_lib.accumulation import accumulation_step, no_sync

cloudpickle.register_pickle_by_value(sys.modules[__name__])  # engines cannot import tests/


def _step(model, optimizer, loss_fn, micro_batches, *, count="global", world=True,
          micro_mean=False, padding=False, sync_each=False, step_each=False, returns="float",
          refuse_empty=True, needs_ddp=False):
    """The token-weighted step, with one of the classic mistakes switched on."""
    if refuse_empty and not micro_batches:
        raise ValueError("no micro-batch")
    ddp = needs_ddp or hasattr(model, "no_sync")
    mine = sum(int(m.numel() if padding else m.sum()) for _, _, m in micro_batches)
    n = torch.tensor(float(mine), dtype=torch.float64)
    if ddp and count == "global":
        model.dist.all_reduce(n, group=model.group)
    scale = (model.world_size if ddp and world else 1) / n
    total, last_loss = 0.0, None
    for i, (x, y, mask) in enumerate(micro_batches):
        last = i == len(micro_batches) - 1
        syncing = last or not ddp or sync_each
        with contextlib.nullcontext() if syncing else model.no_sync():
            tokens = loss_fn(model(x), y)
            summed = tokens.sum() if padding else tokens[mask].sum()
            loss = (tokens[mask].mean() / len(micro_batches) * (model.world_size if ddp
                                                                and world else 1)
                    if micro_mean else summed * scale)
            loss.backward()
        if step_each:
            optimizer.step()
            optimizer.zero_grad()
        total, last_loss = total + summed.item(), tokens[mask].mean()
    optimizer.step()
    optimizer.zero_grad()
    if returns == "tensor":
        return torch.tensor(total / max(mine, 1), requires_grad=True)
    if returns == "last":
        return last_loss.item()
    return total / max(mine, 1)


def loss_over_k(model, optimizer, loss_fn, micro_batches):
    """Each micro-batch's mean over its real tokens, divided by k: the per-micro-batch bug."""
    return _step(model, optimizer, loss_fn, micro_batches, count="local", world=False,
                 micro_mean=True)


def local_count(model, optimizer, loss_fn, micro_batches):
    """Each rank divides by its own count of real tokens (no all_reduce of the count)."""
    return _step(model, optimizer, loss_fn, micro_batches, count="local", world=False)


def padding_counted(model, optimizer, loss_fn, micro_batches):
    """Padded positions in the sum and in the count."""
    return _step(model, optimizer, loss_fn, micro_batches, padding=True)


def forgets_the_average(model, optimizer, loss_fn, micro_batches):
    """The global count, but DDP's average over the ranks is not undone."""
    return _step(model, optimizer, loss_fn, micro_batches, world=False)


def sync_every_micro_batch(model, optimizer, loss_fn, micro_batches):
    return _step(model, optimizer, loss_fn, micro_batches, sync_each=True)


def step_every_micro_batch(model, optimizer, loss_fn, micro_batches):
    return _step(model, optimizer, loss_fn, micro_batches, sync_each=True, step_each=True)


def returns_last_loss(model, optimizer, loss_fn, micro_batches):
    """Right weights and communication; returns the last micro-batch's loss per token."""
    return _step(model, optimizer, loss_fn, micro_batches, returns="last")


def returns_a_tensor(model, optimizer, loss_fn, micro_batches):
    """Right weights; returns the loss as a tensor, not a float."""
    return _step(model, optimizer, loss_fn, micro_batches, returns="tensor")


def assumes_ddp(model, optimizer, loss_fn, micro_batches):
    """Right on DDP; a plain module has no no_sync, no dist."""
    return _step(model, optimizer, loss_fn, micro_batches, needs_ddp=True)


def no_empty_check(model, optimizer, loss_fn, micro_batches):
    """Right on every batch it is given; accepts []."""
    return _step(model, optimizer, loss_fn, micro_batches, refuse_empty=False)


FIRST = "2 ranks, k=4 micro-batches of 2 sequences, 3 steps: rank 0: "
PLAIN = "2 ranks, plain modules (no no_sync), k=2 of 2 and 1, 2 steps; [] refused: rank 0: "
ACCUMULATION_MISTAKES = {  # the wrong version: (its score, the first failing case's reason)
    loss_over_k: (0.0, FIRST + "the weights of per-micro-batch means divided by k: a token of "
                               "a short micro-batch weighs more"),
    local_count: (0.4, FIRST + "the weights of each rank dividing by its own count of real "
                               "tokens"),
    padding_counted: (0.0, FIRST + "the weights of a loss that counts the padding"),
    forgets_the_average: (0.4, FIRST + "the weights of steps 2 times too small: the wrapper "
                                       "averages the 2 ranks' gradients"),
    sync_every_micro_batch: (0.8, FIRST + "15 all_reduce calls in 3 steps: the gradient on "
                                          "every micro-batch"),
    step_every_micro_batch: (0.4, FIRST + "15 all_reduce calls in 3 steps: the gradient on "
                                          "every micro-batch"),
    returns_last_loss: (0.4, FIRST + "returns losses that are not this rank's loss per real "
                                     "token"),
    returns_a_tensor: (0.0, FIRST + "returns a Tensor: the exercise asks for this rank's loss "
                                    "per real token, as a Python float"),
    assumes_ddp: (1.6, PLAIN + "raised AttributeError"),
    no_empty_check: (1.6, PLAIN + "accepts an empty list of micro-batches instead of raising "
                                  "ValueError"),
}


@pytest.mark.cluster
def test_accumulation_step_solution_and_mistakes(scratch_cluster_4):
    full("lesson05.accumulation_step", accumulation_step, scratch_cluster_4)
    for wrong, (points, reason) in ACCUMULATION_MISTAKES.items():
        r = less("lesson05.accumulation_step", wrong, scratch_cluster_4)
        assert (r.points, reason) == (points, r.reason.split("first: ", 1)[1][:len(reason)]), \
            (wrong.__name__, r.points, r.reason)


@contextlib.contextmanager
def restores_true(ddp):
    """Turns sync back on at any exit: an inner block of nested ones syncs the outer's."""
    ddp.require_backward_grad_sync = False
    try:
        yield
    finally:
        ddp.require_backward_grad_sync = True


@contextlib.contextmanager
def no_finally(ddp):
    """Restores only on a clean exit: after a block that raised, the model never syncs again."""
    previous = ddp.require_backward_grad_sync
    ddp.require_backward_grad_sync = False
    yield
    ddp.require_backward_grad_sync = previous


@contextlib.contextmanager
def switches_the_hooks(ddp):
    """Turns off expect_hooks, which the next forward recomputes: right weights, but one
    all_reduce per micro-batch."""
    previous = ddp.expect_hooks
    ddp.expect_hooks = False
    try:
        yield
    finally:
        ddp.expect_hooks = previous


NO_SYNC_MISTAKES = {
    restores_true: "3 ranks, nested blocks, 2 steps: rank 0: 2 all_reduce calls per step, one "
                   "expected: leaving the inner block turned syncing back on while the outer "
                   "block was still open",
    no_finally: "4 ranks, after a block that raised, 2 steps: rank 0: syncing stays off for good "
                "after a block that raised",
    switches_the_hooks: "2 ranks, 3 micro-batches, one block each, 2 steps: rank 0: 3 "
                        "all_reduce calls per step, one per micro-batch",  # right weights
}


@pytest.mark.cluster
def test_no_sync_solution_and_mistakes(scratch_cluster_4):
    full("lesson05.no_sync", no_sync, scratch_cluster_4)
    for wrong, reason in NO_SYNC_MISTAKES.items():
        r = less("lesson05.no_sync", wrong, scratch_cluster_4)
        assert "first: " + reason in r.reason, (wrong.__name__, r.reason)


# lesson05.saved_activation_bytes --------------------------------------------------------------

def _counting(model, inputs, keep):
    total = 0

    def pack(t):
        nonlocal total
        if keep(t):
            total += t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(*inputs)
    return total


def counts_parameters(model, *inputs):
    """Counts the weights too: not activations, and not copied."""
    return _counting(model, inputs, lambda t: True)


def counts_twice(model, *inputs):
    """Skips parameters but counts a tensor saved by two operations twice."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    return _counting(model, inputs, lambda t: t.untyped_storage().data_ptr() not in params)


def counts_outputs(model, *inputs):
    """Counts what forward returns, not what autograd saves."""
    return sum(o.numel() * o.element_size() for o in [model(*inputs)])


def test_saved_activation_bytes_solution_and_mistakes():
    from course_lib.accumulation import saved_activation_bytes

    full("lesson05.saved_activation_bytes", saved_activation_bytes)
    reasons = {
        counts_parameters: "MLP, batch 4: counts the parameters too: autograd keeps a "
                           "reference to them",
        counts_twice: "MLP, batch 4: counts the parameters, or a tensor that two operations "
                      "save, twice: here both add the same bytes",
        counts_outputs: "MLP, batch 4: the bytes of the model's output",
    }
    for wrong, reason in reasons.items():
        r = less("lesson05.saved_activation_bytes", wrong)
        assert "first: " + reason in r.reason, (wrong.__name__, r.reason)
    # On a batch where the two differ, a tensor counted twice is named as such.
    r = less("lesson05.saved_activation_bytes", counts_twice)
    assert [row.note for c in r.cases for row in c.rows if not row.passed][1] == (
        "counts a tensor that two operations save twice; autograd stores it once"), str(r)
