"""Lesson 06's exercises: the solutions score full points, realistic wrong versions less."""

from __future__ import annotations

import sys

import cloudpickle
import pytest
import torch

from course_lib.backend import default_dist
from course_lib.grading import grade_function
from course_lib.tensor_parallel import copy_to_parallel, divide, reduce_from_parallel, shard

cloudpickle.register_pickle_by_value(sys.modules[__name__])  # engines cannot import tests/


def _shard_ignores_parts(tensor, dim, rank, world_size, parts=1):
    size = divide(tensor.shape[dim], world_size, "dim")
    return tensor.narrow(dim, rank * size, size).clone()


def _shard_wrong_offset(tensor, dim, rank, world_size, parts=1):
    blocks = tensor.chunk(parts, dim=dim)
    size = blocks[0].shape[dim] // world_size
    return torch.cat([b.narrow(dim, rank, size) for b in blocks], dim=dim)


def _shard_interleaved(tensor, dim, rank, world_size, parts=1):
    index = torch.arange(rank, tensor.shape[dim], world_size)
    return tensor.index_select(dim, index)


def test_shard_exercise_scores_solution_and_rejects_wrong_shards():
    assert grade_function("lesson06.shard", shard).points == 2
    for wrong in (_shard_ignores_parts, _shard_wrong_offset, _shard_interleaved):
        result = grade_function("lesson06.shard", wrong)
        assert result.points < 2, (wrong.__name__, result.reason)


class _NoAllReduceBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dist, group):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad, None, None


def _copy_missing_all_reduce(x, dist=None, group=None):
    return _NoAllReduceBackward.apply(x, dist, group)


class _AllReduceBothWays(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dist, group):
        ctx.dist = default_dist(dist)
        out = x.clone()
        ctx.dist.all_reduce(out)
        return out

    @staticmethod
    def backward(ctx, grad):
        grad = grad.clone()
        ctx.dist.all_reduce(grad)
        return grad, None, None


def _reduce_also_in_backward(x, dist=None, group=None):
    return _AllReduceBothWays.apply(x, dist, group)


@pytest.mark.cluster
def test_f_and_g_exercises_catch_misplaced_all_reduce(gloo_cluster_2):
    cluster = gloo_cluster_2
    assert grade_function("lesson06.copy_to_parallel", copy_to_parallel, cluster).points == 2
    assert grade_function("lesson06.reduce_from_parallel", reduce_from_parallel,
                          cluster).points == 2
    missing = grade_function("lesson06.copy_to_parallel", _copy_missing_all_reduce, cluster)
    assert missing.points == 0, missing.reason
    # g used where f belongs: the forward already sums, so the values are wrong too.
    swapped = grade_function("lesson06.copy_to_parallel", _reduce_also_in_backward, cluster)
    assert swapped.points == 0, swapped.reason
    twice = grade_function("lesson06.reduce_from_parallel", _reduce_also_in_backward, cluster)
    assert twice.points == 0 and "grad" in twice.reason, twice.reason
