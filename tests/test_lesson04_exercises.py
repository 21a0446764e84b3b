"""Lesson 04's exercises: bucket launch order and the flat all_reduce; the solutions score full
points, realistic wrong versions less (the distributed one on a 2-rank gloo cluster)."""

from __future__ import annotations

import sys

import cloudpickle
import pytest
import torch

from conftest import full, less
from course_lib.backend import default_dist
from course_lib.ddp import (allreduce_grads_flat, buckets_to_launch, flatten_into,
                            unflatten_to_grads)

cloudpickle.register_pickle_by_value(sys.modules[__name__])  # engines cannot import tests/


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


@pytest.mark.cluster
def test_flat_all_reduce_solution_and_mistakes(gloo_cluster_2):
    full("lesson04.allreduce_grads_flat", allreduce_grads_flat, gloo_cluster_2)
    for wrong in (sum_not_average, never_copied_back, divide_by_param_count):
        less("lesson04.allreduce_grads_flat", wrong, gloo_cluster_2)
