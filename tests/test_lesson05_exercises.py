"""Lesson 05's exercise: the accumulation step; the solution scores full points, realistic
wrong versions less, on a 2-rank gloo cluster."""

from __future__ import annotations

import contextlib
import sys

import cloudpickle
import pytest

from conftest import full, less
from course_lib.accumulation import accumulation_step

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
def test_accumulation_step_solution_and_mistakes(gloo_cluster_2):
    full("lesson05.accumulation_step", accumulation_step, gloo_cluster_2)
    for wrong in (no_loss_scaling, sync_every_micro_batch, step_every_micro_batch):
        less("lesson05.accumulation_step", wrong, gloo_cluster_2)
