"""Lesson 05's exercises: the accumulation step and no_sync; the solutions score full points,
realistic wrong versions less, on 2, 3 and 4 of a 4-rank scratch cluster."""

from __future__ import annotations

import contextlib
import sys

import cloudpickle
import pytest

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
    for wrong in (restores_true, no_finally, switches_the_hooks):
        less("lesson05.no_sync", wrong, scratch_cluster_4)
