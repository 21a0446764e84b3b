"""Data sharding: each rank reads its own slice of the dataset, the same way torch does."""

from __future__ import annotations

import math
from typing import Any, Iterator, Sized

import torch


def default_dist(dist: Any = None) -> Any:
    """The `dist`-like module to use: the one given, else torch.distributed if it is
    initialized, else `course_lib.dist` (the contract in CONTRIBUTING.md)."""
    if dist is not None:
        return dist
    import torch.distributed as tdist

    if tdist.is_available() and tdist.is_initialized():
        return tdist
    from course_lib import dist as scratch

    return scratch


class DistributedSampler(torch.utils.data.Sampler):
    """Yields the indices of `dataset` that belong to `rank`, as torch's DistributedSampler does.

    Shuffles with `seed + epoch` (call `set_epoch` every epoch), then pads by wrapping around
    (or drops the tail when `drop_last`) so every rank gets the same number of samples.
    """

    def __init__(self, dataset: Sized, num_replicas: int | None = None, rank: int | None = None,
                 shuffle: bool = True, seed: int = 0, drop_last: bool = False, *,
                 group: Any = None, dist: Any = None) -> None:
        if num_replicas is None or rank is None:
            d = default_dist(dist)
            if not d.is_initialized():
                raise RuntimeError("DistributedSampler: pass num_replicas and rank, or "
                                   "initialize a process group first")
            num_replicas = d.get_world_size(group) if num_replicas is None else num_replicas
            rank = d.get_rank(group) if rank is None else rank
        if not isinstance(num_replicas, int) or num_replicas < 1:
            raise ValueError(f"num_replicas must be a positive int, got {num_replicas!r}")
        if not isinstance(rank, int) or not 0 <= rank < num_replicas:
            raise ValueError(f"invalid rank {rank!r}: rank must be in [0, {num_replicas - 1}]")
        n = len(dataset)
        if n == 0:
            raise ValueError("DistributedSampler: the dataset is empty")
        if drop_last and n < num_replicas:
            raise ValueError(f"DistributedSampler: drop_last with {n} samples and "
                             f"{num_replicas} replicas leaves every rank empty")
        self.dataset, self.num_replicas, self.rank = dataset, num_replicas, rank
        self.shuffle, self.seed, self.drop_last, self.epoch = shuffle, seed, drop_last, 0
        # Dropping keeps the largest multiple of num_replicas; padding rounds up to one.
        self.num_samples = n // num_replicas if drop_last else math.ceil(n / num_replicas)
        self.total_size = self.num_samples * num_replicas

    def __iter__(self) -> Iterator[int]:
        return iter(shard_indices(len(self.dataset), self.num_replicas, self.rank,
                                  shuffle=self.shuffle, seed=self.seed + self.epoch,
                                  drop_last=self.drop_last))

    def __len__(self) -> int:
        return self.num_samples

    def set_epoch(self, epoch: int) -> None:
        """Reshuffle differently next epoch, identically on every rank (same seed + epoch)."""
        self.epoch = epoch


def shard_indices(n: int, num_replicas: int, rank: int, shuffle: bool = True, seed: int = 0,
                  drop_last: bool = False) -> list[int]:
    """The indices rank `rank` reads from a dataset of `n` samples (the sampler's core)."""
    if shuffle:
        g = torch.Generator()
        g.manual_seed(seed)
        indices = torch.randperm(n, generator=g).tolist()
    else:
        indices = list(range(n))
    per_rank = n // num_replicas if drop_last else math.ceil(n / num_replicas)
    total = per_rank * num_replicas
    if total > n:
        # Wrap around as many times as needed (a tiny dataset on many ranks repeats itself).
        indices = (indices * math.ceil(total / n))[:total]
    else:
        indices = indices[:total]
    # Strided, not contiguous: rank r takes r, r+p, r+2p, ... exactly as torch does.
    return indices[rank:total:num_replicas]
