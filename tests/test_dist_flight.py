"""The flight recorder: each rank's record of its collectives, and errors that say which rank
is to blame when one rank sleeps, skips a collective or calls one with another shape.

Every scenario runs on 2, 3 and 4 ranks, each in a group of its own within one spawn per world
size (the last rank misbehaves after three good all_reduces, so the bad call is #3); every
other rank must fail within the group's timeout plus the time to ask its peers, with an error
that names the culprit and what it did.
"""

from __future__ import annotations

import re
import time

import pytest
import torch

from course_lib.spawn import spawn

TIMEOUT = 2.0
SLACK = 4.0  # asking each peer for its record (at most QUERY_TIMEOUT) and scheduling noise


def misbehave(dist, group, case: str) -> dict:
    """Three good all_reduces on `group`, then the last rank misbehaves in call #3."""
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    t = torch.ones(1024)
    for _ in range(3):
        dist.all_reduce(t, group=group)
    culprit = world - 1
    start = time.monotonic()
    try:
        if rank == culprit and case == "sleep":
            time.sleep(TIMEOUT + 1.0)  # too late for all_reduce #3: the others have given up
            return {"error": None, "seconds": time.monotonic() - start}
        if case == "skip" and rank != culprit:
            dist.barrier(group=group)  # the culprit skips barrier #3 and calls all_reduce as #3
        dist.all_reduce(torch.ones(5) if case == "shape" and rank == culprit else t,
                        group=group)
        return {"error": None, "seconds": time.monotonic() - start}
    except dist.DistError as exc:
        return {"error": str(exc), "seconds": time.monotonic() - start}


def every_case(rank: int, world: int, cases: list) -> dict:
    """Each case on a group of its own (a fresh sequence), the ranks meeting in between."""
    from course_lib import dist

    meet = dist.new_group(timeout=60.0)
    out = {}
    for case, detail in cases:
        dist.set_debug_level("DETAIL" if detail else "OFF")
        group = dist.new_group(timeout=TIMEOUT)
        out[case, detail] = {**misbehave(dist, group, case), "group": group.description}
        dist.set_debug_level("OFF")
        dist.barrier(group=meet)
    return out


CASES = {2: [("sleep", False), ("skip", True), ("shape", False)],
         3: [("sleep", False), ("skip", True), ("shape", False), ("shape", True)],
         4: [("sleep", False), ("skip", True), ("shape", False), ("skip", False)]}


@pytest.mark.parametrize("world", [2, 3, 4])
def test_the_error_names_the_rank_to_blame(world):
    by_rank = spawn(every_case, world, CASES[world], backend="scratch", timeout=60)
    culprit = world - 1
    for case, detail in CASES[world]:
        results = [r[case, detail] for r in by_rank]
        where = results[0]["group"]
        good = f"all_reduce #3 (float32[1024], {where})"
        bad = {"sleep": None, "skip": good,
               "shape": f"all_reduce #3 (float32[5], {where})"}[case]
        for rank, r in enumerate(results[:culprit]):
            assert r["error"] is not None, f"{case}: rank {rank} did not fail"
            assert r["seconds"] < TIMEOUT + SLACK, (case, rank, r["seconds"])
            first = r["error"].splitlines()[0]
            mine = f"barrier #3 ({where})" if case == "skip" else good
            verb = "timed out" if case == "sleep" else "(timed out|failed)"
            assert re.match(rf"{re.escape(mine)} {verb} on rank {rank}: ", first), first
            if case == "sleep":
                assert (f"rank {culprit} last completed #2 and is not in a collective "
                        f"(it has not called #3)") in first, first
            else:
                assert f"rank {culprit} last completed #2 and " in first, first
                assert bad in first, first
            if detail:  # at once, not by a timeout: the fingerprints named both calls
                cause = r["error"].splitlines()[1]
                assert "collectives do not match across ranks" in cause, cause
                assert f"rank {culprit} called {bad}" in cause, cause
        if case != "sleep":  # the culprit's own error names what the others called
            first = results[culprit]["error"].splitlines()[0]
            # The rank whose message it refused is in that call; whether every other rank has
            # left #2 yet is scheduling (recursive doubling lets one rank run a call ahead of
            # another: rank 0 was once still in #2 with 4 ranks on 2 busy cores).
            theirs = re.escape(f"barrier #3 ({where})" if case == "skip" else good)
            assert re.search(rf"rank \d+ last completed #2 and (is in|called) {theirs}",
                             first), first


def record_some(rank: int, world: int) -> dict:
    from course_lib import dist
    from course_lib.dist import flight

    dist.all_reduce(torch.zeros(3, 2))
    dist.barrier()
    dist.all_gather([torch.zeros(4, dtype=torch.int64) for _ in range(world)],
                    torch.zeros(4, dtype=torch.int64))
    group = dist.new_group([0, 1])
    if rank < 2:
        dist.broadcast(torch.zeros(7, dtype=torch.float64), 0, group=group)
    work = dist.all_reduce(torch.zeros(5), async_op=True)
    work.wait()
    before = flight.TRACE_SIZE
    flight.TRACE_SIZE = 4
    try:
        small = flight.Recorder()
    finally:
        flight.TRACE_SIZE = before
    for seq in range(10):
        small.finish(small.start(seq, "barrier", None), failed=False)
    return {"record": dist.flight_record(), "small": [e["seq"] for e in small.snapshot()]}


def test_every_collective_is_recorded_in_its_group():
    results = spawn(record_some, 3, backend="scratch", timeout=30)
    for rank, r in enumerate(results):
        world = r["record"]["groups"]["0"]
        assert r["record"]["rank"] == rank and world["description"] == "world"
        got = [(e["seq"], e["op"], e["dtype"], e["shape"], e["state"]) for e in world["entries"]]
        assert got == [(0, "all_reduce", "float32", [3, 2], "completed"),
                       (1, "barrier", None, None, "completed"),
                       (2, "all_gather", "int64", [4], "completed"),
                       (3, "all_reduce", "float32", [5], "completed")]
        assert all(e["start"] <= e["end"] for e in world["entries"])
        sub = r["record"]["groups"]["1"]
        assert sub["ranks"] == [0, 1]
        assert [(e["op"], e["dtype"]) for e in sub["entries"]] == (
            [("broadcast", "float64")] if rank < 2 else [])
        assert r["small"] == [6, 7, 8, 9]  # only the newest TRACE_SIZE are kept


@pytest.mark.cluster
def test_the_cluster_reads_every_record_while_the_engines_are_stuck(monkeypatch):
    """Rank 1 sits in a barrier the others never join; the records still come back, from the
    ranks' listeners, and show rank 1 inside barrier #1 of its group. A cluster of its own:
    the exercise checks' shared cluster is not one to leave a collective hanging on."""
    from course_lib.cluster import ClusterError, start

    def stuck():
        import time

        from course_lib import dist

        group = dist.new_group(timeout=4.0)
        dist.all_reduce(torch.ones(2), group=group)
        if dist.get_rank() == 1:
            try:
                dist.barrier(group=group)
            except dist.DistError:
                return "gave up"
        else:
            time.sleep(3.0)
        return str(group.id)

    with start(2, backend="scratch", timeout=60) as c:
        running = c.view.apply_async(stuck)
        deadline = time.monotonic() + 3.0
        while True:  # until rank 1 is in its barrier, in records read after rank 0's
            records = c.flight_records(timeout=5)
            entries = records[1]["groups"][max(records[1]["groups"], key=int)]["entries"]
            mine = records[0]["groups"][max(records[0]["groups"], key=int)]  # ids are per rank
            if (len(entries) == 2 and mine["entries"]) or time.monotonic() > deadline:
                break
            time.sleep(0.1)
        assert [(e["seq"], e["op"], e["state"]) for e in entries] == [
            (0, "all_reduce", "completed"), (1, "barrier", "started")]
        assert [e["op"] for e in mine["entries"]] == ["all_reduce"]
        assert running.get(timeout=30)[1] == "gave up"
        monkeypatch.setattr(c, "backend", "gloo")
        with pytest.raises(ClusterError, match="come from the scratch backend"):
            c.flight_records()
