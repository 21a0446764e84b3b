"""Lesson 00 (cluster): every rank sums its own balanced, contiguous shard of range(n), on worlds
of 2, 3 and 4 ranks."""

from __future__ import annotations

from course_lib.course.grading import RANK, WORLD_SIZE, Exercise, case, register


def shard_sum_harness(fn, rank: int, world_size: int, k: int, n: int):
    """Ranks 0..k-1 of the grader's cluster play a world of k; the others sit out (None)."""
    return fn(rank, k, n) if rank < k else None


def _total(values: list) -> int:
    """What the ranks' sums add up to: sum(range(n)) when the shards tile range(n)."""
    return sum(v for v in values if v is not None)


register(Exercise(
    name="lesson00.shard_sum",
    notebook="00_cluster",
    params=("rank", "world_size", "n"),
    cases=[
        case(RANK, WORLD_SIZE, 2, 13, label="2 ranks, n=13 (remainder)"),
        case(RANK, WORLD_SIZE, 3, 10, label="3 ranks, n=10"),
        case(RANK, WORLD_SIZE, 3, 2, label="3 ranks, n=2 (fewer than ranks)"),
        case(RANK, WORLD_SIZE, 4, 14, label="4 ranks, n=14 (remainder 2)"),
        case(RANK, WORLD_SIZE, 4, 0, label="4 ranks, n=0 (nothing to sum)"),
    ],
    reference="lesson00:shard_sum",
    harness=shard_sum_harness,
    total=_total,
    points=2,
    explain="lesson00:explain_shard_sum",
    hints=("The shards tile range(n) in rank order: each is one contiguous run of elements, "
           "next to its neighbours' with no gap and no overlap, and their lengths differ by at "
           "most one, the longer ones first.",
           "Draw n = 10 on 4 ranks as runs of 3, 3, 2 and 2 elements. A rank's run begins right "
           "after every element of the ranks before it: count those ranks' elements, the base "
           "share each plus the extra ones that went to the first ranks, then add this rank's "
           "own length to find where its run ends."),
    distributed=True,
    world_size=4,       # the grader's cluster: its first 2, 3 and 4 ranks play worlds of that size
    backend="none",     # nothing is communicated
    time_limit=10.0,
))
