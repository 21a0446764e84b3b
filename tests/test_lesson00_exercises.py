"""Lesson 00's exercise end to end: solution -> student release -> check on the cluster -> grade."""

import sys
from pathlib import Path

import cloudpickle
import nbformat
import psutil
import pytest

from conftest import leftover_processes, less
from course_lib.cluster import start
from course_lib.course.grading import get_exercise
from course_lib.course.grading.learner import grade_function
from course_lib.course.grading.batch import grade_all

pytestmark = pytest.mark.cluster
ROOT = Path(__file__).resolve().parent.parent
NAME = "lesson00.shard_sum"


def _defined_in(notebook: Path, function: str):
    """Exec the notebook's cell that defines `function` (it is self-contained) and return it."""
    nb = nbformat.read(notebook, as_version=4)
    (source,) = [c.source for c in nb.cells
                 if c.cell_type == "code" and c.source.startswith(f"def {function}(")]
    namespace: dict = {}
    exec(compile(source, str(notebook), "exec"), namespace)
    return namespace[function]


def off_by_one(rank, world_size, n):  # `<=` hands one more rank an extra element
    base, extra = divmod(n, world_size)
    start = rank * base + min(rank, extra)
    return sum(range(start, start + base + (1 if rank <= extra else 0)))


def overlapping(rank, world_size, n):  # inclusive stop: neighbours share an element
    base, extra = divmod(n, world_size)
    start = rank * base + min(rank, extra)
    return sum(range(start, min(n, start + base + (1 if rank < extra else 0) + 1)))


def missing_remainder(rank, world_size, n):  # n % world_size elements belong to no rank
    base = n // world_size
    return sum(range(rank * base, (rank + 1) * base))


def remainder_on_last_rank(rank, world_size, n):  # covers range(n), but unbalanced
    base = n // world_size
    stop = n if rank == world_size - 1 else (rank + 1) * base
    return sum(range(rank * base, stop))


def hangs_on_rank_1(rank, world_size, n):
    while rank == 1:
        pass
    return 0


def exits_on_rank_0(rank, world_size, n):
    import os

    if rank == 0:
        os._exit(3)
    return 0


@pytest.fixture(scope="module")
def cluster():
    # The engines cannot import this test module: ship its functions by value, as a
    # notebook's functions are.
    cloudpickle.register_pickle_by_value(sys.modules[__name__])
    ex = get_exercise(NAME)
    try:
        with start(ex.world_size, backend=ex.backend) as c:
            yield c
    finally:
        cloudpickle.unregister_pickle_by_value(sys.modules[__name__])


def test_solution_full_and_release_not_implemented(cluster):
    solution = grade_function(NAME, _defined_in(ROOT / "solutions" / "00_cluster.ipynb",
                                                "shard_sum"), cluster)
    assert (solution.points, solution.reason) == (2.0, "all 5 cases passed"), str(solution)
    assert [len(c.rows) for c in solution.cases] == [5] * 5  # 4 ranks + the total
    release = grade_function(NAME, _defined_in(ROOT / "notebooks" / "00_cluster.ipynb",
                                               "shard_sum"), cluster)
    assert release.points == 0.0
    assert release.reason == "not implemented yet: shard_sum raises NotImplementedError"


@pytest.mark.parametrize("wrong, reason", [
    (off_by_one, "2 ranks, n=13 (remainder): rank 1: got the sum of elements 7 to 13; this "
                 "rank's shard is elements 7 to 12: it runs past the end of range(13)"),
    (overlapping, "2 ranks, n=13 (remainder): rank 0: got the sum of elements 0 to 7; this "
                  "rank's shard is elements 0 to 6: one element too many, from rank 1's shard"),
    (missing_remainder, "2 ranks, n=13 (remainder): rank 0: got the sum of elements 0 to 5; "
                        "this rank's shard is elements 0 to 6: one element short"),
    (remainder_on_last_rank, "2 ranks, n=13 (remainder): rank 0: got the sum of elements 0 "
                             "to 5; this rank's shard is elements 0 to 6: one element short"),
])
def test_realistic_mistakes_score_below_full(cluster, wrong, reason):
    result = less(NAME, wrong, cluster)  # its feedback shows no code of the answer either
    assert result.reason.endswith("first: " + reason), result.reason
    notes = {r.note for c in result.cases for r in c.rows if not r.passed and r.rank != "all"}
    assert "wrong value" not in notes, str(result)  # every wrong rank says why, in shards


def test_a_strided_shard_is_named(cluster):
    def strided(rank, world_size, n):  # the demo's split, not the exercise's
        return sum(range(rank, n, world_size))

    result = less(NAME, strided, cluster)
    assert "rank 0: got the sum of a strided shard (one element in 2, from element 0" in \
        result.reason, result.reason


def test_partial_credit_is_by_case(cluster):
    # Without a remainder (n=0) even the missing-remainder version is right: 1 case of 5.
    assert grade_function(NAME, missing_remainder, cluster).points == 0.4


def test_deadlock_on_one_rank_cut_off_then_cluster_usable(cluster):
    result = grade_function(NAME, hangs_on_rank_1, cluster, time_limit=3)
    assert result.points == 0.0
    assert result.reason.startswith("timed out: 2 ranks, n=13 (remainder) did not finish "
                                    "within 3s on rank(s) 1 "
                                    "(an endless loop or a deadlock?)")
    again = grade_function(NAME, _defined_in(ROOT / "solutions" / "00_cluster.ipynb",
                                             "shard_sum"), cluster)
    assert again.points == 2.0, str(again)


def test_engine_killed_by_the_function_is_reported(cluster):  # last user of `cluster`
    result = grade_function(NAME, exits_on_rank_0, cluster)
    assert result.points == 0.0
    assert result.reason.startswith("an engine died during 2 ranks, n=13 (remainder)")
    assert [r.note for r in result.cases[1].rows] == ["not run"]


def test_batch_grading_of_a_distributed_lesson(tmp_path):
    """course-grade runs a real lesson, cluster and all, and gives the solution full points.
    (An untouched student release scoring 0 with "not implemented yet" is shown on the
    grading fixture in test_grading_batch.py, which needs no cluster: the suite's budget.)"""
    before = set(leftover_processes())  # e.g. the module's cluster
    rows = grade_all([ROOT / "solutions" / "00_cluster.ipynb"], tmp_path,
                     notebook_timeout=300, progress=lambda line: None)
    assert len(rows) == 1
    assert (rows[0]["points"], rows[0]["reason"]) == (2.0, "all 5 cases passed")
    left = set(leftover_processes()) - before  # found by the session marker, even orphans
    assert psutil.wait_procs(left, timeout=5)[1] == [], left
