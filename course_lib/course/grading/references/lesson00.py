"""Lesson 00's expected values and explanations (judge side: see this package's docstring)."""

from __future__ import annotations

import torch

from course_lib.i18n import _


def shard_sum(rank: int, world_size: int, k: int, n: int) -> int | None:
    """The sum of rank's shard in a world of k (None for the ranks that sit out): tensor_split
    gives the first n % k ranks one more, the balanced contiguous split the exercise asks for."""
    if rank >= k:
        return None
    return int(torch.tensor_split(torch.arange(n), k)[rank].sum())


def _shard(rank: int, k: int, n: int) -> tuple[int, int]:
    """(first, stop) of rank's shard of range(n) on k ranks."""
    sizes = [len(s) for s in torch.tensor_split(torch.arange(n), k)]
    first = sum(sizes[:rank])
    return first, first + sizes[rank]


def _elements(first: int, stop: int) -> str:
    if stop <= first:
        return _("empty (no element)")
    if stop == first + 1:
        return _("element {i}", i=first)
    return _("elements {first} to {last}", first=first, last=stop - 1)


def _runs_summing_to(total: int, n: int) -> list[tuple[int, int]]:
    """Every run [a, b) of range(n), or reaching up to 2 past its end, whose elements sum to
    `total`."""
    return [(a, b) for a in range(n + 1) for b in range(a + 1, n + 3)
            if sum(range(a, b)) == total]


def explain_shard_sum(case, rank, expected, got) -> str | None:
    """Which run of range(n) sums to the learner's value, against the rank's shard: the
    elements it takes from a neighbour's shard, or leaves out of its own. A sum is ambiguous:
    the run nearest the shard (in place and length) is named only when it is the one nearest."""
    if expected is None or isinstance(got, bool) or not isinstance(got, int):
        return None
    k, n = case.args[2], case.args[3]
    first, stop = _shard(rank, k, n)
    shard = _elements(first, stop)

    def off(run: tuple[int, int]) -> int:  # how far a run is from the shard
        a, b = run
        return abs(a - first) + abs(b - stop) + abs((b - a) - (stop - first))

    runs = _runs_summing_to(got, n)
    # Element 0 adds nothing: of two runs that differ only by it, keep the nearer one.
    def nearer(r: tuple[int, int]) -> tuple[int, int]:
        return off(r), abs(r[0] - first)

    runs = sorted((r for r in runs if (1 - r[0], r[1]) not in runs
                   or nearer(r) < nearer((1 - r[0], r[1]))), key=off)
    if got == sum(range(rank, n, k)) and n > k and not (runs and off(runs[0]) <= 2):
        return _("got the sum of a strided shard (one element in {k}, from element {rank}: "
                 "the demo's split); this rank's shard is one contiguous run, {shard}",
                 k=k, rank=rank, shard=shard)
    if not runs or len(runs) > 1 and off(runs[0]) == off(runs[1]):  # no single guess
        if got > expected:
            return _("more than the sum of this rank's shard, {shard}", shard=shard)
        return _("less than the sum of this rank's shard, {shard}", shard=shard)
    a, b = runs[0]
    said = _("got the sum of {got}; this rank's shard is {shard}", got=_elements(a, b),
             shard=shard)
    if a <= first and b >= stop:
        taken = [*range(a, first), *range(stop, b)]
        if all(i >= n for i in taken):
            return said + _(": it runs past the end of range({n})", n=n)
        owners = sorted({r for r in range(k) for i in taken
                         if r != rank and _shard(r, k, n)[0] <= i < _shard(r, k, n)[1]})
        if len(taken) == 1:
            return said + _(": one element too many, from rank {owner}'s shard",
                            owner=owners[0])
        if len(owners) == 1:
            return said + _(": {extra} elements too many, from rank {owner}'s shard",
                            extra=len(taken), owner=owners[0])
        return said + _(": {extra} elements too many, from the shards of ranks {owners}",
                        extra=len(taken), owners=", ".join(map(str, owners)))
    if a >= first and b <= stop:
        missing = (a - first) + (stop - b)
        if missing == 1:
            return said + _(": one element short")
        return said + _(": {missing} elements short", missing=missing)
    return said
