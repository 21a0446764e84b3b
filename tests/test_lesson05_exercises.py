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
    for i, (x, y) in enumerate(micro_batches):
        last = i == len(micro_batches) - 1
        with contextlib.nullcontext() if last else model.no_sync():
            loss_fn(model(x), y).backward()
    optimizer.step()
    optimizer.zero_grad()


def sync_every_micro_batch(model, optimizer, loss_fn, micro_batches):
    for x, y in micro_batches:
        (loss_fn(model(x), y) / len(micro_batches)).backward()
    optimizer.step()
    optimizer.zero_grad()


def step_every_micro_batch(model, optimizer, loss_fn, micro_batches):
    for x, y in micro_batches:
        (loss_fn(model(x), y) / len(micro_batches)).backward()
        optimizer.step()
        optimizer.zero_grad()


@pytest.mark.cluster
def test_accumulation_step_solution_and_mistakes(scratch_cluster_4):
    full("lesson05.accumulation_step", accumulation_step, scratch_cluster_4)
    for wrong in (no_loss_scaling, sync_every_micro_batch, step_every_micro_batch):
        less("lesson05.accumulation_step", wrong, scratch_cluster_4)


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


@pytest.mark.cluster
def test_no_sync_solution_and_mistakes(scratch_cluster_4):
    full("lesson05.no_sync", no_sync, scratch_cluster_4)
    for wrong in (restores_true, no_finally):
        less("lesson05.no_sync", wrong, scratch_cluster_4)
    r = less("lesson05.no_sync", switches_the_hooks, scratch_cluster_4)
    assert "all_reduce calls per step" in r.reason, r.reason  # right weights, k messages


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
    for wrong in (counts_parameters, counts_twice, counts_outputs):
        less("lesson05.saved_activation_bytes", wrong)
