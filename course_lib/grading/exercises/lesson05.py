"""Lesson 05 (gradient accumulation): p ranks x k micro-batches equal one batch of p*k*b, with
one all_reduce per step; no_sync inside the library's DDP. Checked on 2, 3 and 4 ranks."""

from __future__ import annotations

from course_lib.grading import RANK, WORLD_SIZE, Exercise, case, register
from course_lib.grading.sub_worlds import on_first_ranks, register_on_sub_worlds

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


def _accumulation_body(dist, rank: int, fn, k: int, b: int, steps: int) -> dict:
    """Train a DDP model for `steps` calls of `fn`; return its weights and all_reduce count."""
    import torch
    from torch import nn

    from course_lib.ddp import DistributedDataParallel

    p = dist.get_world_size()
    model = DistributedDataParallel(_model(), dist=dist)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    dist.reset()
    for step in range(steps):
        x, y = _batch(step, p * k * b)
        x, y = x[rank::p], y[rank::p]
        fn(model, opt, nn.functional.mse_loss,
           [(x[m * b:(m + 1) * b], y[m * b:(m + 1) * b]) for m in range(k)])
    return {"weights": torch.cat([q.detach().reshape(-1) for q in model.parameters()]),
            "all_reduce calls": dist.calls["all_reduce"]}


def accumulation_harness(fn, rank: int, world_size: int, p: int, k: int, b: int, steps: int):
    return on_first_ranks(p, _accumulation_body, fn, k, b, steps)


def _accumulation_reference(rank: int, world_size: int, p: int, k: int, b: int, steps: int):
    return None if rank >= p else _one_big_batch(rank, p, k, b, steps)


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


register_on_sub_worlds(
    "lesson05.accumulation_step", "05_grad_accumulation",
    params=("model", "optimizer", "loss_fn", "micro_batches"),
    cases=[
        case(RANK, WORLD_SIZE, 2, 4, 2, 3, label="2 ranks, k=4 micro-batches of 2, 3 steps"),
        case(RANK, WORLD_SIZE, 3, 1, 4, 2, label="3 ranks, k=1: plain DDP step"),
        case(RANK, WORLD_SIZE, 4, 3, 1, 2, label="4 ranks, k=3 micro-batches of 1"),
    ],
    reference=_accumulation_reference,
    harness=accumulation_harness,
    points=2,
    rtol=1e-7,
    atol=1e-9,
    hints=("Divide each micro-batch loss by k before backward, run the first k-1 inside "
          "model.no_sync(), and step + zero the optimizer once, after the last micro-batch.",),
)


# --- lesson05.no_sync: the learner's no_sync inside the library's DDP, on 2, 3 and 4 ranks ------

def _no_sync_body(dist, rank: int, fn, m: int, b: int, steps: int, scenario: str) -> dict:
    """Accumulate `m` micro-batches per step through `model.no_sync()` = the learner's
    `fn(model)`, with blocks nested or a block that raised first in some scenarios."""
    import torch
    from torch import nn

    from course_lib.accumulation import accumulation_step
    from course_lib.ddp import DistributedDataParallel

    k = dist.get_world_size()
    model = DistributedDataParallel(_model(), dist=dist)
    model.no_sync = lambda: fn(model)  # what accumulation_step calls
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    calls = []
    for step in range(steps):
        dist.reset()
        x, y = _batch(step, k * m * b)
        x, y = x[rank::k], y[rank::k]
        micro = [(x[i * b:(i + 1) * b], y[i * b:(i + 1) * b]) for i in range(m)]
        if scenario == "nested":  # micro-batch 0 in both blocks, the others but the last in one
            with fn(model):
                with fn(model):
                    (nn.functional.mse_loss(model(micro[0][0]), micro[0][1]) / m).backward()
                for mx, my in micro[1:-1]:
                    (nn.functional.mse_loss(model(mx), my) / m).backward()
            (nn.functional.mse_loss(model(micro[-1][0]), micro[-1][1]) / m).backward()
            opt.step()
            opt.zero_grad()
        else:
            if scenario == "a block raised":
                try:
                    with fn(model):
                        raise KeyError("a learner's bug inside the block")
                except KeyError:
                    pass
            accumulation_step(model, opt, nn.functional.mse_loss, micro)
        calls.append(dist.calls["all_reduce"])
    return {"weights": torch.cat([p.detach().reshape(-1) for p in model.parameters()]),
            "all_reduce calls per step": calls,
            "require_backward_grad_sync after": model.require_backward_grad_sync}


def no_sync_harness(fn, rank: int, world_size: int, k: int, *args) -> dict:
    return on_first_ranks(k, _no_sync_body, fn, *args)


def _no_sync_reference(rank: int, world_size: int, k: int, m: int, b: int, steps: int,
                       scenario: str):
    if rank >= k:
        return None
    expected = _one_big_batch(0, k, m, b, steps)
    return {"weights": expected["weights"], "all_reduce calls per step": [1] * steps,
            "require_backward_grad_sync after": True}


register_on_sub_worlds(
    "lesson05.no_sync", "05_grad_accumulation",
    params=("ddp",),
    cases=[
        case(RANK, WORLD_SIZE, 2, 3, 2, 2, "plain", label="2 ranks, 3 micro-batches, 2 steps"),
        case(RANK, WORLD_SIZE, 3, 3, 1, 2, "nested", label="3 ranks, nested blocks"),
        case(RANK, WORLD_SIZE, 4, 2, 2, 2, "a block raised",
             label="4 ranks, after a block that raised"),
    ],
    reference=_no_sync_reference,
    harness=no_sync_harness,
    points=2,
    rtol=1e-7,
    atol=1e-9,
    hints=("Remember ddp.require_backward_grad_sync, set it to False, yield inside try, and "
          "restore the remembered value in finally: not True (nested blocks), and also when "
          "the block raises. Set that attribute, not expect_hooks: forward recomputes "
          "expect_hooks from it.",),
)


# --- lesson05.saved_activation_bytes -----------------------------------------------------------

def _saving_model(kind: str):
    """Models whose saved tensors differ: an MLP (inputs, ReLU outputs; weights by reference),
    a square (the input saved twice, kept once), and a LayerNorm (its statistics too)."""
    import torch
    from torch import nn

    torch.manual_seed(0)
    if kind == "mlp":
        return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))

    class Square(nn.Module):
        def forward(self, x):
            return (x * x).sum()
    if kind == "square":
        return Square()
    return nn.Sequential(nn.Linear(8, 8), nn.LayerNorm(8), nn.Tanh())


def saved_harness(fn, kind: str, batch: int) -> int:
    import torch

    x = torch.randn(batch, 8, generator=torch.Generator().manual_seed(batch))
    return int(fn(_saving_model(kind), x.requires_grad_(kind == "square")))


def _saved_reference(kind: str, batch: int) -> int:
    from course_lib.accumulation import saved_activation_bytes

    return saved_harness(saved_activation_bytes, kind, batch)


register(Exercise(
    name="lesson05.saved_activation_bytes",
    notebook="05_grad_accumulation",
    params=("model",),
    cases=[case("mlp", 4, label="MLP, batch 4"), case("mlp", 32, label="MLP, batch 32"),
           case("square", 5, label="x * x: x saved twice, stored once"),
           case("layernorm", 6, label="Linear, LayerNorm, Tanh")],
    reference=_saved_reference,
    harness=saved_harness,
    points=2,
    hints=("Inside torch.autograd.graph.saved_tensors_hooks(pack, unpack) run model(*inputs); "
          "pack(t) adds t.numel() * t.element_size() unless t's storage is a parameter's "
          "(untyped_storage().data_ptr()) or the same view was counted already (key: storage "
          "pointer, offset, shape, strides), and returns t; unpack returns it unchanged.",),
))
