"""Lesson 05 (gradient accumulation): p ranks x k micro-batches equal one batch of p*k*b."""

from __future__ import annotations

from course_lib.grading import RANK, WORLD_SIZE, Exercise, case, register

IN, OUT = 4, 2


def _model():
    import torch
    from torch import nn

    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(IN, 8), nn.Tanh(), nn.Linear(8, OUT)).double()


def _batch(step: int, size: int):
    import torch

    g = torch.Generator().manual_seed(100 + step)
    return (torch.randn(size, IN, generator=g, dtype=torch.float64),
            torch.randn(size, OUT, generator=g, dtype=torch.float64))


def accumulation_harness(fn, rank: int, world_size: int, k: int, b: int, steps: int) -> dict:
    """Train a DDP model for `steps` calls of `fn`; return its weights and all_reduce count."""
    import torch
    from torch import nn

    from course_lib.backend import default_dist
    from course_lib.counting import CountingDist
    from course_lib.ddp import DistributedDataParallel

    counting = CountingDist(default_dist())
    model = DistributedDataParallel(_model(), dist=counting)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    counting.reset()
    for step in range(steps):
        x, y = _batch(step, world_size * k * b)
        x, y = x[rank::world_size], y[rank::world_size]
        fn(model, opt, nn.functional.mse_loss,
           [(x[m * b:(m + 1) * b], y[m * b:(m + 1) * b]) for m in range(k)])
    return {"weights": torch.cat([p.detach().reshape(-1) for p in model.parameters()]),
            "all_reduce calls": counting.calls["all_reduce"]}


def _one_big_batch(rank: int, world_size: int, k: int, b: int, steps: int) -> dict:
    import torch
    from torch import nn

    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    for step in range(steps):
        x, y = _batch(step, world_size * k * b)
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    return {"weights": torch.cat([p.detach().reshape(-1) for p in model.parameters()]),
            "all_reduce calls": steps}  # the model is one bucket: one all_reduce per step


register(Exercise(
    name="lesson05.accumulation_step",
    notebook="05_grad_accumulation",
    params=("model", "optimizer", "loss_fn", "micro_batches"),
    cases=[
        case(RANK, WORLD_SIZE, 4, 2, 3, label="k=4 micro-batches of 2, 3 steps"),
        case(RANK, WORLD_SIZE, 1, 4, 2, label="k=1: plain DDP step"),
        case(RANK, WORLD_SIZE, 3, 1, 2, label="k=3 micro-batches of 1"),
    ],
    reference=_one_big_batch,
    harness=accumulation_harness,
    distributed=True,
    world_size=2,
    backend="scratch",
    points=2,
    rtol=1e-7,
    atol=1e-9,
    hint=("Divide each micro-batch loss by k before backward, run the first k-1 inside "
          "model.no_sync(), and step + zero the optimizer once, after the last micro-batch."),
))
