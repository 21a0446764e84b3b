"""all_reduce time and bandwidth: course_lib.dist (scratch) vs gloo vs MPI, side by side.

    python -m course_lib.course.bench allreduce --world 2 --backends scratch,gloo,mpi \
        --sizes 4KiB,1MiB,16MiB --algorithms ring,tree --repeats 20 --json out.json --plot out.png

Each round starts a fresh set of processes per backend, all at once, and the sets take turns
(`interleave`): one message size at a time, every backend runs `--block` timed repeats before
the next size, in an order that rotates. A slow spell of a shared machine (memory-bound work
here slows up to 3x for seconds) then falls on every backend alike, instead of on whichever
set ran in it. Each size first gets `--warmup` untimed repeats (default WARMUP), and each turn
REWARM more: what is timed is the steady state a training loop sees, thousands of calls in,
not a fresh process's first calls (the interpreter specializes Python code over its first
hundred or so calls: in a fresh pair of ranks our 4 KiB all_reduce took about 23 us over calls
10-50 and 19.5 over calls 100-200, and MPICH's gains too), nor a set's first calls after
sleeping through the others' turns (19 us at 4 KiB after 2 untimed calls, 12 us after 10).
Per repeat, a barrier lines the ranks up and the operation's time is the slowest rank's; a row
reports the median over repeats. Every result is checked against the exact sum outside the
timed region. algbw = bytes / seconds and busbw = algbw * 2(p-1)/p, in GB/s (nccl-tests'
definitions). MPI runs under the mpich wheel's `mpiexec`, with mpi4py's buffer call
`comm.Allreduce(MPI.IN_PLACE, array)`.

`--collective all_to_all` times all_to_all_single instead (lesson 13): ours ("pairwise",
"naive") against gloo's and MPI's `comm.Alltoall`, the size being each rank's whole input (as
in nccl-tests), busbw = algbw * (p-1)/p; each result is checked against the transposition.
"""

from __future__ import annotations

from typing import Iterable

import argparse
import functools
import json
import math
import os
import re
import sys

from course_lib import mpi
from course_lib.course.bench import interleave
from course_lib.i18n import N_, _
from course_lib.course.bench.common import (Figure, choose, clock, median, size_text,
                                           slowest_rank)
from course_lib import dist
from course_lib.spawn import spawn
from course_lib.dist.collectives import ALGORITHMS
from course_lib.dist.alltoall import ALGORITHMS as A2A_ALGORITHMS

UNITS = {"": 1, "B": 1, "KIB": 2 ** 10, "MIB": 2 ** 20, "GIB": 2 ** 30, "KB": 10 ** 3,
         "MB": 10 ** 6, "GB": 10 ** 9}
DTYPE_BYTES = 4  # float32
WARMUP = 100  # untimed repeats per size and process set


def parse_size(text: str) -> int:
    """'4KiB' -> 4096; a multiple of 4 bytes (float32 elements)."""
    m = re.fullmatch(r"\s*(\d+)\s*([KMG]?i?B?)\s*", text, re.IGNORECASE)
    if not m or m.group(2).upper() not in UNITS:
        raise argparse.ArgumentTypeError(_("bad size {text!r}; use e.g. 4KiB, 1MiB, 16MiB",
                                           text=text))
    n = int(m.group(1)) * UNITS[m.group(2).upper()]
    if n % DTYPE_BYTES:
        raise argparse.ArgumentTypeError(_("size {text!r} is not a whole number of float32s",
                                           text=text))
    return n


def parse_sizes(text: str) -> list[int]:
    """'4KiB,1MiB' -> [4096, 1048576]; argparse turns a bad size into a one-line usage error."""
    return [parse_size(s) for s in text.split(",") if s.strip()]


def at_least(minimum: int):
    """An argparse type: an int >= `minimum`, else a one-line usage error."""
    def count(text: str) -> int:
        try:
            n = int(text)
        except ValueError:
            n = None
        if n is None or n < minimum:
            raise argparse.ArgumentTypeError(_("needs a whole number >= {minimum}, got {text!r}",
                                               minimum=minimum, text=text))
        return n
    return count


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--world", type=at_least(1), default=2, help="ranks (default 2)")
    parser.add_argument("--backends", default="scratch,gloo,mpi",
                        help="comma list of scratch, gloo, mpi")
    parser.add_argument("--sizes", type=parse_sizes, default="4KiB,1MiB,16MiB",
                        help="comma list of byte sizes (4KiB, 1MiB, 16MiB; KB/MB: powers of 10)")
    parser.add_argument("--collective", choices=("all_reduce", "all_to_all"),
                        default="all_reduce", help="what to time (default all_reduce)")
    parser.add_argument("--algorithms", default=None,
                        help="scratch algorithms, comma list of ring, tree, naive, rabenseifner, "
                             "one_shot (through the group's staging buffer), auto, shared (a "
                             "buffer from dist.shared_zeros, read in place); default ring. For "
                             "--collective all_to_all: pairwise, naive (default pairwise)")
    parser.add_argument("--repeats", type=at_least(1), default=20, help="timed repeats per row")
    parser.add_argument("--warmup", type=at_least(0), default=WARMUP,
                        help=f"untimed repeats per size and process set (default {WARMUP})")
    parser.add_argument("--rounds", type=at_least(1), default=2,
                        help="fresh process sets per backend; repeats are spread over them")
    parser.add_argument("--block", type=at_least(1), default=2,
                        help="timed repeats per turn: the backends' process sets take turns "
                             "row by row, a few repeats at a time (default 2)")
    parser.add_argument("--timeout", type=float, default=300.0,
                        help="seconds a round may take (every backend's process set lives "
                             "through its round), and the most one turn may take")
    parser.add_argument("--bind", choices=("core", "none"), default="core",
                        help="core: pin each rank of every backend to its own core when there "
                             "are enough (as MPI launchers do); none: let the OS place them")


# --- inside the ranks -----------------------------------------------------------------------

def _backend_ops(backend: str, algorithm: str):
    """(barrier, all_reduce(tensor)) for a backend that is already initialized here."""
    if backend == "scratch":
        return dist.barrier, lambda t: dist.all_reduce(t, algorithm=algorithm)
    if backend == "gloo":
        import torch.distributed as tdist
        return tdist.barrier, tdist.all_reduce
    from mpi4py import MPI
    comm = MPI.COMM_WORLD
    return comm.Barrier, lambda t: comm.Allreduce(MPI.IN_PLACE, t.numpy())


def _a2a_ops(backend: str, algorithm: str):
    """(barrier, all_to_all_single(output, input)) for a backend that is already initialized."""
    if backend == "scratch":
        return dist.barrier, lambda out, t: dist.all_to_all_single(out, t, algorithm=algorithm)
    if backend == "gloo":
        import torch.distributed as tdist
        return tdist.barrier, tdist.all_to_all_single
    from mpi4py import MPI
    comm = MPI.COMM_WORLD
    return comm.Barrier, lambda out, t: comm.Alltoall(t.numpy(), out.numpy())


def _a2a_case(backend: str, algorithm: str, nbytes: int, rank: int, world: int):
    """((barrier, op(buf)), buf, check(buf)) of an all_to_all row: input rank + 1 everywhere,
    so output block i must hold i + 1."""
    import torch

    n = nbytes // DTYPE_BYTES // world * world
    out = torch.empty(n, dtype=torch.float32)
    barrier, a2a = _a2a_ops(backend, algorithm)
    want = torch.arange(1, world + 1, dtype=torch.float32).repeat_interleave(n // world)
    return (barrier, lambda t: a2a(out, t)), torch.empty(n), lambda: torch.equal(out, want)


def bind_to_core(rank: int, world: int) -> None:
    """Pin this rank to a core of its own, if there is one per rank; the same for every backend.

    On loopback, a socket write wakes the receiver on the sender's core; pinned, both ends
    keep their own cores. Every backend in a run gets the same placement, so ratios stay fair.
    """
    cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    if 1 < world <= len(cpus):
        os.sched_setaffinity(0, {cpus[rank]})


def measure(rank: int, world: int, backend: str, plan: list[tuple[int, str]],
            repeats: int, bind: str = "none", warmup: int = WARMUP,
            conductor: str | None = None, timeout: float = 300.0,
            collective: str = "all_reduce") -> dict[str, list[float]]:
    """Per (bytes, algorithm) in `plan`, this rank's time of each timed repeat; checks each
    result. Alone, each row gets `warmup` untimed repeats, then `repeats` timed; with a
    `conductor` (an `interleave` address), rows run in the turns it hands out."""
    import torch

    if bind == "core":
        bind_to_core(rank, world)
    cases, checks = [], []
    for nbytes, algorithm in plan:
        if collective == "all_to_all":
            ops, buf, check = _a2a_case(backend, algorithm, nbytes, rank, world)
            cases.append((ops, buf))
            checks.append(check)
            continue
        checks.append(None)
        if algorithm == "shared":  # every rank allocates it in the same call: plans are equal
            buf = dist.shared_zeros(nbytes // DTYPE_BYTES)
        else:
            buf = torch.empty(nbytes // DTYPE_BYTES, dtype=torch.float32)
        cases.append((_backend_ops(backend, algorithm), buf))
    times: dict[str, list[float]] = {f"{n}/{a}": [] for n, a in plan}
    expected = float(world * (world + 1) // 2)  # every rank contributes rank + 1: exact in fp32
    if conductor is None:
        rows = [(i, warmup, repeats) for i in range(len(plan))]
    else:
        rows = interleave.turns(conductor, backend, rank, timeout)
    for i, untimed, timed in rows:
        (barrier, all_reduce), buf = cases[i]
        nbytes, algorithm = plan[i]
        for k in range(untimed + timed):
            buf.fill_(rank + 1)
            barrier()
            t0 = clock(buf.device)
            all_reduce(buf)
            elapsed = clock(buf.device) - t0
            if checks[i] is not None:
                if not checks[i]():
                    raise AssertionError(_("rank {rank}: {backend}/{algorithm} all_to_all of "
                                           "{nbytes} B is not the transposition", rank=rank,
                                           backend=backend, algorithm=algorithm,
                                           nbytes=nbytes))
            elif buf.numel() and not (buf.min() == expected and buf.max() == expected):
                raise AssertionError(_("rank {rank}: {backend}/{algorithm} all_reduce of "
                                       "{nbytes} B gave {low}..{high}, expected {expected}",
                                       rank=rank, backend=backend, algorithm=algorithm,
                                       nbytes=nbytes, low=buf.min(), high=buf.max(),
                                       expected=expected))
            if k >= untimed:
                times[f"{nbytes}/{algorithm}"].append(elapsed)
    return times


def _mpi_worker(spec: str) -> None:
    """Entry point under mpiexec: measure, gather per-rank times on rank 0, print JSON."""
    import torch
    from mpi4py import MPI

    torch.set_num_threads(1)
    cfg = json.loads(spec)
    comm = MPI.COMM_WORLD
    times = measure(comm.Get_rank(), comm.Get_size(), "mpi", [tuple(p) for p in cfg["plan"]],
                    cfg["repeats"], cfg["bind"], cfg["warmup"], cfg["conductor"], cfg["timeout"],
                    cfg.get("collective", "all_reduce"))
    slowest = {}
    for key, values in times.items():  # the slowest rank per repeat, as numbers (no pickles)
        buf = torch.tensor(values, dtype=torch.float64).numpy()
        comm.Allreduce(MPI.IN_PLACE, buf, op=MPI.MAX)
        slowest[key] = buf.tolist()
    if comm.Get_rank() == 0:
        print("BENCH_JSON " + json.dumps([slowest]), flush=True)


# --- the driver -----------------------------------------------------------------------------

def _run_mpi(world: int, plan: list, repeats: int, timeout: float, bind: str,
             env: dict | None = None, warmup: int = WARMUP,
             conductor: str | None = None, collective: str = "all_reduce") -> list[dict]:
    spec = json.dumps({"plan": plan, "repeats": repeats, "bind": bind, "warmup": warmup,
                       "conductor": conductor, "timeout": timeout, "collective": collective})
    out = mpi.launch(world, ["-m", "course_lib.course.bench.allreduce", "--mpi-worker", spec], timeout,
                     env)
    lines = [ln for ln in out.splitlines() if ln.startswith("BENCH_JSON ")]
    if not lines:
        raise RuntimeError(_("mpi: mpiexec printed no result"))
    return json.loads(lines[-1][len("BENCH_JSON "):])


def _run_set(backend: str, world: int, plan: list, timeout: float, bind: str,
             collective: str, conductor: str) -> list[dict]:
    """One fresh set of `world` processes for `backend`, running the conductor's turns;
    per-rank {key: times}."""
    if backend == "mpi":
        return _run_mpi(world, plan, 0, timeout, bind, warmup=0, conductor=conductor,
                        collective=collective)
    return spawn(measure, world, backend, plan, 0, bind, 0, conductor, timeout, collective,
                 backend=backend, timeout=timeout)


def run(args: argparse.Namespace) -> list[dict]:
    backends = [b.strip() for b in args.backends.split(",") if b.strip()]
    unknown = set(backends) - {"scratch", "gloo", "mpi"}
    if unknown:
        raise SystemExit(_("unknown backends {unknown}; use scratch, gloo, mpi",
                           unknown=sorted(unknown)))
    sizes = args.sizes
    a2a = args.collective == "all_to_all"
    algorithms = choose(args.algorithms or ("pairwise" if a2a else "ring"),
                        A2A_ALGORITHMS if a2a else ALGORITHMS, N_("algorithms"))
    if "mpi" in backends and (why := mpi.unavailable()):
        print(_("note: skipping mpi: {why}", why=why), file=sys.stderr)
        backends.remove("mpi")
    if not backends:
        raise SystemExit(_("no backend left to run"))
    per_round = math.ceil(args.repeats / args.rounds)
    plans = {b: [(n, a) for n in sizes for a in (algorithms if b == "scratch" else ["default"])]
             for b in backends}
    launchers = {b: functools.partial(_run_set, b, args.world, plans[b], args.timeout, args.bind,
                                      args.collective) for b in backends}
    collected: dict[tuple[str, str, int], list[float]] = {}
    for rnd in range(args.rounds):
        turns = interleave.schedule({b: [n for n, _ in plan] for b, plan in plans.items()},
                                    args.warmup, per_round, args.block, start=rnd)
        results = interleave.conduct(launchers, {b: args.world for b in backends}, turns,
                                     args.timeout)
        for b, per_rank in results.items():
            for n, a in plans[b]:
                collected.setdefault((b, a, n), []).extend(
                    slowest_rank([r[f"{n}/{a}"] for r in per_rank]))
    rows = []
    bus = (1 if a2a else 2) * (args.world - 1) / args.world
    for (backend, algorithm, n), secs in sorted(collected.items(),
                                                key=lambda kv: (kv[0][2], kv[0][0], kv[0][1])):
        t = median(secs)
        rows.append({"collective": args.collective, "backend": backend, "algorithm": algorithm,
                     "world": args.world,
                     "bytes": n, "seconds": t, "algbw": n / t / 1e9,
                     "busbw": n / t / 1e9 * bus, "repeats": len(secs), "bind": args.bind})
    return rows


def plot(rows: list[dict], path: str) -> None:
    """Time vs message size, log-log, one line per backend/algorithm."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for key in sorted({(r["backend"], r["algorithm"]) for r in rows}):
        pts = sorted((r["bytes"], r["seconds"]) for r in rows
                     if (r["backend"], r["algorithm"]) == key)
        ax.plot([p[0] for p in pts], [p[1] * 1e3 for p in pts], marker="o",
                label=f"{key[0]} ({key[1]})")
    title = _("{collective}, world {world}", collective=collective(rows),
              world=rows[0]["world"]) if rows else "all_reduce"
    ax.set(xscale="log", yscale="log", xlabel=_("message size (bytes)"), ylabel=_("time (ms)"),
           title=title)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--mpi-worker":
        _mpi_worker(sys.argv[2])
    else:
        sys.exit(_("run it as: python -m course_lib.course.bench allreduce ..."))


TITLE = N_("all_reduce against gloo and MPI")
TITLES = {"all_reduce": TITLE, "all_to_all": N_("all_to_all against gloo and MPI")}


def collective(rows: list[dict]) -> str:
    """The collective a run timed (runs from before all_to_all name none: all_reduce)."""
    return rows[0].get("collective", "all_reduce") if rows else "all_reduce"


def title(rows: list[dict]) -> str:
    """The page's title of a run: the collective it timed."""
    return TITLES[collective(rows)]


def figures(rows: list[dict]) -> Iterable[Figure]:
    """Ours against MPI and gloo, size by size: for all_reduce, ours is "auto" (else our fastest
    algorithm), judged against the targets; for all_to_all, "pairwise" (else our fastest)."""
    a2a = collective(rows) == "all_to_all"
    mine = "pairwise" if a2a else "auto"
    for n in sorted({r["bytes"] for r in rows}):
        at = [r for r in rows if r["bytes"] == n]
        scratch = [r for r in at if r["backend"] == "scratch"]
        ours = next((r for r in scratch if r["algorithm"] == mine), None) or (
            min(scratch, key=lambda r: r["seconds"]) if scratch else None)
        if ours is None:
            continue
        for backend, limit in (("mpi", 3.0 if n <= 4 * 2 ** 10 else 1.2), ("gloo", 0.5)):
            other = next((r for r in at if r["backend"] == backend), None)
            if other and a2a:
                yield Figure(_("all_to_all: ours / {backend} at {size}", backend=backend,
                               size=size_text(n)), ours["seconds"] / other["seconds"], None)
            elif other:
                yield Figure(_("ours / {backend} at {size}", backend=backend, size=size_text(n)),
                             ours["seconds"] / other["seconds"], limit)
