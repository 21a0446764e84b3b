"""Lesson 00 (cluster): every rank sums its own balanced, contiguous shard of range(n)."""

from __future__ import annotations

from course_lib.grading import RANK, WORLD_SIZE, Exercise, case, register


def _shard_sum(rank: int, world_size: int, n: int) -> int:
    """sum(range(start, stop)) over this rank's shard; the first n % world_size take one more."""
    base, extra = divmod(n, world_size)
    start = rank * base + min(rank, extra)
    stop = start + base + (1 if rank < extra else 0)
    return sum(range(start, stop))


register(Exercise(
    name="lesson00.shard_sum",
    notebook="00_cluster",
    params=("rank", "world_size", "n"),
    cases=[
        case(RANK, WORLD_SIZE, 10, label="n=10"),
        case(RANK, WORLD_SIZE, 13, label="n=13 (remainder)"),
        case(RANK, WORLD_SIZE, 2, label="n=2 (fewer than ranks)"),
        case(RANK, WORLD_SIZE, 0, label="n=0 (nothing to sum)"),
    ],
    reference=_shard_sum,
    total=sum,
    points=2,
    hint=("Rank r owns range(start, stop) with start = r * (n // world_size) + min(r, n % "
          "world_size): the first n % world_size ranks take one extra element, so the shards "
          "do not overlap, leave nothing out, and differ in size by at most one."),
    distributed=True,
    world_size=3,       # the grader's cluster: odd, so a remainder lands on some ranks only
    backend="none",     # nothing is communicated
    time_limit=10.0,
))
