"""Lesson 10b's experiments, run on the cluster's engines or under mpiexec: top-k with and without
error feedback on a problem where it matters, our hooks beside torch's on torch's DDP, and the
same DDP and ZeRO-1 training on MPI and on our transport.

    curves = cluster.run(topk_curves)[0]                 # {feedback: losses}
    side = gloo_cluster.run(hooks_beside_torch)          # torch.distributed (gloo) engines
    printed = mpi.launch(3, ["-m", "course_lib.course.demos.comm_experiments"], timeout=120)

Every function that runs on the engines is collective: every rank calls it.

Components (course_lib.ddp, ...) are imported inside the functions that use them, on
purpose: the learner's overlay decides at each call which version runs (theirs or the
reference), and a name bound at import time would keep the first one.
"""

from __future__ import annotations

import json
from typing import Any

import torch
from torch import nn

from course_lib.backend import default_dist
from course_lib.comm_hooks import (DefaultState, PowerSGDState, TopKState, fp16_compress_hook,
                                   powerSGD_hook, topk_hook)
from course_lib.ddp import DistributedDataParallel

__all__ = ["topk_curves", "hooks_beside_torch", "ddp_and_zero1", "main"]


def topk_curves(steps: int = 100) -> dict[bool, list[float]]:
    """Each rank minimizes |x - c_r|^2 / 2 over x in R^8, where c_r's first entry is +5 on even
    ranks and -5 on odd ones (they cancel) and the other 7 entries are 1; DDP with top-1 of 8
    (`topk_hook`), without and with error feedback. The loss of the average at every step."""
    rank = default_dist().get_rank()
    curves = {}
    for feedback in (False, True):
        model = nn.Linear(1, 8, bias=False)
        nn.init.zeros_(model.weight)
        ddp = DistributedDataParallel(model)
        ddp.register_comm_hook(TopKState(ratio=1 / 8, use_error_feedback=feedback), topk_hook)
        target = torch.ones(8)
        target[0] = 5.0 if rank % 2 == 0 else -5.0
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        losses = []
        for _ in range(steps):
            x = model.weight.detach()[:, 0]
            losses.append(0.5 * (x[0] ** 2 + ((x[1:] - 1) ** 2).sum()).item())
            (0.5 * ((ddp(torch.ones(1, 1))[0] - target) ** 2).sum()).backward()
            opt.step()
            opt.zero_grad()
        curves[feedback] = losses
    return curves


def _net(seed: int, dtype: torch.dtype) -> nn.Module:
    """Two 10 x 10 matrices apart from each other: PowerSGD batches equal shapes."""
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 10), nn.Tanh(), nn.Linear(10, 10), nn.Tanh(),
                         nn.Linear(10, 20), nn.Tanh(), nn.Linear(20, 10), nn.Tanh(),
                         nn.Linear(10, 10), nn.Tanh(), nn.Linear(10, 4)).to(dtype)


def _train(model: nn.Module, rank: int, world: int, steps: int = 6) -> torch.Tensor:
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    dtype = next(model.parameters()).dtype
    for step in range(steps):
        g = torch.Generator().manual_seed(100 + step)
        x = torch.randn(4 * world, 6, generator=g, dtype=dtype)
        y = torch.randn(4 * world, 4, generator=g, dtype=dtype)
        nn.functional.mse_loss(model(x[rank::world]), y[rank::world]).backward()
        opt.step()
        opt.zero_grad()
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def hooks_beside_torch() -> dict[str, float]:
    """On torch.distributed (gloo): six SGD steps of one model with torch's DDP and torch's hook,
    and with our DDP and our hook: fp16 compression (float32) and PowerSGD of rank 2 (float64,
    compressing from the second step on). The largest difference of the final parameters."""
    import torch.distributed as tdist
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook as theirs

    rank, world = tdist.get_rank(), tdist.get_world_size()
    kw = dict(matrix_approximation_rank=2, start_powerSGD_iter=2, min_compression_rate=1)
    runs = {
        "fp16": (torch.float32, (default_hooks.fp16_compress_hook, None),
                 (fp16_compress_hook, DefaultState(dist=tdist))),
        "PowerSGD": (torch.float64, (theirs.powerSGD_hook, theirs.PowerSGDState(None, **kw)),
                     (powerSGD_hook, PowerSGDState(None, dist=tdist, **kw)))}
    out = {}
    for name, (dtype, (their_hook, their_state), (our_hook, our_state)) in runs.items():
        torch_ddp = nn.parallel.DistributedDataParallel(_net(0, dtype))
        torch_ddp.register_comm_hook(their_state, their_hook)
        ours = DistributedDataParallel(_net(0, dtype), dist=tdist)
        ours.register_comm_hook(our_state, our_hook)
        a, b = _train(torch_ddp, rank, world), _train(ours, rank, world)
        out[name] = float((a - b).abs().max())
    return out


def ddp_and_zero1(dist: Any) -> dict[str, list[float]]:
    """Eight Adam steps (float64) of a small model with our DistributedDataParallel (several
    buckets) and with ZeRO-1, on any `dist`: the final parameters of each."""
    from course_lib import zero

    rank, world = dist.get_rank(), dist.get_world_size()

    def net(seed):
        torch.manual_seed(seed)
        return nn.Sequential(nn.Linear(6, 12), nn.Tanh(), nn.Linear(12, 3)).double()

    def train(model, opt):
        for step in range(8):
            g = torch.Generator().manual_seed(step)
            x = torch.randn(12, 6, generator=g, dtype=torch.float64)
            y = torch.randn(12, 3, generator=g, dtype=torch.float64)
            nn.functional.mse_loss(model(x[rank::world]), y[rank::world]).backward()
            opt.step()
            opt.zero_grad()
        return torch.cat([p.detach().reshape(-1) for p in model.parameters()]).tolist()

    ddp = DistributedDataParallel(net(rank), dist=dist, bucket_cap_mb=0.0005,
                                  first_bucket_cap_mb=0.0002)
    model = net(rank)
    opt = zero.ZeroRedundancyOptimizer(model.parameters(), torch.optim.Adam, dist=dist, lr=0.01)
    return {"ddp": train(ddp, torch.optim.Adam(ddp.parameters(), lr=0.01)),
            "zero1": train(model, opt)}


def main() -> None:
    """Under mpiexec: `ddp_and_zero1` on course_lib.mpi; rank 0 prints the result as JSON."""
    from course_lib import mpi

    torch.set_num_threads(1)
    mpi.init_process_group(timeout=60)
    out = ddp_and_zero1(mpi)
    if mpi.get_rank() == 0:
        print("RESULT " + json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
