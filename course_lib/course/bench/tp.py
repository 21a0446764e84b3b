"""Tensor-parallel MLP: time per training step, parameter and activation memory per rank.

Each row runs a forward and backward of `TensorParallelMLP` (d_model -> d_hidden -> d_model,
two all-reduces per step) on `world` ranks, one thread each, next to the unsplit MLP on one
process: the parameters per rank fall as 1/world; the time shows what the all-reduces cost.
"""

from __future__ import annotations

from typing import Iterable

import argparse

from course_lib.i18n import N_, _
from course_lib.course.bench.common import Figure, clock, median, slowest_rank
from course_lib.accumulation import saved_activation_bytes
from course_lib.backend import default_dist
from course_lib.tensor_parallel import TensorParallelMLP
from course_lib.spawn import spawn


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--worlds", default="1,2,4", help="comma-separated TP degrees")
    p.add_argument("--d-model", type=int, default=1024)
    p.add_argument("--d-hidden", type=int, default=4096)
    p.add_argument("--tokens", type=int, default=256, help="rows of the input (batch x seq)")
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--backend", default="gloo", choices=("gloo", "scratch"))


def _worker(rank: int, world: int, cfg: dict) -> dict:
    """Time `repeats` forward+backward steps of this rank's shard of the MLP."""
    import torch
    from torch import nn


    torch.manual_seed(0)
    d, h = cfg["d_model"], cfg["d_hidden"]
    fc1, fc2 = nn.Linear(d, h), nn.Linear(h, d)
    mlp = TensorParallelMLP.from_linears(fc1, fc2) if world > 1 else \
        nn.Sequential(fc1, nn.GELU(), fc2)
    del fc1, fc2
    x = torch.randn(cfg["tokens"], d)
    times = []
    barrier = default_dist().barrier if world > 1 else (lambda: None)
    for i in range(cfg["warmup"] + cfg["repeats"]):
        mlp.zero_grad(set_to_none=True)
        barrier()
        start = clock(x.device)
        mlp(x).square().mean().backward()
        if i >= cfg["warmup"]:
            times.append(clock(x.device) - start)
    return {"times": times, "params": sum(p.numel() for p in mlp.parameters()),
            "param_bytes": sum(p.numel() * p.element_size() for p in mlp.parameters()),
            "activation_bytes": saved_activation_bytes(mlp, x)}


def run(args: argparse.Namespace) -> list[dict]:
    cfg = {"d_model": args.d_model, "d_hidden": args.d_hidden, "tokens": args.tokens,
           "repeats": args.repeats, "warmup": args.warmup}
    rows = []
    for world in [int(v) for v in args.worlds.split(",") if v.strip()]:
        per_rank = spawn(_worker, world, cfg, backend=args.backend if world > 1 else "none",
                         timeout=600)
        rows.append({"world": world, "d_model": args.d_model, "d_hidden": args.d_hidden,
                     "tokens": args.tokens,
                     "step_s": median(slowest_rank([r["times"] for r in per_rank])),
                     "params_per_rank": per_rank[0]["params"],
                     "param_MiB_per_rank": per_rank[0]["param_bytes"] / 2**20,
                     "act_MiB_per_rank": per_rank[0]["activation_bytes"] / 2**20})
    return rows


def plot(rows: list[dict], path: str) -> None:
    """Parameter memory per rank and step time vs TP degree."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    worlds = [r["world"] for r in rows]
    fig, (a, b) = plt.subplots(1, 2, figsize=(9, 3.5))
    a.plot(worlds, [r["param_MiB_per_rank"] for r in rows], "o-", label=_("measured"))
    a.plot(worlds, [rows[0]["param_MiB_per_rank"] * rows[0]["world"] / w for w in worlds],
           "k--", lw=1, label=_("unsplit / world"))
    a.set_xlabel(_("TP degree"))
    a.set_ylabel(_("parameters per rank (MiB)"))
    a.legend()
    b.plot(worlds, [r["step_s"] * 1e3 for r in rows], "o-")
    b.set_xlabel(_("TP degree"))
    b.set_ylabel(_("forward + backward (ms, slowest rank)"))
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


TITLE = N_("Tensor parallelism: time and memory per rank")


def figures(rows: list[dict]) -> Iterable[Figure]:
    one = next((r for r in rows if r["world"] == 1), None)
    for r in rows:
        if one and r["world"] > 1:
            yield Figure(_("tp={world}: step time / one rank's", world=r["world"]),
                         r["step_s"] / one["step_s"], None)
            yield Figure(_("tp={world}: parameter bytes per rank / one rank's", world=r["world"]),
                         r["param_MiB_per_rank"] / one["param_MiB_per_rank"], None)
