"""The alpha-beta-gamma model of all_reduce: fit it to measurements, choose an algorithm by size.

    fit = fit_model(measure(dist, sizes))        # alpha s/message, beta s/byte, gamma s/byte added
    table = build_table(fit, [2, 3, 4], sizes)   # MPICH-style: size thresholds per world size
    dist.set_all_reduce_table(table)             # all_reduce(algorithm="auto") follows it

Each algorithm's time is a count of messages, bytes sent and bytes reduced on the critical
path, times alpha, beta and gamma: linear in them, so a least-squares fit over several
algorithms and sizes recovers all three.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Any, Sequence

import torch

from course_lib.backend import default_dist

__all__ = ["ALGORITHMS", "Fit", "terms", "cost", "fit_model", "choose_algorithm", "build_table",
           "measure"]

ALGORITHMS = ("naive", "ring", "tree", "rabenseifner")


@dataclass(frozen=True)
class Fit:
    """Seconds per message (latency), per byte sent (inverse bandwidth), per byte reduced."""

    alpha: float
    beta: float
    gamma: float


def terms(algorithm: str, nbytes: float, p: int) -> tuple[float, float, float]:
    """(messages, bytes sent, bytes reduced) on the critical path of one all_reduce of `nbytes`
    on `p` ranks; a world that is not a power of two folds its extra ranks in and out first."""
    if algorithm not in ALGORITHMS:
        raise ValueError(f"unknown algorithm {algorithm!r}; choose one of {ALGORITHMS}")
    if p < 2:
        return 0.0, 0.0, 0.0
    pof2 = 1 << (p.bit_length() - 1)
    fold = (2.0, 2.0 * nbytes, float(nbytes)) if pof2 != p else (0.0, 0.0, 0.0)
    lg = math.log2(pof2)
    if algorithm == "naive":  # rank 0 receives and adds p-1 tensors, then sends p-1
        base = (2.0 * (p - 1), 2.0 * (p - 1) * nbytes, (p - 1) * nbytes)
        fold = (0.0, 0.0, 0.0)
    elif algorithm == "ring":
        base = (2.0 * (p - 1), 2.0 * (p - 1) / p * nbytes, (p - 1) / p * nbytes)
        fold = (0.0, 0.0, 0.0)
    elif algorithm == "tree":  # recursive doubling: lg p exchanges of everything
        base = (lg, lg * nbytes, lg * nbytes)
    else:  # Rabenseifner: halving then doubling
        base = (2.0 * lg, 2.0 * (pof2 - 1) / pof2 * nbytes, (pof2 - 1) / pof2 * nbytes)
    return tuple(b + f for b, f in zip(base, fold))


def cost(algorithm: str, nbytes: float, p: int, fit: Fit) -> float:
    """The model's time in seconds."""
    messages, sent, reduced = terms(algorithm, nbytes, p)
    return messages * fit.alpha + sent * fit.beta + reduced * fit.gamma


def fit_model(measurements: Sequence[tuple[str, int, int, float]]) -> Fit:
    """Least squares of (algorithm, nbytes, world size, seconds) rows onto alpha, beta and gamma,
    each row weighted by 1/seconds so small messages count as much as large ones; negative
    estimates (noise) become 0."""
    rows = [(terms(a, n, p), t) for a, n, p, t in measurements if p > 1]
    if len(rows) < 3:
        raise ValueError(f"fit_model needs at least 3 measurements on 2+ ranks, got {len(rows)}")
    x = torch.tensor([[m / t, s / t, r / t] for (m, s, r), t in rows], dtype=torch.float64)
    y = torch.ones(len(rows), 1, dtype=torch.float64)
    scale = x.abs().amax(0).clamp_min(1e-300)  # columns of similar size: a well-posed solve
    solution = torch.linalg.lstsq(x / scale, y).solution.reshape(-1) / scale
    alpha, beta, gamma = (max(0.0, float(v)) for v in solution)
    return Fit(alpha, beta, gamma)


def choose_algorithm(nbytes: int, world_size: int, fit: Fit,
                     algorithms: Sequence[str] = ALGORITHMS) -> str:
    """The algorithm the model says is fastest for this size and world size (the first
    listed among equals)."""
    return min(algorithms, key=lambda a: cost(a, nbytes, world_size, fit))


def build_table(fit: Fit, world_sizes: Sequence[int], sizes: Sequence[int],
                algorithms: Sequence[str] = ALGORITHMS) -> dict[int, list]:
    """{world size: [[max_bytes, algorithm], ..., [None, algorithm]]}: the model's choice at
    each of `sizes`, thresholds where it changes (the format `set_all_reduce_table` takes)."""
    sizes = sorted(sizes)
    table = {}
    for p in world_sizes:
        rows: list = []
        for n in sizes:
            best = choose_algorithm(n, p, fit, algorithms)
            if rows and rows[-1][1] == best:
                rows[-1][0] = n
            else:
                rows.append([n, best])
        rows[-1][0] = None
        table[p] = rows
    return table


def measure(sizes: Sequence[int], algorithms: Sequence[str] = ALGORITHMS, *, repeats: int = 5,
            dist: Any = None, group: Any = None) -> list[tuple[str, int, int, float]]:
    """Time all_reduce of float32 tensors of each size (bytes) with each algorithm: the median
    over `repeats` of the slowest rank's time, after one warm-up call. Collective."""
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
