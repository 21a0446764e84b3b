"""Lesson 00's expected values (judge side: see this package's docstring)."""

from __future__ import annotations

import torch


def shard_sum(rank: int, world_size: int, k: int, n: int) -> int | None:
    """The sum of rank's shard in a world of k (None for the ranks that sit out): tensor_split
    gives the first n % k ranks one more, the balanced contiguous split the exercise asks for."""
    if rank >= k:
        return None
    return int(torch.tensor_split(torch.arange(n), k)[rank].sum())
