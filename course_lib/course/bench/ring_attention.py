"""Ring attention: time of causal forward + backward against full attention on one process.

Each row runs `course_lib.context_parallel.ring_attention` on `cp` ranks (one thread each), the
sequence split in the zigzag layout, next to `F.scaled_dot_product_attention` on the whole
sequence on one process (cp = 1 is that baseline). A rank computes about 1/cp of the scores;
the key/value blocks travel around the ring, overlapped with the compute (`--no-overlap` waits
for each transfer first). Activation bytes per rank fall as 1/cp.
"""

from __future__ import annotations

import argparse
from typing import Iterable

from course_lib.backend import default_dist
from course_lib.context_parallel import ring_attention, split_sequence
from course_lib.course.bench.common import Figure, clock, median, slowest_rank
from course_lib.i18n import N_, _
from course_lib.spawn import spawn


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--cps", default="1,2,4", help="comma-separated CP degrees (1: full attention)")
    p.add_argument("--seq", type=int, default=2048, help="sequence length")
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--no-overlap", action="store_true", help="wait for each transfer first")
    p.add_argument("--backend", default="gloo", choices=("gloo", "scratch"))


def _worker(rank: int, world: int, cfg: dict) -> dict:
    """Time `repeats` causal forward + backward steps on this rank's part of the sequence."""
    import torch
    import torch.nn.functional as F

    g = torch.Generator().manual_seed(0)
    whole = [torch.randn(1, cfg["heads"], cfg["seq"], cfg["head_dim"], generator=g)
             for _ in range(3)]
    parts = [split_sequence(z, world, rank, dim=2) for z in whole] if world > 1 else whole
    dist = default_dist() if world > 1 else None
    times = []
    for i in range(cfg["warmup"] + cfg["repeats"]):
        q, k, v = (z.clone().requires_grad_() for z in parts)
        if dist is not None:
            dist.barrier()
        start = clock(q.device)
        if world > 1:
            out = ring_attention(q, k, v, causal=True, seq_len=cfg["seq"], dist=dist,
                                 overlap=cfg["overlap"])
        else:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        out.sum().backward()
        if i >= cfg["warmup"]:
            times.append(clock(q.device) - start)
    return {"times": times, "local_seq": parts[0].shape[2]}


def run(args: argparse.Namespace) -> list[dict]:
    cfg = {"seq": args.seq, "heads": args.heads, "head_dim": args.head_dim,
           "repeats": args.repeats, "warmup": args.warmup, "overlap": not args.no_overlap}
    rows = []
    for cp in [int(v) for v in args.cps.split(",") if v.strip()]:
        per_rank = spawn(_worker, cp, cfg, backend=args.backend if cp > 1 else "none",
                         timeout=600)
        rows.append({"cp": cp, "seq": args.seq, "heads": args.heads, "head_dim": args.head_dim,
                     "overlap": cfg["overlap"], "local_seq": per_rank[0]["local_seq"],
                     "step_s": median(slowest_rank([r["times"] for r in per_rank]))})
    return rows


def plot(rows: list[dict], path: str) -> None:
    """Step time against the CP degree, and the ideal 1/cp of full attention's."""
    import matplotlib  # heavy: only for a plot

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cps = [r["cp"] for r in rows]
    fig, ax = plt.subplots(figsize=(5, 3.5))
    ax.plot(cps, [r["step_s"] * 1e3 for r in rows], "o-", label=_("measured (slowest rank)"))
    base = next((r for r in rows if r["cp"] == 1), None)
    if base:
        ax.plot(cps, [base["step_s"] * 1e3 / cp for cp in cps], "k--", lw=1, label=_("full / cp"))
    ax.set(xlabel=_("CP degree"), ylabel=_("forward + backward (ms)"), xticks=cps)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


TITLE = N_("Ring attention: time against full attention on one process")


def figures(rows: list[dict]) -> Iterable[Figure]:
    one = next((r for r in rows if r["cp"] == 1), None)
    for r in rows:
        if one and r["cp"] > 1:
            yield Figure(_("cp={cp}: step time / full attention's on one process", cp=r["cp"]),
                         r["step_s"] / one["step_s"], None)
            yield Figure(_("cp={cp}: positions per rank / the sequence's", cp=r["cp"]),
                         r["local_seq"] / r["seq"], None)
