"""The roofline of a training step: model FLOPs counted from the shapes, the machine's matmul
peak measured on the same cores, MFU, and how much of the step is not compute.

- FLOPs per step: 6 x N x tokens (forward 2, backward 4 per parameter of a matrix product and
  per token), N the parameters of the matrix products (every `nn.Linear` weight; the GPT's
  tied head counted once as V x C; embeddings' lookups, biases and norms left out, as the
  PaLM paper counts), plus attention: 12 x n_layer x n_embd x seq_len per token (QK^T and AV,
  forward and backward, over the whole square: the causal half is not subtracted).
- Peak: `calibrate_peak` times square fp32 matmuls with this process's threads; run it on
  every rank at once, so the ranks share the cores as they do in the step.
- Waiting share: 1 - compute / step, where compute is the same work timed without any
  communication (a local copy of the model's forward, backward and optimizer step, scaled to
  what this rank computes). What is left is communication not hidden behind compute, plus
  pipeline bubbles and the hooks' bookkeeping.
- Communication-bound when bytes / bandwidth per step exceeds the compute time (the JAX
  scaling book's rule): `comm_bound`.
"""

from __future__ import annotations

import time
from typing import Any

from course_lib.i18n import _

__all__ = ["linear_params", "gpt_flops", "dense_flops", "calibrate_peak", "bus_bandwidth",
           "dp_bytes", "roofline", "comm_bound", "table"]


def linear_params(model: Any) -> int:
    """Parameters of `model`'s matrix products: the weights of its `nn.Linear` layers."""
    from torch import nn

    return sum(m.weight.numel() for m in model.modules() if isinstance(m, nn.Linear))


def dense_flops(matmul_params: int, tokens: int) -> int:
    """6 N tokens: forward (2) and backward (4) FLOPs of N matrix parameters per token."""
    return 6 * matmul_params * tokens


def gpt_flops(n_layer: int, n_embd: int, vocab_size: int, seq_len: int, tokens: int,
              n_inner: int | None = None) -> dict[str, int]:
    """FLOPs of one training step of the capstone's GPT on `tokens` tokens of sequences of
    `seq_len`: {"matmul_params", "dense", "attention", "total"}. Per block: qkv 3C^2, output
    projection C^2, MLP 2 C x n_inner (4C by default); the tied head V C."""
    c = n_embd
    inner = 4 * c if n_inner is None else n_inner
    n = n_layer * (4 * c * c + 2 * c * inner) + vocab_size * c
    dense = dense_flops(n, tokens)
    attention = 12 * n_layer * c * seq_len * tokens
    return {"matmul_params": n, "dense": dense, "attention": attention,
            "total": dense + attention}


def calibrate_peak(size: int = 512, seconds: float = 0.25) -> float:
    """FLOP/s of an fp32 `size` x `size` matmul with this process's threads: the best of
    repeats over about `seconds` (the best: the machine's noise only slows it down)."""
    import torch

    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(size, size, generator=g), torch.randn(size, size, generator=g)
    out = torch.empty(size, size)
    torch.mm(a, b, out=out)  # warm up
    best, stop = float("inf"), time.perf_counter() + seconds
    while time.perf_counter() < stop or best == float("inf"):
        t0 = time.perf_counter()
        torch.mm(a, b, out=out)
        best = min(best, time.perf_counter() - t0)
    return 2 * size ** 3 / best


def bus_bandwidth(dist: Any, group: Any = None, nbytes: int = 8 * 2**20, repeats: int = 3
                  ) -> float:
    """Bytes per second a rank sends in an all-reduce of `nbytes` on `group` (the ring model's
    2 (N - 1) / N x nbytes over the best of `repeats`): the bandwidth `comm_bound` divides by."""
    import torch

    n = dist.get_world_size(group)
    buf = torch.zeros(nbytes // 4)
    dist.all_reduce(buf, group=group)  # warm up
    best = float("inf")
    for _ in range(repeats):
        dist.barrier(group=group)
        t0 = time.perf_counter()
        dist.all_reduce(buf, group=group)
        best = min(best, time.perf_counter() - t0)
    return 2 * (n - 1) / n * nbytes / best


def dp_bytes(params: float, dp: int, zero: int, bytes_per_param: int = 4) -> float:
    """Bytes a rank sends per step for data parallelism over `dp` ranks, by the ring model: an
    all-reduce of the gradients (DDP), a reduce-scatter and an all-gather (ZeRO-1, 2), and the
    parameters gathered twice (ZeRO-3): 2 or 3 x (dp - 1) / dp x the gradients' bytes."""
    ring = 2 * (dp - 1) / dp * bytes_per_param * params  # one all-reduce's worth
    return ring * 1.5 if zero == 3 else ring


def roofline(flops: float, step_s: float, peak: float, compute_s: float | None = None
             ) -> dict[str, float | None]:
    """The columns a benchmark adds per variant: FLOPs per step (this rank's), achieved
    FLOP/s, the peak, MFU and the share of the step not spent computing."""
    achieved = flops / step_s
    wait = None if compute_s is None else max(0.0, 1.0 - compute_s / step_s)
    return {"gflop_per_step": flops / 1e9, "achieved_gflops": achieved / 1e9,
            "peak_gflops": peak / 1e9, "mfu": achieved / peak, "wait_share": wait}


def comm_bound(compute_s: float, comm_bytes: float, bandwidth: float) -> dict[str, float]:
    """Compute time against communication time (bytes / bandwidth) of one step: their ratio
    above 1 means no overlap can hide the communication, the step is communication-bound."""
    comm_s = comm_bytes / bandwidth
    return {"compute_s": compute_s, "comm_s": comm_s, "ratio": comm_s / compute_s,
            "bound": "communication" if comm_s > compute_s else "compute"}


def table(rows: list[dict]) -> list[str]:
    """The roofline of a run's rows as a markdown table (empty when they carry none): per
    variant its FLOPs, achieved FLOP/s, MFU, waiting share, and, where the variant's data-
    parallel bytes are known, their time at the measured bandwidth against its compute time."""
    rows = [r for r in rows if r.get("mfu") is not None]
    if not rows:
        return []
    peak = max(r["peak_gflops"] for r in rows)
    lines = [_("Roofline per variant, on the matmul peak these cores reached in the same run "
               "({peak:.1f} GFLOP/s per rank). Communication-bound where the data-parallel bytes "
               "over the measured bandwidth take longer than the compute (comm / compute above "
               "1): no overlap can hide that.", peak=peak), "",
             "| {} | {} | {} | {} | {} | {} |".format(
                 _("variant"), _("GFLOP per step"), _("GFLOP/s"), _("MFU"), _("waiting"),
                 _("comm / compute")),
             "| --- | ---: | ---: | ---: | ---: | ---: |"]
    for r in rows:
        ratio = "-"
        if r.get("dp_mib") and r.get("bus_gbps") and r.get("wait_share") is not None:
            compute_s = r["step_ms"] / 1e3 * (1 - r["wait_share"])
            bound = comm_bound(compute_s, r["dp_mib"] * 2**20, r["bus_gbps"] * 1e9)
            ratio = f"{bound['ratio']:.2f}"
        wait = "-" if r.get("wait_share") is None else f"{r['wait_share']:.0%}"
        lines.append(f"| {r['variant']} | {r['gflop_per_step']:.2f} | "
                     f"{r['achieved_gflops']:.1f} | {r['mfu']:.1%} | {wait} | {ratio} |")
    return lines + [""]
