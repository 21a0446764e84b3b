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
    reasons = {
        contiguous_blocks: "12 samples, 3 ranks, rank 1, in order: the right length, but a "
                           "contiguous block of the order: in torch's sampler the ranks take "
                           "turns through it",
        no_padding: "10 on 4 ranks: pad by wrapping (rank 3): 2 indices where every rank gets 3: "
                    "without drop_last the order is padded from its start",
        always_pad: "10 on 4 ranks, drop_last (rank 2): 3 indices; with drop_last every rank "
                    "keeps 2: the tail that does not fill a whole turn of all ranks is dropped",
        seed_per_rank: "shuffled, seed 6, drop_last (rank 2): the shard that seed 8 gives, not "
                       "seed 6: every rank must shuffle with the same seed",
    }
    for wrong, reason in reasons.items():
        result = less("lesson03.shard_indices", wrong)
        assert "first: " + reason in result.reason, (wrong.__name__, result.reason)
