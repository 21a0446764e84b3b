"""Lesson 13's experiments: one expert's time against its tokens, what a skewed router does to
the slowest expert-parallel rank, and what the load-balancing loss does about it.

    rows = expert_times()            # forward + backward of one expert on n tokens, and a + b n
    table = imbalance((0.0, 0.01))   # train a skewed top-2 MoE with and without the aux loss
"""

from __future__ import annotations

import statistics
import time

import torch


def expert_times(tokens=(0, 64, 128, 256, 512, 1024), dim: int = 64,
                 repeats: int = 7) -> tuple[list[dict], tuple[float, float]]:
    """Forward and backward of one expert (dim -> 4 dim -> dim) on n tokens (median seconds),
    and the least-squares line a + b n through them."""
    from course_lib import moe

    torch.manual_seed(0)
    expert = moe.Expert(dim, 4 * dim)
    rows = []
    for n in tokens:
        x = torch.randn(n, dim, requires_grad=True)
        times = []
        for _ in range(repeats + 2):
            start = time.perf_counter()
            expert(x).sum().backward()
            times.append(time.perf_counter() - start)
        rows.append({"tokens": n, "seconds": statistics.median(times[2:])})
    ns = torch.tensor([r["tokens"] for r in rows], dtype=torch.float64)
    ts = torch.tensor([r["seconds"] for r in rows], dtype=torch.float64)
    design = torch.stack([torch.ones_like(ns), ns], 1)
    a, b = torch.linalg.lstsq(design, ts.unsqueeze(1)).solution.flatten().tolist()
    return rows, (a, b)


def rank_loads(counts: torch.Tensor, ep: int) -> torch.Tensor:
    """Rows each of `ep` ranks computes: its contiguous experts' counts summed."""
    return counts.view(ep, -1).sum(1)


def imbalance(coeffs=(0.0, 0.01), steps: int = 150, every: int = 50, ep: int = 4,
              seed: int = 0, skew: float = 1.5, lr: float = 3e-3) -> list[dict]:
    """Train a top-2 MoE (8 experts, dropless) whose router starts skewed towards expert 0 on
    a regression to a fixed random MLP, once per aux-loss coefficient; every `every` steps its
    load: max / mean tokens per expert, expert 0's share, and the slowest of `ep` ranks' rows
    over the mean rank's (the factor a step waits for that rank)."""
    from course_lib import moe

    rows = []
    for coeff in coeffs:
        torch.manual_seed(seed)
        dim, experts, batch = 16, 8, 256
        layer = moe.MoE(dim, 32, experts, top_k=2)
        teacher = torch.nn.Sequential(torch.nn.Linear(dim, 64), torch.nn.Tanh(),
                                      torch.nn.Linear(64, dim))
        shift = torch.nn.functional.normalize(torch.randn(dim), dim=0)
        with torch.no_grad():
            layer.router.weight[0] += skew * shift  # tokens lean along `shift`: expert 0 wins
        optimizer = torch.optim.Adam(layer.parameters(), lr=lr)
        for step in range(steps + 1):
            x = torch.randn(batch, dim) + 2 * shift
            with torch.no_grad():
                target = teacher(x)
            task = torch.nn.functional.mse_loss(layer(x), target)
            if step % every == 0:
                counts = layer.tokens_per_expert
                loads = rank_loads(counts, ep).float()
                rows.append({"aux coeff": coeff, "step": step, "task loss": task.item(),
                             "aux loss": layer.aux_loss.item(),
                             "max/mean per expert": (counts.max() / counts.float().mean()).item(),
                             "expert 0 share": (counts[0] / counts.sum()).item(),
                             "slowest rank / mean": (loads.max() / loads.mean()).item()})
            optimizer.zero_grad()
            (task + coeff * layer.aux_loss).backward()
            optimizer.step()
    return rows
