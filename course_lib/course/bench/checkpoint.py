"""checkpoint: our sharded save and load against torch.distributed.checkpoint and torch.save.

Every rank holds its 1/N of a training state of `--mib` MiB (`--tensors` fp32 tensors, each
sharded evenly, as ZeRO-3 holds them) and saves it, then loads it back into fresh tensors, in
the same processes on gloo, variant after variant in every repeat, after one warm-up round
that is not counted, each repeat starting with the next variant. Variants: `ours`
(course_lib.checkpoint, Pieces), `dcp` (torch.distributed.checkpoint, DTensors on a CPU device
mesh, its default FileSystemWriter: one thread, fsync) and `torch_save` (gather the full state
to rank 0, `torch.save`, fsync; load: `torch.load` on rank 0 and scatter). Per variant: median
time of the slowest rank and throughput in GB/s of the whole state, and whether what loaded
equals what was saved. Files go under `--dir` (removed afterwards); loads come from the page
cache for every variant alike, so load figures are the software's cost, not the disk's.

Time to recover (`ours` rows, unless `--no-recovery`): on a cluster of the same world size
(scratch backend), every rank saves its shards, then one rank's engine is SIGKILLed while the
others wait in a barrier; `recovery.run_with_recovery` notices (detection: from the kill to the
error), restarts every engine (restart) and runs the function again, which loads the newest
checkpoint (reload: slowest rank). Recover = detection + restart + reload.
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import time
from typing import Any, Iterable

from course_lib.i18n import N_, _
from course_lib.course.bench.common import Figure, choose, finish, median, slowest_rank
from course_lib import checkpoint, dist
from course_lib.checkpoint import Piece
from course_lib.cluster import start
from course_lib.recovery import run_with_recovery
from course_lib.spawn import spawn

VARIANTS = ("ours", "dcp", "torch_save")
KILLED = 1  # the rank whose engine dies in the recovery measurement (every world has one)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--worlds", default="2,4", help="comma-separated world sizes")
    p.add_argument("--variants", default=",".join(VARIANTS),
                   help=f"comma-separated subset of {', '.join(VARIANTS)}")
    p.add_argument("--mib", type=float, default=256.0, help="size of the whole state")
    p.add_argument("--tensors", type=int, default=16)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--dir", default=None, help="where to write (default: a temporary folder)")
    p.add_argument("--timeout", type=float, default=600.0)
    p.add_argument("--recovery", action=argparse.BooleanOptionalAction, default=True,
                   help="also measure the time to recover from a killed engine (a cluster)")


def _shards(rank: int, world: int, mib: float, count: int) -> tuple[list, int]:
    """This rank's shard of each of `count` tensors (values depend on the tensor and the
    element: a wrong offset shows), and each tensor's full length."""
    import torch

    per = max(world, int(mib * 2 ** 20 / 4 / count) // world * world)
    size = per // world
    start = rank * size
    return [torch.arange(start, start + size, dtype=torch.float32) + 1000.0 * i
            for i in range(count)], per


def _save_load(variant: str, shards: list, per: int, folder: str) -> tuple[float, float, bool]:
    """(save seconds, load seconds, loaded == saved) for one variant on this rank."""
    import torch
    import torch.distributed as tdist


    rank, world = tdist.get_rank(), tdist.get_world_size()
    fresh = [torch.full_like(s, -1.0) for s in shards]
    if variant == "dcp":  # imports and the mesh (a collective) are not the save's time
        import torch.distributed.checkpoint as dcp
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor import DTensor, Shard

        mesh = init_device_mesh("cpu", (world,))

        def dtensors(ts):
            return {f"t{i}": DTensor.from_local(t, mesh, [Shard(0)], run_check=False)
                    for i, t in enumerate(ts)}
    tdist.barrier()
    t0 = time.perf_counter()
    if variant == "ours":
        checkpoint.save(_pieces(shards, rank, per), folder, dist=tdist)
        tdist.barrier()
        t1 = time.perf_counter()
        checkpoint.load(_pieces(fresh, rank, per), folder, dist=tdist)
    elif variant == "dcp":
        dcp.save(dtensors(shards), checkpoint_id=folder)
        tdist.barrier()
        t1 = time.perf_counter()
        dcp.load(dtensors(fresh), checkpoint_id=folder)
    else:
        path = os.path.join(folder, "state.pt")
        full = {}
        for i, s in enumerate(shards):
            parts = [torch.empty_like(s) for _ in range(world)] if rank == 0 else None
            tdist.gather(s, parts, dst=0)
            if rank == 0:
                full[f"t{i}"] = torch.cat(parts)
        if rank == 0:
            os.makedirs(folder, exist_ok=True)
            with open(path, "wb") as f:
                torch.save(full, f)
                f.flush()
                os.fsync(f.fileno())
        del full
        tdist.barrier()
        t1 = time.perf_counter()
        loaded = torch.load(path, weights_only=True) if rank == 0 else None
        for i, t in enumerate(fresh):
            parts = list(loaded[f"t{i}"].chunk(world)) if rank == 0 else None
            tdist.scatter(t, parts, src=0)
    tdist.barrier()
    t2 = time.perf_counter()
    return t1 - t0, t2 - t1, all(torch.equal(a, b) for a, b in zip(shards, fresh))


def _pieces(shards: list, rank: int, per: int) -> dict:
    """Our checkpoint's description of this rank's shards: where each sits in its tensor."""
    import torch


    return {f"t{i}": Piece(t, rank * t.numel(), torch.Size([per])) for i, t in enumerate(shards)}


def _save_then_die(folder: str, mib: float, count: int) -> dict:
    """On the cluster's ranks. First run (no checkpoint yet): save, then rank KILLED writes the
    time and SIGKILLs its engine while the others wait in a barrier. Run again after the
    restart: load (timed) and check."""
    import signal

    import torch


    rank, world = dist.get_rank(), dist.get_world_size()
    shards, per = _shards(rank, world, mib, count)
    marker = folder + ".killed"
    if not os.path.exists(marker):
        checkpoint.save(_pieces(shards, rank, per), folder)
        dist.barrier()
        if rank == KILLED:
            with open(marker, "w") as f:
                f.write(repr(time.time()))
            os.kill(os.getpid(), signal.SIGKILL)
        dist.barrier()  # the dead rank never comes: the cluster notices the engine died
    fresh = [torch.full_like(t, -1.0) for t in shards]
    start = time.perf_counter()
    checkpoint.load(_pieces(fresh, rank, per), folder)
    return {"load_s": time.perf_counter() - start,
            "exact": all(torch.equal(a, b) for a, b in zip(shards, fresh))}


def _recovery(world: int, args: argparse.Namespace, root: str) -> dict:
    """Detection, restart and reload seconds (and their sum) of one killed engine."""
    folder = os.path.join(root, f"w{world}-recovery")
    with start(world, timeout=args.timeout) as cluster:
        called = time.time()
        results, failures = run_with_recovery(cluster, _save_then_die, folder, args.mib,
                                              args.tensors, max_failures=1)
    with open(folder + ".killed") as f:
        killed_at = float(f.read())
    (failure,) = failures
    if list(failure.dead) != [KILLED]:
        raise RuntimeError(_("the recovery benchmark expected rank {killed} to die, not "
                             "{dead}", killed=KILLED, dead=sorted(failure.dead)))
    detect = failure.failed_after_s - (killed_at - called)
    reload = max(r["load_s"] for r in results)
    return {"detect_s": detect, "restart_s": failure.recovered_in_s, "reload_s": reload,
            "recover_s": detect + failure.recovered_in_s + reload,
            "recover_exact": all(r["exact"] for r in results)}


def _rank_main(rank: int, world: int, args: dict) -> dict:
    import torch.distributed as tdist

    shards, per = _shards(rank, world, args["mib"], args["tensors"])
    root = args["root"]
    variants = args["variants"]
    out: dict[str, Any] = {v: {"save": [], "load": [], "exact": True} for v in variants}
    for repeat in range(-1, args["repeats"]):  # -1: a warm-up round, not counted
        # Each round starts with another variant: no variant always writes first (the first
        # writes into memory this machine has not touched yet can be several times slower).
        shift = max(repeat, 0) % len(variants)
        for variant in variants[shift:] + variants[:shift]:
            folder = os.path.join(root, f"w{world}-{variant}-{repeat}")
            save_s, load_s, exact = _save_load(variant, shards, per, folder)
            out[variant]["exact"] &= exact
            if repeat >= 0:
                out[variant]["save"].append(save_s)
                out[variant]["load"].append(load_s)
            tdist.barrier()
            if rank == 0:
                shutil.rmtree(folder, ignore_errors=True)
    out["bytes"] = per * args["tensors"] * 4
    return out


def run(args: argparse.Namespace) -> list[dict]:
    variants = choose(args.variants, VARIANTS)
    worlds = [int(w) for w in args.worlds.split(",") if w.strip()]
    rows = []
    root = tempfile.mkdtemp(prefix="bench-checkpoint-", dir=args.dir)
    try:
        for world in worlds:
            per_rank = spawn(_rank_main, world, {"mib": args.mib, "tensors": args.tensors,
                                                 "repeats": args.repeats, "variants": variants,
                                                 "root": root},
                             backend="gloo", timeout=args.timeout)
            nbytes = per_rank[0]["bytes"]
            for variant in variants:
                save = median(slowest_rank([r[variant]["save"] for r in per_rank]))
                load = median(slowest_rank([r[variant]["load"] for r in per_rank]))
                rows.append({"world": world, "variant": variant, "mib": nbytes / 2 ** 20,
                             "save_s": save, "load_s": load, "save_gbps": nbytes / save / 1e9,
                             "load_gbps": nbytes / load / 1e9,
                             "exact": all(r[variant]["exact"] for r in per_rank)})
            by = {r["variant"]: r for r in rows if r["world"] == world}
            for r in by.values():
                if "dcp" in by:
                    r["save_vs_dcp"] = r["save_s"] / by["dcp"]["save_s"]
                    r["load_vs_dcp"] = r["load_s"] / by["dcp"]["load_s"]
            if args.recovery and "ours" in by:
                by["ours"].update(_recovery(world, args, root))
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return rows


def plot(rows: list[dict], path: str | None = None) -> Any:
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(9, 3.5), sharey=True)
    worlds = sorted({r["world"] for r in rows})
    variants = list(dict.fromkeys(r["variant"] for r in rows))
    width = 0.8 / len(variants)
    titles = (_("save (GB/s, higher is better)"), _("load (GB/s, higher is better)"))
    for ax, what, title in zip(axes, ("save_gbps", "load_gbps"), titles):
        for i, v in enumerate(variants):
            ys = [next(r[what] for r in rows if r["world"] == w and r["variant"] == v)
                  for w in worlds]
            ax.bar([j + i * width for j in range(len(worlds))], ys, width, label=v)
        ax.set_xticks([j + width * (len(variants) - 1) / 2 for j in range(len(worlds))],
                      [_("world {world}", world=w) for w in worlds])
        ax.set_title(title)
    axes[0].legend()
    return finish(fig, path)


TITLE = N_("Checkpoints against torch.distributed.checkpoint")


def figures(rows: list[dict]) -> Iterable[Figure]:
    for r in rows:
        if r["variant"] == "ours" and "save_vs_dcp" in r:
            yield Figure(_("world {world}: save / DCP's", world=r["world"]), r["save_vs_dcp"], 1.0)
            yield Figure(_("world {world}: load / DCP's", world=r["world"]), r["load_vs_dcp"], 1.0)
