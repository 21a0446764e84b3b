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


def no_loss_scaling(model, optimizer, loss_fn, micro_batches):
    total = 0.0
    for i, (x, y) in enumerate(micro_batches):
        last = i == len(micro_batches) - 1
        with contextlib.nullcontext() if last else model.no_sync():
            loss = loss_fn(model(x), y)
            loss.backward()
        total += loss.item()
    optimizer.step()
    optimizer.zero_grad()
    return total


def sync_every_micro_batch(model, optimizer, loss_fn, micro_batches):
    total = 0.0
    for x, y in micro_batches:
        loss = loss_fn(model(x), y) / len(micro_batches)
        loss.backward()
        total += loss.item()
    optimizer.step()
    optimizer.zero_grad()
    return total


def step_every_micro_batch(model, optimizer, loss_fn, micro_batches):
    total = 0.0
    for x, y in micro_batches:
        loss = loss_fn(model(x), y) / len(micro_batches)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        total += loss.item()
    return total


def returns_last_loss(model, optimizer, loss_fn, micro_batches):
    """Right weights and communication; returns the last micro-batch's loss."""
    k = len(micro_batches)
    for i, (x, y) in enumerate(micro_batches):
        with contextlib.nullcontext() if i == k - 1 else model.no_sync():
            loss = loss_fn(model(x), y)
            (loss / k).backward()
    optimizer.step()
    optimizer.zero_grad()
    return loss.item()


def returns_a_tensor(model, optimizer, loss_fn, micro_batches):
    """Right weights; returns the loss as a tensor (holding the graph), not a float."""
    k = len(micro_batches)
    total = 0
    for i, (x, y) in enumerate(micro_batches):
        with contextlib.nullcontext() if i == k - 1 else model.no_sync():
            loss = loss_fn(model(x), y) / k
            loss.backward()
        total = total + loss
    optimizer.step()
    optimizer.zero_grad()
    return total


def assumes_no_sync(model, optimizer, loss_fn, micro_batches):
    """Right on DDP; a plain module has no no_sync."""
    k = len(micro_batches)
    if k == 0 or len({len(x) for x, _ in micro_batches}) > 1:
        raise ValueError("micro-batches")
    total = 0.0
    for i, (x, y) in enumerate(micro_batches):
        with contextlib.nullcontext() if i == k - 1 else model.no_sync():
            loss = loss_fn(model(x), y) / k
            loss.backward()
        total += loss.item()
    optimizer.step()
    optimizer.zero_grad()
    return total


def no_size_check(model, optimizer, loss_fn, micro_batches):
    """Right on every batch it is given; accepts [] and unequal micro-batches."""
    k = len(micro_batches)
    total = 0.0
    for i, (x, y) in enumerate(micro_batches):
        syncing = i == k - 1 or not hasattr(model, "no_sync")
        with contextlib.nullcontext() if syncing else model.no_sync():
            loss = loss_fn(model(x), y) / k
            loss.backward()
        total += loss.item()
    optimizer.step()
    optimizer.zero_grad()
    return total


ACCUMULATION_MISTAKES = {  # the wrong version: (its score, the first failing case's reason)
    no_loss_scaling: (
        0.4, "2 ranks, k=4 micro-batches of 2, 3 steps: rank 0: the weights of steps 4 times "
             "too large: each of the 4 micro-batch losses already averages over its samples"),
    sync_every_micro_batch: (
        0.4, "2 ranks, k=4 micro-batches of 2, 3 steps: rank 0: 12 all_reduce calls in 3 "
             "steps: one per micro-batch"),
    step_every_micro_batch: (
        0.4, "2 ranks, k=4 micro-batches of 2, 3 steps: rank 0: 12 all_reduce calls in 3 "
             "steps: one per micro-batch"),
    returns_last_loss: (
        0.4, "2 ranks, k=4 micro-batches of 2, 3 steps: rank 0: returns the loss of the last "
             "micro-batch; the step's loss is that of all 4 micro-batches together"),
    returns_a_tensor: (
        0.0, "2 ranks, k=4 micro-batches of 2, 3 steps: rank 0: returns a Tensor: the "
             "exercise asks for the loss of the whole batch, as a Python float"),
    assumes_no_sync: (1.6, "2 ranks, plain modules (no no_sync), k=2 of 2, 2 steps; [] and "
                           "unequal sizes refused: rank 0: raised AttributeError"),
    no_size_check: (1.6, "2 ranks, plain modules (no no_sync), k=2 of 2, 2 steps; [] and "
                         "unequal sizes refused: rank 0: accepts an empty list of micro-batches "
                         "instead of raising ValueError"),
}


@pytest.mark.cluster
def test_accumulation_step_solution_and_mistakes(scratch_cluster_4):
    full("lesson05.accumulation_step", accumulation_step, scratch_cluster_4)
    for wrong, (points, reason) in ACCUMULATION_MISTAKES.items():
        r = less("lesson05.accumulation_step", wrong, scratch_cluster_4)
        assert (r.points, reason) == (points, r.reason.split("first: ", 1)[1][:len(reason)]), \
            (wrong.__name__, r.points, r.reason)


@pytest.mark.cluster
def test_returning_the_wrong_loss_fails_on_2_3_and_4_ranks(scratch_cluster_4):
    """The value returned is checked as closely as the weights: the last micro-batch's loss
    scores less on every world size that has more than one micro-batch."""
    r = less("lesson05.accumulation_step", returns_last_loss, scratch_cluster_4)
    failed = {c.label.split(" ranks")[0] for c in r.cases if not c.passed}
    assert failed == {"2", "3", "4"}, str(r)
    passed = [c.label for c in r.cases if c.passed]
    assert passed == ["3 ranks, k=1 (a plain DDP step), 2 steps"], str(r)  # k = 1: the same
    assert "rank 2: returns the loss of the last micro-batch" in "".join(
        f"rank {row.rank}: {row.note}" for c in r.cases for row in c.rows)


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
