"""Lesson 08's exercises: the solutions (exported into course_lib.zero) score full points on 2, 3
and 4 ranks; realistic wrong versions score less, with a reason that says what is wrong."""

from __future__ import annotations

import math
import sys

import cloudpickle
import pytest
import torch

from conftest import full, less
from course_lib import zero
from course_lib.backend import default_dist

cloudpickle.register_pickle_by_value(sys.modules[__name__])  # engines cannot import tests/


# lesson08.shard_range -------------------------------------------------------------------------

def floor_division(numel, world_size, rank):
    size = numel // world_size  # drops the remainder: the last elements belong to nobody
    return rank * size, (rank + 1) * size


def remainder_to_the_last(numel, world_size, rank):
    size = numel // world_size  # uneven: the last rank's shard is larger, reduce_scatter fails
    return rank * size, numel if rank == world_size - 1 else (rank + 1) * size


def off_by_one(numel, world_size, rank):
    size = math.ceil(numel / world_size)
    return rank * size, (rank + 1) * size - 1


def test_shard_range_solution_and_mistakes():
    full("lesson08.shard_range", zero.shard_range)
    for wrong in (floor_division, remainder_to_the_last, off_by_one):
        less("lesson08.shard_range", wrong)


# lesson08.reduce_scatter_grads ----------------------------------------------------------------

def sums_not_averages(flat_grad, shard, *, dist=None, group=None, async_op=False):
    dist = default_dist(dist)
    work = dist.reduce_scatter(shard, list(flat_grad.chunk(dist.get_world_size(group))),
                               group=group, async_op=async_op)
    return work


def chunks_reversed(flat_grad, shard, *, dist=None, group=None, async_op=False):
    dist = default_dist(dist)
    world = dist.get_world_size(group)
    dist.reduce_scatter(shard, list(reversed(flat_grad.chunk(world))), group=group)
    shard.div_(world)
    return zero.Then(_Done(), lambda: None) if async_op else None


def all_reduce_then_slice(flat_grad, shard, *, dist=None, group=None, async_op=False):
    """The right numbers with the wrong communication: twice the bytes, the whole gradient."""
    dist = default_dist(dist)
    world = dist.get_world_size(group)
    total = flat_grad.clone()
    dist.all_reduce(total, group=group)
    shard.copy_(total.chunk(world)[dist.get_rank(group)] / world)
    return zero.Then(_Done(), lambda: None) if async_op else None


def divides_before_waiting(flat_grad, shard, *, dist=None, group=None, async_op=False):
    dist = default_dist(dist)
    world = dist.get_world_size(group)
    work = dist.reduce_scatter(shard, list(flat_grad.chunk(world)), group=group,
                               async_op=async_op)
    shard.div_(world)  # with async_op the reduction may not have landed yet
    return work


class _Done:
    def wait(self):
        return True


@pytest.fixture
def c4(scratch_cluster_4):
    return scratch_cluster_4


@pytest.mark.cluster
def test_reduce_scatter_grads_solution_and_mistakes(c4):
    full("lesson08.reduce_scatter_grads", zero.reduce_scatter_grads, c4)
    for wrong in (sums_not_averages, chunks_reversed, all_reduce_then_slice):
        less("lesson08.reduce_scatter_grads", wrong, c4)
    r = less("lesson08.reduce_scatter_grads", all_reduce_then_slice, c4)
    assert "calls" in r.reason and "all_reduce" in r.reason, r.reason
    # A race a fast reduction can win; the check's dist lands async results only in wait().
    r = less("lesson08.reduce_scatter_grads", divides_before_waiting, c4)
    assert "async" in r.reason, r.reason


# lesson08.zero1_step --------------------------------------------------------------------------

def gathers_before_stepping(optimizer, flats, shards, layouts, *, dist=None, group=None):
    for flat, shard, layout in zip(flats, shards, layouts):
        zero.all_gather_params(flat, shard.detach(), layout, dist=dist, group=group)
    optimizer.step()  # only this rank's shard moves: the ranks disagree on the rest


def all_reduces_the_update(optimizer, flats, shards, layouts, *, dist=None, group=None):
    """Right values, wrong communication: an all_reduce of the whole buffer moves twice as much."""
    dist = default_dist(dist)
    before = [flat.clone() for flat in flats]
    optimizer.step()
    for flat, old in zip(flats, before):
        delta = flat - old
        dist.all_reduce(delta, group=group)
        flat.copy_(old + delta)


def first_bucket_only(optimizer, flats, shards, layouts, *, dist=None, group=None):
    optimizer.step()
    zero.all_gather_params(flats[0], shards[0].detach(), layouts[0], dist=dist, group=group)


@pytest.mark.cluster
def test_zero1_step_solution_and_mistakes(c4):
    full("lesson08.zero1_step", zero.zero1_step, c4)
    for wrong in (gathers_before_stepping, all_reduces_the_update, first_bucket_only):
        less("lesson08.zero1_step", wrong, c4)


# lesson08.unshard and lesson08.reduce_unit_grad ------------------------------------------------

def gathers_into_full(flat, *, dist=None, group=None, async_op=False):
    """Right values, but written through `full`: its version counter moves, and backward fails
    on the views autograd saved in forward."""
    flat.full.untyped_storage().resize_(flat.nbytes)
    # detach() shares the version counter with `full`
    return zero.all_gather_params(flat.full.detach(), flat.shard.detach(), flat.layout,
                                  dist=dist, group=group, async_op=async_op)


def own_shard_only(flat, *, dist=None, group=None, async_op=False):
    flat.full.untyped_storage().resize_(flat.nbytes)
    rank = default_dist(dist).get_rank(group)
    flat.layout.chunks(flat.alias)[rank].copy_(flat.shard.detach())
    return None


def keeps_gathered(flat, *, dist=None, group=None):
    grad, flat.full.grad = flat.full.grad, None
    reduced = torch.empty(flat.layout.shard_numel, dtype=flat.layout.dtype)
    work = zero.reduce_scatter_grads(grad, reduced, dist=dist, group=group, async_op=True)
    return work, reduced, grad  # forgot flat.free(): ZeRO-3 keeps the whole model gathered


def sums_unit_grads(flat, *, dist=None, group=None):
    grad, flat.full.grad = flat.full.grad, None
    reduced = torch.empty(flat.layout.shard_numel, dtype=flat.layout.dtype)
    d = default_dist(dist)
    work = d.reduce_scatter(reduced, list(grad.chunk(d.get_world_size(group))), group=group,
                            async_op=True)
    flat.free()
    return work, reduced, grad


@pytest.mark.cluster
def test_fsdp_unit_exercises_solution_and_mistakes(c4):
    full("lesson08.unshard", zero.unshard, c4)
    r = less("lesson08.unshard", gathers_into_full, c4)
    assert "version" in r.reason, r.reason
    less("lesson08.unshard", own_shard_only, c4)
    full("lesson08.reduce_unit_grad", zero.reduce_unit_grad, c4)
    for wrong in (keeps_gathered, sums_unit_grads):
        less("lesson08.reduce_unit_grad", wrong, c4)
