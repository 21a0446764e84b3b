"""Where a message's time goes: lesson 10a's measurements, run on the cluster's engines (or, for
MPICH, under its own mpiexec).

    path = cluster.run(small_message_path)[0]      # one 4 KiB message's stages, ranks 0 and 1
    mpich_us = mpich_all_reduce_us(4096)           # MPICH's all_reduce of the same size
    rows = cluster.run(measure, sizes)[0]          # every algorithm at every size: fit_model's rows

Each function that runs on the engines is collective: every rank of the cluster calls it. The
two-rank measurements pin ranks 0 and 1 to a core each while they time (as MPI launchers pin
their processes), and leave the other ranks out.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Sequence

import torch

from course_lib import mpi
from course_lib.backend import default_dist
from course_lib.course.bench.allreduce import bind_to_core
from course_lib.course.bench import allreduce as bench_allreduce

__all__ = ["small_message_path", "mpich_all_reduce_us", "mpich_choices", "mpich_variables",
           "through_links_and_in_place", "small_by_messages_and_staged", "measure"]

MEASURED = ("naive", "ring", "tree", "rabenseifner")  # comm_model.ALGORITHMS


def _pinned(fn):
    """Run `fn()` with this rank pinned to a core of its own (ranks 0 and 1), then unpin."""
    cores = os.sched_getaffinity(0)
    bind_to_core(default_dist().get_rank(), 2)
    try:
        return fn()
    finally:
        os.sched_setaffinity(0, cores)


def _one_way(fn, repeats: int) -> float:
    """Half the median round trip of `fn` (a ping-pong)."""
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2] / 2


def _raw_tcp(d: Any, pair: Any, rank: int, nbytes: int, repeats: int) -> float:
    """A raw TCP ping-pong between the same two processes (the port travels over our dist)."""
    import socket

    port = torch.zeros(1, dtype=torch.int64)
    server = None
    if rank == 0:
        server = socket.create_server(("127.0.0.1", 0))
        port[0] = server.getsockname()[1]
    d.broadcast(port, 0, group=pair)
    conn = (server.accept()[0] if rank == 0 else
            socket.create_connection(("127.0.0.1", int(port))))
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    buf = bytearray(nbytes)

    def recv_all():
        view, got = memoryview(buf), 0
        while got < nbytes:
            got += conn.recv_into(view[got:])

    def ping_pong():
        if rank == 0:
            conn.sendall(buf)
            recv_all()
        else:
            recv_all()
            conn.sendall(buf)

    try:
        return _one_way(ping_pong, repeats)
    finally:
        conn.close()
        if server is not None:
            server.close()


def _raw_shared_memory(d: Any, pair: Any, rank: int, repeats: int) -> float:
    """Two flag bytes in a shared file: rank 0 sets the first, rank 1 answers in the second."""
    import mmap

    token = torch.tensor([os.getpid() if rank == 0 else 0], dtype=torch.int64)
    d.broadcast(token, 0, group=pair)
    name = f"/dev/shm/lesson10-pingpong-{int(token)}"
    if rank == 0:
        with open(name, "wb") as f:
            f.write(bytes(64))
    d.barrier(group=pair)
    with open(name, "r+b") as f:
        flags = mmap.mmap(f.fileno(), 64)
    d.barrier(group=pair)
    if rank == 0:
        os.unlink(name)
    count = [0]

    def ping_pong():
        count[0] += 1
        c, limit = count[0] % 250 + 1, time.perf_counter() + 1.0  # never spin forever
        if rank == 0:
            flags[0] = c
            while flags[1] != c and time.perf_counter() < limit:
                pass
        else:
            while flags[0] != c and time.perf_counter() < limit:
                pass
            flags[1] = c

    try:
        return _one_way(ping_pong, repeats)
    finally:
        d.barrier(group=pair)
        flags.close()


def small_message_path(nbytes: int = 4096, repeats: int = 150) -> dict | None:
    """On ranks 0 and 1, each pinned to a core: the one-way time of a raw TCP ping-pong, of a
    raw shared-memory one, of our send/recv (medians); the time of our all_reduce by messages
    ("tree": one exchange on two ranks; the best of three medians); and a profile of that
    all_reduce (time spent in each function itself, per call). Other ranks return None."""
    d = default_dist()
    pair = d.new_group([0, 1])
    rank = d.get_rank()
    if rank > 1:
        return None
    t = torch.zeros(nbytes // 4)

    def ours():
        if rank == 0:
            d.send(t, 1, group=pair)
            d.recv(t, 1, group=pair)
        else:
            d.recv(t, 0, group=pair)
            d.send(t, 0, group=pair)

    def stages():
        import cProfile
        import pstats

        out = {"our send/recv": _one_way(ours, repeats),
               "raw TCP": _raw_tcp(d, pair, rank, nbytes, repeats),
               "raw shared memory": _raw_shared_memory(d, pair, rank, repeats)}
        out["our all_reduce"] = 2 * min(  # the best of three medians, as for MPICH's
            _one_way(lambda: d.all_reduce(t, group=pair, algorithm="tree"), repeats)
            for _ in range(3))
        profile = cProfile.Profile()
        profile.enable()
        for _ in range(1000):
            d.all_reduce(t, group=pair, algorithm="tree")
        profile.disable()
        own = [(total / 1000, name if file == "~" else f"{os.path.basename(file)}: {name}")
               for (file, _, name), (_, _, total, _, _) in pstats.Stats(profile).stats.items()]
        out["profile"] = sorted(own, reverse=True)[:10]
        return out

    return _pinned(stages)


def mpich_all_reduce_us(nbytes: int = 4096, repeats: int = 200, rounds: int = 3,
                        env: dict[str, str] | None = None) -> float:
    """MPICH's all_reduce of `nbytes` on two processes that its own mpiexec starts, pinned to a
    core each: the best of `rounds` runs' median times, in microseconds (nan where MPI is not
    installed)."""
    return mpich_choices([nbytes], {"auto": env or {}}, repeats, rounds)["auto"][nbytes]


def mpich_choices(sizes: Sequence[int], settings: dict[str, dict[str, str]],
                  repeats: int = 30, rounds: int = 1) -> dict[str, dict[int, float]]:
    """{setting: {bytes: microseconds}} of MPICH's all_reduce on two pinned processes: per
    setting (its environment: MPIR_CVAR_* control variables) `rounds` mpiexec runs, the
    settings taking turns, and per size the best of the runs' medians."""
    out = {name: {n: float("inf") for n in sizes} for name in settings}
    for _ in range(rounds):
        for name, env in settings.items():
            if mpi.unavailable():
                out[name] = {n: float("nan") for n in sizes}
                continue
            got = bench_allreduce._run_mpi(2, [(n, "default") for n in sizes], repeats=repeats,
                                           timeout=120, bind="core", env=env)[0]
            for n in sizes:
                out[name][n] = min(out[name][n],
                                   1e6 * sorted(got[f"{n}/default"])[repeats // 2])
    return out


def mpich_variables(*names: str) -> list[str]:
    """The lines of MPICH's `mpivars` listing that set these control variables (name=value)."""
    if mpi.unavailable():
        return []
    listing = subprocess.run([str(Path(sys.executable).parent / "mpivars")],
                             capture_output=True, text=True).stdout.splitlines()
    found = [line.strip().split("\t")[0].replace(" ", "") for line in listing]
    return [line for line in found if line.split("=")[0] in names and "=" in line]


def through_links_and_in_place(nbytes: int = 16 << 20, repeats: int = 10) -> dict | None:
    """On ranks 0 and 1: the median time of an all_reduce of `nbytes` on an ordinary tensor (by
    messages) and on a buffer from `dist.shared_zeros` (read in place), what "auto" ran for
    each (the flight recorder's entry), and whether each sum came out right."""
    d = default_dist()
    pair = d.new_group([0, 1])
    rank = d.get_rank()
    if rank > 1:
        return None
    results = {}
    for name, t in (("through the links", torch.zeros(nbytes // 4)),
                    ("in place (shared)", d.shared_zeros(nbytes // 4, group=pair))):
        times = []
        for _ in range(repeats):
            t.fill_(rank + 1.0)
            d.barrier(group=pair)
            start = time.perf_counter()
            d.all_reduce(t, group=pair)
            times.append(time.perf_counter() - start)
        ran = d.flight_record()["groups"][str(pair.id)]["entries"][-1]["algorithm"]
        results[name] = (sorted(times)[repeats // 2], ran, bool(torch.all(t == 3.0)))
    return results


def small_by_messages_and_staged(nbytes: int = 4096, repeats: int = 200) -> dict | None:
    """On ranks 0 and 1, pinned: the time of an all_reduce of `nbytes` by messages ("tree") and
    as "auto" runs it (the best of three medians, the two taking turns); what "auto" ran for
    4 KiB and for 1 MiB; whether the sums were right."""
    d = default_dist()
    pair = d.new_group([0, 1])
    rank = d.get_rank()
    if rank > 1:
        return None

    def timed():
        t = torch.zeros(nbytes // 4)
        results = {"tree": (float("inf"), True), "auto": (float("inf"), True)}
        for _ in range(3):
            for algorithm in ("tree", "auto"):
                times, right = [], results[algorithm][1]
                for _ in range(repeats):
                    t.fill_(rank + 1.0)
                    d.barrier(group=pair)
                    start = time.perf_counter()
                    d.all_reduce(t, group=pair, algorithm=algorithm)
                    times.append(time.perf_counter() - start)
                    right &= bool(torch.all(t == 3.0))
                best = min(results[algorithm][0], sorted(times)[repeats // 2])
                results[algorithm] = (best, right)
        ran = {}
        for n in (4096, 1 << 20):
            d.all_reduce(torch.ones(n // 4), group=pair)
            ran[n] = d.flight_record()["groups"][str(pair.id)]["entries"][-1]["algorithm"]
        results["ran"] = ran
        return results

    return _pinned(timed)


def measure(sizes: Sequence[int], algorithms: Sequence[str] = MEASURED, *, repeats: int = 5,
            dist: Any = None, group: Any = None) -> list[tuple[str, int, int, float]]:
    """Time all_reduce of float32 tensors of each size (bytes) with each algorithm: the median
    over `repeats` of the slowest rank's time, after one warm-up call. Collective. The rows
    are what `comm_model.fit_model` takes: (algorithm, bytes, world size, seconds)."""
    dist = default_dist(dist)
    p = dist.get_world_size(group)
    out = []
    for nbytes in sizes:
        t = torch.zeros(max(1, nbytes // 4))
        for algorithm in algorithms:
            times = []
            for i in range(repeats + 1):
                dist.barrier(group=group)
                start = time.perf_counter()
                dist.all_reduce(t, group=group, algorithm=algorithm)
                times.append(time.perf_counter() - start)
            slowest = torch.tensor(times[1:], dtype=torch.float64)
            dist.all_reduce(slowest, op=dist.ReduceOp.MAX, group=group)
            out.append((algorithm, t.numel() * 4, p, float(slowest.median())))
    return out
