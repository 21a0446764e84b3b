"""The parallel layout: how the world's ranks split into data, tensor and pipeline groups.

`ParallelLayout(dp=2, tp=2, pp=1)` checks the degrees against the world size once, builds every
sub-group once (every rank takes part in every `new_group` call, in the same order, as torch
requires) and is passed explicitly to the components that need a group (torchtitan's
`ParallelDims` is the model). Ranks are laid out with tp innermost, then dp, then pp:

    rank = (pp_rank * dp + dp_rank) * tp + tp_rank

so a tensor-parallel group is contiguous ranks (the ones that talk most, on one host first)
and a data-parallel group never crosses a pipeline stage.
"""

from __future__ import annotations

from typing import Any

from course_lib.backend import default_dist

AXES = ("pp", "dp", "tp")  # outermost to innermost: the order of the rank arithmetic


def check_degrees(dp: int, tp: int, pp: int, world_size: int) -> dict[str, int]:
    """{"pp": pp, "dp": dp, "tp": tp}, or a ValueError naming the degrees that do not fit (the
    capstone calls this before any engine allocates)."""
    degrees = {"pp": pp, "dp": dp, "tp": tp}
    bad = {axis: d for axis, d in degrees.items()
           if isinstance(d, bool) or not isinstance(d, int) or d < 1}
    if bad:
        named = ", ".join(f"{axis}={d!r}" for axis, d in bad.items())
        raise ValueError(f"ParallelLayout: degrees must be positive ints, got {named} "
                         f"(dp={dp!r}, tp={tp!r}, pp={pp!r})")
    if dp * tp * pp != world_size:
        raise ValueError(f"ParallelLayout: dp={dp} x tp={tp} x pp={pp} = {dp * tp * pp}, "
                         f"but the world has {world_size} ranks")
    return degrees


def layout_groups(dp: int, tp: int, pp: int) -> dict[str, list[list[int]]]:
    """Every group along each axis as its global ranks, in order of their coordinate on that
    axis, the groups ordered by their first rank: tp groups are contiguous ranks, dp groups
    stay inside one pipeline stage, pp groups run across the stages."""
    ### BEGIN SOLUTION
    def rank(p: int, d: int, t: int) -> int:
        return (p * dp + d) * tp + t

    groups: dict[str, list[list[int]]] = {"pp": [], "dp": [], "tp": []}
    for p in range(pp):
        for d in range(dp):
            groups["tp"].append([rank(p, d, t) for t in range(tp)])
        for t in range(tp):
            groups["dp"].append([rank(p, d, t) for d in range(dp)])
    for d in range(dp):
        for t in range(tp):
            groups["pp"].append([rank(p, d, t) for p in range(pp)])
    ### END SOLUTION
    return groups


class ParallelLayout:
    """Degrees (dp, tp, pp), this rank's coordinate on each axis, and the groups it is in."""

    def __init__(self, dp: int = 1, tp: int = 1, pp: int = 1, *, dist: Any = None):
        self.dist = default_dist(dist)
        self.world_size, self.rank = self.dist.get_world_size(), self.dist.get_rank()
        self.degrees = check_degrees(dp, tp, pp, self.world_size)
        self.coords = self.coordinates(self.rank)
        self.groups: dict[str, Any] = {}
        every = layout_groups(dp, tp, pp)
        for axis in AXES:  # every rank creates every group, in this order
            for ranks in every[axis]:
                group = self.dist.new_group(ranks)
                if self.rank in ranks:
                    self.groups[axis] = group

    @property
    def dp(self) -> int:
        return self.degrees["dp"]

    @property
    def tp(self) -> int:
        return self.degrees["tp"]

    @property
    def pp(self) -> int:
        return self.degrees["pp"]

    def coordinates(self, rank: int) -> dict[str, int]:
        """{"pp": ..., "dp": ..., "tp": ...} of global `rank`."""
        coords = {}
        for axis in reversed(AXES):
            rank, coords[axis] = divmod(rank, self.degrees[axis])
        return coords

    def rank_of(self, **coords: int) -> int:
        """The global rank at the given coordinates (every axis named)."""
        rank = 0
        for axis in AXES:
            rank = rank * self.degrees[axis] + coords[axis]
        return rank

    def ranks(self, axis: str, rank: int | None = None) -> list[int]:
        """The global ranks of `rank`'s group along `axis` (this rank's by default), in order
        of their coordinate on that axis."""
        if axis not in AXES:
            raise ValueError(f"unknown axis {axis!r}; axes are {AXES}")
        coords = self.coordinates(self.rank if rank is None else rank)
        return [self.rank_of(**{**coords, axis: i}) for i in range(self.degrees[axis])]

    def all_groups(self, axis: str) -> list[list[int]]:
        """Every group along `axis`, each as its global ranks, ordered by their first rank."""
        return layout_groups(self.dp, self.tp, self.pp)[axis]

    def group(self, axis: str) -> Any:
        """This rank's process group along `axis`, to pass as `group=` to a component."""
        return self.groups[axis]

    def __repr__(self) -> str:
        where = ", ".join(f"{axis}_rank={self.coords[axis]}" for axis in AXES)
        return f"ParallelLayout(dp={self.dp}, tp={self.tp}, pp={self.pp}; rank {self.rank}: {where})"
