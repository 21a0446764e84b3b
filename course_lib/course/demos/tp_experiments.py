"""Lesson 06's experiments, run on the cluster with the notebook's own modules: a tensor-parallel
module against the unsplit one, memory per rank, and the step time against the TP degree.

Each function takes the classes (or `shard`) it measures as arguments, so the notebook runs them
on the learner's code; nothing here imports `course_lib.tensor_parallel`.

Components (course_lib.ddp, ...) are imported inside the functions that use them, on
purpose: the learner's overlay decides at each call which version runs (theirs or the
reference), and a name bound at import time would keep the first one.
"""

from __future__ import annotations

import os
import time
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn

from course_lib.backend import default_dist

__all__ = ["against_unsplit", "StandInGroup", "memory_per_rank", "step_times", "usable_cores"]


def against_unsplit(full: Callable, tp: nn.Module, d: int, params: list, shard: Callable,
                    steps: int = 20, rtol: float = 1e-9, atol: float = 1e-10) -> dict:
    """Compare a tensor-parallel module `tp` with the unsplit `full` (a function of x, over the
    full parameters `params`), in the dtype of those parameters, on inputs (2, 5, d):
    the output, dL/dx, each shard's gradient against the same shard of the full gradient, and
    the shards after `steps` SGD steps on both. `params` lists each full parameter, in the
    order of `tp.parameters()`, with how its shard is cut: 0 rows, 1 columns, "qkv" rows of
    each of the 3 packed blocks, None whole. Every rank must call it (the module communicates).
    """
    dist = default_dist()
    rank, world = dist.get_rank(), dist.get_world_size()
    dt = params[0][0].dtype

    def cut(t, how):
        if how is None:
            return t
        return shard(t, 0, rank, world, 3) if how == "qkv" else shard(t, how, rank, world)

    def close(a, b):
        return torch.allclose(a, b, rtol=rtol, atol=atol)

    x = torch.randn(2, 5, d, dtype=dt)
    x_full, x_tp = x.clone().requires_grad_(), x.clone().requires_grad_()
    w = torch.randn(2, 5, d, dtype=dt)  # a loss that weighs every output differently
    (full(x_full) * w).sum().backward()
    (tp(x_tp) * w).sum().backward()
    grads = all(close(p.grad, cut(q.grad, how)) for p, (q, how) in zip(tp.parameters(), params))
    opt_full = torch.optim.SGD([q for q, _ in params], lr=0.05)
    opt_tp = torch.optim.SGD(tp.parameters(), lr=0.05)
    for _ in range(steps):
        xb, target = torch.randn(2, 5, d, dtype=dt), torch.randn(2, 5, d, dtype=dt)
        for model, opt in ((full, opt_full), (tp, opt_tp)):
            opt.zero_grad()
            F.mse_loss(model(xb), target).backward()
            opt.step()
    trained = all(close(p, cut(q, how)) for p, (q, how) in zip(tp.parameters(), params))
    with torch.no_grad():
        same_output = close(tp(x), full(x))
    return {"output": same_output, "dL/dx": close(x_tp.grad, x_full.grad),
            "weight grads": grads, f"after {steps} steps": trained}


class StandInGroup:
    """Just enough of a process group to build, and run forward, one rank's shard on its own:
    building needs no communication; its all_reduce leaves the tensor as it is (the bytes a
    forward keeps are the same, the values are not the sum)."""

    def __init__(self, world_size: int):
        self.world_size = world_size

    def get_rank(self, group: Any = None) -> int:
        return 0

    def get_world_size(self, group: Any = None) -> int:
        return self.world_size

    def broadcast(self, tensor: torch.Tensor, src: int, group: Any = None) -> None:
        pass  # the row-parallel bias is made equal on every rank; alone, it already is

    def all_reduce(self, tensor: torch.Tensor, *args: Any, **kwargs: Any) -> None:
        pass

    class ReduceOp:
        SUM = "sum"


def memory_per_rank(mlp_cls: type, d_model: int, d_hidden: int, tokens: int,
                    degrees: tuple[int, ...] = (1, 2, 4, 8)) -> dict:
    """{p: (parameter bytes, activation bytes saved for backward)} of one rank of `mlp_cls`
    (built as `mlp_cls(d_model, d_hidden, dist=StandInGroup(p))`) in float32, for a forward of
    (tokens, d_model); p = 1 is the unsplit nn.Sequential(Linear, GELU, Linear)."""
    from course_lib.accumulation import saved_activation_bytes

    x = torch.randn(tokens, d_model)
    found = {}
    for p in degrees:
        torch.manual_seed(0)
        if p == 1:
            model = nn.Sequential(nn.Linear(d_model, d_hidden), nn.GELU(),
                                  nn.Linear(d_hidden, d_model))
        else:
            model = mlp_cls(d_model, d_hidden, dist=StandInGroup(p))
        params = sum(t.numel() * t.element_size() for t in model.parameters())
        found[p] = (params, saved_activation_bytes(model, x))
    return found


def usable_cores() -> int:
    """The CPU cores this process may run on."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()


def step_times(mlp_cls: type, d_model: int, d_hidden: int, tokens: int,
               degrees: tuple[int, ...] = (1, 2, 4), repeats: int = 5, warmup: int = 2) -> dict:
    """On every rank of the world (one thread each): for each TP degree p, the first p ranks
    time a forward and backward of `mlp_cls.from_linears` on (tokens, d_model) (p = 1: the
    unsplit MLP) and, on the same group, one all_reduce of a (tokens, d_model) tensor, the size
    of each of the block's two. Returns {"step": [s per degree], "all_reduce": [s per degree],
    "cores": the cores one engine may use}, the fastest of `repeats` on the slowest rank, the
    same on every rank."""
    dist = default_dist()
    rank = dist.get_rank()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    found: dict[str, Any] = {"step": [], "all_reduce": [], "cores": usable_cores()}
    try:
        for p in degrees:
            group = dist.new_group(list(range(p)))  # every rank takes part in making it
            times = torch.zeros(2, dtype=torch.float64)
            if rank < p:
                times = _time_degree(mlp_cls, p, group, d_model, d_hidden, tokens, repeats,
                                     warmup)
            dist.all_reduce(times, op=dist.ReduceOp.MAX)  # the slowest rank sets the pace
            found["step"].append(float(times[0]))
            found["all_reduce"].append(float(times[1]))
    finally:
        torch.set_num_threads(threads)
    return found


def _time_degree(mlp_cls: type, p: int, group: Any, d_model: int, d_hidden: int, tokens: int,
                 repeats: int, warmup: int) -> torch.Tensor:
    dist = default_dist()
    torch.manual_seed(0)
    fc1, fc2 = nn.Linear(d_model, d_hidden), nn.Linear(d_hidden, d_model)
    if p == 1:
        mlp = nn.Sequential(fc1, nn.GELU(), fc2)
    else:
        mlp = mlp_cls.from_linears(fc1, fc2, group=group)
    x = torch.randn(tokens, d_model)
    sync = (lambda: dist.barrier(group=group)) if p > 1 else (lambda: None)
    steps, reduces = [], []
    for i in range(warmup + repeats):
        mlp.zero_grad(set_to_none=True)
        sync()
        start = time.perf_counter()
        mlp(x).square().mean().backward()
        if i >= warmup:
            steps.append(time.perf_counter() - start)
        if p > 1:
            block = torch.randn(tokens, d_model)
            sync()
            start = time.perf_counter()
            dist.all_reduce(block, group=group)
            if i >= warmup:
                reduces.append(time.perf_counter() - start)
    return torch.tensor([min(steps), min(reduces) if reduces else 0.0], dtype=torch.float64)
