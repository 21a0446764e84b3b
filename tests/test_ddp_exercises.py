"""Exercises of lessons 03-05: the solutions score full points, realistic mistakes score less."""

from __future__ import annotations

import contextlib
import sys

import cloudpickle
import pytest
import torch

from course_lib.accumulation import accumulation_step
from course_lib.backend import default_dist
from course_lib.data import shard_indices
from course_lib.ddp import (allreduce_grads_flat, buckets_to_launch, flatten_into,
                            unflatten_to_grads)
from course_lib.grading import grade_function

cloudpickle.register_pickle_by_value(sys.modules[__name__])  # engines cannot import tests/


def full(name, fn, cluster=None):
    r = grade_function(name, fn, cluster)
    assert r.points == r.max_points, r


def less(name, fn, cluster=None):
    r = grade_function(name, fn, cluster)
    assert r.points < r.max_points, r


# lesson03.shard_indices -----------------------------------------------------------------------

def _perm(n, shuffle, seed):
    if not shuffle:
        return list(range(n))
    return torch.randperm(n, generator=torch.Generator().manual_seed(seed)).tolist()


def contiguous_blocks(n, num_replicas, rank, shuffle=True, seed=0, drop_last=False):
    idx = _perm(n, shuffle, seed)
    per = -(-n // num_replicas)
    idx = (idx * num_replicas)[:per * num_replicas]
    return idx[rank * per:(rank + 1) * per]


def no_padding(n, num_replicas, rank, shuffle=True, seed=0, drop_last=False):
    return _perm(n, shuffle, seed)[rank::num_replicas]


def always_pad(n, num_replicas, rank, shuffle=True, seed=0, drop_last=False):
    return shard_indices(n, num_replicas, rank, shuffle, seed, drop_last=False)


def seed_per_rank(n, num_replicas, rank, shuffle=True, seed=0, drop_last=False):
    return shard_indices(n, num_replicas, rank, shuffle, seed + rank, drop_last)


def test_shard_indices_solution_and_mistakes():
    full("lesson03.shard_indices", shard_indices)
    for wrong in (contiguous_blocks, no_padding, always_pad, seed_per_rank):
        less("lesson03.shard_indices", wrong)


# lesson04.buckets_to_launch -------------------------------------------------------------------

def every_complete_bucket(next_bucket, complete):
    """Launches in completion order: ranks whose gradients arrive differently would start
    different all_reduces at the same moment (mismatched collectives)."""
    return [i for i in range(next_bucket, len(complete)) if complete[i]]


def from_zero(next_bucket, complete):
    return buckets_to_launch(0, complete)


def test_buckets_to_launch_solution_and_mistakes():
    full("lesson04.buckets_to_launch", buckets_to_launch)
    less("lesson04.buckets_to_launch", every_complete_bucket)
    less("lesson04.buckets_to_launch", from_zero)


# distributed exercises, on one 2-rank gloo cluster --------------------------------------------

def sum_not_average(params, *, dist=None, group=None):
    dist = default_dist(dist)
    flat = torch.cat([p.grad.reshape(-1) for p in params])
    dist.all_reduce(flat, group=group)
    unflatten_to_grads(flat, params)


def never_copied_back(params, *, dist=None, group=None):
    dist = default_dist(dist)
    flat = torch.cat([p.grad.reshape(-1) for p in params])
    dist.all_reduce(flat, group=group)
    flat /= dist.get_world_size(group)


def divide_by_param_count(params, *, dist=None, group=None):
    dist = default_dist(dist)
    flat = torch.empty(sum(p.numel() for p in params))
    flatten_into(flat, [p.grad for p in params])
    dist.all_reduce(flat, group=group)
    unflatten_to_grads(flat / len(params), params)


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


@pytest.fixture(scope="module")
def c2():
    from course_lib.cluster import start

    with start(2, backend="gloo", timeout=60) as c:
        yield c


@pytest.mark.cluster
def test_distributed_exercises_solution_and_mistakes(c2):
    full("lesson04.allreduce_grads_flat", allreduce_grads_flat, c2)
    for wrong in (sum_not_average, never_copied_back, divide_by_param_count):
        less("lesson04.allreduce_grads_flat", wrong, c2)
    full("lesson05.accumulation_step", accumulation_step, c2)
    for wrong in (no_loss_scaling, sync_every_micro_batch, step_every_micro_batch):
        less("lesson05.accumulation_step", wrong, c2)
