"""Benchmarks' process sets take turns: the schedule, the turns on the wire, and failures.

Fake sets here are threads in this process that speak the ranks' end (`interleave.turns`), so
the tests check the driver's order and errors without timing anything.
"""

from __future__ import annotations

import itertools
import threading
import time

import pytest

from course_lib.course.bench import interleave
from course_lib.course.bench.interleave import REWARM, TurnError, schedule

ROWS = {"scratch": [4096, 4096, 1 << 20, 1 << 20], "gloo": [4096, 1 << 20], "mpi": [4096, 1 << 20]}


@pytest.mark.parametrize("timed,block", [(10, 2), (5, 2), (3, 5), (1, 1)])
def test_every_row_is_warmed_then_gets_exactly_its_timed_repeats(timed, block):
    turns = schedule(ROWS, warmup=7, timed=timed, block=block)
    for name, rows in ROWS.items():
        for r in range(len(rows)):
            mine = [(u, t) for n, row, u, t in turns if (n, row) == (name, r)]
            assert mine[0] == (7, 0), "warm-up comes first"
            assert all(u == REWARM and 1 <= t <= block for u, t in mine[1:])
            assert sum(t for _, t in mine) == timed
    first_timed = next(i for i, t in enumerate(turns) if t[3])
    assert all(t[3] == 0 for t in turns[:first_timed]) and all(t[3] for t in turns[first_timed:])


def test_sets_take_turns_size_by_size_in_rotating_order():
    """Within a block, one size runs on every set before the next size (a spell of a few
    hundred ms falls on all of them); which set goes first rotates from block to block."""
    turns = [t for t in schedule(ROWS, warmup=0, timed=6, block=2, start=1)]
    assert len(turns) == 3 * sum(len(r) for r in ROWS.values())
    per_block = sum(len(r) for r in ROWS.values())
    firsts = []
    for b in range(3):
        block = turns[b * per_block:(b + 1) * per_block]
        sizes = [ROWS[n][r] for n, r, _, _ in block]
        assert sizes == sorted(sizes, reverse=b % 2 == 1), "sizes in order, reversed every other"
        for size, group in itertools.groupby(block, key=lambda t: ROWS[t[0]][t[1]]):
            assert {n for n, *_ in group} == set(ROWS), f"size {size}: every set in one stretch"
        firsts.append(block[0][0])
    assert firsts == ["gloo", "mpi", "scratch"], "start=1 shifts the first set; blocks rotate it"


def fake_sets(names: dict[str, int], log: list, lock: threading.Lock, timeout: float = 5.0,
              misbehave=None, started: list | None = None):
    """Launchers whose ranks are threads (appended to `started`): each logs (set, rank, row,
    untimed, timed) per turn and returns its list of turns; `misbehave(name, rank,
    turn_index)` may raise or sleep."""
    def launcher(name: str):
        def run(address: str):
            out = [None] * names[name]

            def rank(r: int) -> None:
                got = []
                try:
                    for i, turn in enumerate(interleave.turns(address, name, r, timeout)):
                        with lock:
                            log.append((name, r, *turn))
                        if misbehave:
                            misbehave(name, r, i)
                        got.append(turn)
                except (ValueError, OSError):  # raised by misbehave, or the driver has gone
                    return  # leaves out[r] None; closing the generator closes its socket
                out[r] = got

            threads = [threading.Thread(target=rank, args=(r,)) for r in range(names[name])]
            if started is not None:
                started.extend(threads)
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            if None in out:
                raise RuntimeError(f"{name}: a rank failed")
            return out
        return run
    return {n: launcher(n) for n in names}


def test_conduct_runs_the_schedule_in_order_one_set_at_a_time():
    names = {"scratch": 2, "gloo": 3}
    rows = {"scratch": [1, 2], "gloo": [1, 2]}
    turns = schedule(rows, warmup=3, timed=4, block=2)
    log, lock = [], threading.Lock()
    results = interleave.conduct(fake_sets(names, log, lock), names, turns, timeout=10)
    # each turn reached every rank of its set, and only that set, before the next turn began
    expected = [(n, r, row, u, t) for n, row, u, t in turns for r in range(names[n])]
    assert sorted(log) == sorted(expected)
    at = 0
    for n, row, u, t in turns:  # each turn's entries, one per rank, before the next turn's
        chunk = log[at:at + names[n]]
        assert sorted(chunk) == [(n, r, row, u, t) for r in range(names[n])], at
        at += names[n]
    for n, size in names.items():
        assert results[n] == [[(row, u, t) for m, row, u, t in turns if m == n]] * size


def test_a_rank_that_fails_in_its_turn_is_named_and_every_set_is_stopped():
    names = {"scratch": 2, "gloo": 2}
    turns = schedule({"scratch": [1, 2], "gloo": [1, 2]}, warmup=1, timed=4, block=1)

    def misbehave(name, rank, i):
        if (name, rank, i) == ("gloo", 1, 3):
            raise ValueError("boom")

    log, lock, started = [], threading.Lock(), []
    t0 = time.monotonic()
    with pytest.raises(TurnError, match=r"gloo rank 1 ended in its turn on row \d.*gloo: "
                                        r"gloo: a rank failed"):
        interleave.conduct(fake_sets(names, log, lock, misbehave=misbehave, started=started),
                           names, turns, 10)
    assert time.monotonic() - t0 < 5
    assert len(started) == 4 and not any(t.is_alive() for t in started), "every rank stopped"
    failed = [i for i, t in enumerate(turns) if t[0] == "gloo"][3]  # gloo's fourth turn
    ran = [(n, r, *t) for n, *t in turns[:failed + 1] for r in range(names[n])]
    assert sorted(log) == sorted(ran), "every turn up to the failed one, and none after it"


def test_a_rank_stuck_in_its_turn_is_a_timeout_naming_it():
    """The driver names the rank after its own timeout, then waits for the sets to end (a real
    set's spawn or mpiexec has its own deadline; this one is stuck for 3 s)."""
    names = {"scratch": 2, "mpi": 2}
    turns = schedule({"scratch": [1], "mpi": [1]}, warmup=1, timed=2, block=1)
    release = threading.Event()

    def misbehave(name, rank, i):
        if (name, rank, i) == ("mpi", 0, 1):
            release.wait(3)

    t0 = time.monotonic()
    try:
        with pytest.raises(TurnError, match=r"mpi rank 0 timed out in its turn on row 0 "
                                            r"\(waited up to 1s\)"):
            interleave.conduct(fake_sets(names, [], threading.Lock(), misbehave=misbehave),
                               names, turns, timeout=1)
    finally:
        release.set()
    assert 1 <= time.monotonic() - t0 < 8


def test_a_set_that_cannot_start_is_reported_at_once():
    def broken(address: str):
        raise RuntimeError("mpiexec not found")

    names = {"scratch": 1, "mpi": 2}
    launchers = fake_sets({"scratch": 1}, [], threading.Lock()) | {"mpi": broken}
    t0 = time.monotonic()
    with pytest.raises(TurnError, match="mpi failed to start: mpiexec not found"):
        interleave.conduct(launchers, names, schedule({"scratch": [1], "mpi": [1]}, 1, 1, 1),
                           timeout=30)
    assert time.monotonic() - t0 < 5


def test_a_set_that_never_connects_is_named():
    names = {"scratch": 1, "gloo": 2}
    launchers = fake_sets({"scratch": 1}, [], threading.Lock()) | {
        "gloo": lambda address: time.sleep(3)}
    with pytest.raises(TurnError, match=r"gloo rank 0, gloo rank 1 did not connect within 1s"):
        interleave.conduct(launchers, names, schedule({"scratch": [1], "gloo": [1]}, 1, 1, 1),
                           timeout=1)


def test_a_rank_that_leaves_between_turns_is_named_and_the_others_stop():
    """A rank that reports its first turn done and goes away without being told to stop: the
    driver names it on its next turn, whether the send or the wait for "done" notices first."""
    import socket

    def leaves_after_one_turn(address: str):
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
            conn.settimeout(10)
            conn.connect(address)
            conn.sendall(b"gloo 0\n")
            with conn.makefile("rb") as reader:
                assert reader.readline().startswith(b"run ")
                conn.sendall(b"done\n")
        return "left"

    names = {"scratch": 2, "gloo": 1}
    turns = schedule({"scratch": [1], "gloo": [1]}, warmup=1, timed=3, block=1)
    started = []
    launchers = fake_sets({"scratch": 2}, [], threading.Lock(), started=started) | {
        "gloo": leaves_after_one_turn}
    with pytest.raises(TurnError, match=r"gloo rank 0 ended (before|in) its turn on row 0"):
        interleave.conduct(launchers, names, turns, timeout=10)
    assert len(started) == 2 and not any(t.is_alive() for t in started)
