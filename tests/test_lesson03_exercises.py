"""Lesson 03's exercise: the sampler's core; the solution scores full points, realistic
wrong versions less."""

from __future__ import annotations

import torch

from conftest import full, less
from course_lib.data import shard_indices


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
