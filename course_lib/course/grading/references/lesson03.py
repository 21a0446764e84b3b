"""Lesson 03's expected values and explanations (judge side: see this package's docstring)."""

from __future__ import annotations

from course_lib.i18n import _


def shard_indices(n: int, num_replicas: int, rank: int, shuffle: bool = True, seed: int = 0,
                  drop_last: bool = False) -> list[int]:
    """torch's own sampler: the indices rank `rank` reads."""
    from torch.utils.data import DistributedSampler

    return list(DistributedSampler(range(n), num_replicas, rank, shuffle=shuffle, seed=seed,
                                   drop_last=drop_last))


def _order(n: int, shuffle: bool, seed: int) -> list[int]:
    import torch

    if not shuffle:
        return list(range(n))
    return torch.randperm(n, generator=torch.Generator().manual_seed(seed)).tolist()


def explain_shard_indices(case, rank, expected, got) -> str | None:
    """The sampler's invariant a wrong list breaks: the length every rank gets, taking turns
    (not a block), or the shared permutation (a different seed, or none)."""
    if not isinstance(got, list) or not isinstance(expected, list):
        return None
    n, p, r, shuffle, seed, drop_last = case.args
    if len(got) != len(expected):
        if drop_last and len(got) > len(expected):
            return _("{got} indices; with drop_last every rank keeps {want}: the tail that does "
                     "not fill a whole turn of all ranks is dropped, not padded",
                     got=len(got), want=len(expected))
        if not drop_last and len(got) < len(expected):
            return _("{got} indices where every rank gets {want}: without drop_last the order "
                     "is padded from its start, so no rank runs fewer steps than another",
                     got=len(got), want=len(expected))
        return _("{got} indices; every rank must get {want}", got=len(got), want=len(expected))
    total = len(expected) * p
    padded = (_order(n, shuffle, seed) * (total // n + 1))[:total]
    if got == padded[r * len(got):(r + 1) * len(got)] and got != expected:
        return _("the right length, but a contiguous block of the order: in torch's sampler "
                 "the ranks take turns through it")
    if shuffle and got == shard_indices(n, p, r, False, seed, drop_last):
        return _("the unshuffled order's indices: with shuffle the order is torch's "
                 "permutation for seed {seed}", seed=seed)
    if shuffle:
        for other in range(seed - 8, seed + 9):
            if other != seed and got == shard_indices(n, p, r, True, other, drop_last):
                return _("the shard that seed {other} gives, not seed {seed}: every rank must "
                         "shuffle with the same seed, the one it is given", other=other,
                         seed=seed)
    return None
