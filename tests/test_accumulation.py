"""Token-weighted gradient accumulation: p ranks x k micro-batches of padded, variable-length
sequences equal one process's per-token loss and gradients on the whole batch (float64,
1e-10), with one all_reduce of the token count and one of the gradient per step; the `loss / k`
version does not. And `no_sync` keeps the first k-1 micro-batches off the network."""

from __future__ import annotations

import contextlib

import pytest
import torch
from torch import nn

from course_lib.accumulation import accumulation_step, saved_activation_bytes
from course_lib.spawn import spawn

IN, OUT, T, STEPS, TOL = 6, 3, 7, 3, dict(rtol=1e-10, atol=1e-10)
SIZES = (3, 1, 2)  # sequences per micro-batch, on every rank: unequal on purpose


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(IN, 16), nn.Tanh(), nn.Linear(16, OUT)).double()


def sequences(step: int, n: int):
    g = torch.Generator().manual_seed(step)
    mask = torch.arange(T) < torch.randint(1, T + 1, (n, 1), generator=g)
    x = torch.randn(n, T, IN, generator=g, dtype=torch.float64) * mask[..., None]
    y = torch.randn(n, T, OUT, generator=g, dtype=torch.float64) * mask[..., None]
    return x, y, mask


def token_loss(out, y):
    return ((out - y) ** 2).mean(-1)


def micro_batches(step: int, rank: int, world: int):
    x, y, mask = (t[rank::world] for t in sequences(step, world * sum(SIZES)))
    cuts = [sum(SIZES[:i]) for i in range(len(SIZES) + 1)]
    return [(x[a:b], y[a:b], mask[a:b]) for a, b in zip(cuts, cuts[1:])]


def loss_over_k(model, optimizer, loss_fn, micro):
    """The per-micro-batch version: each micro-batch's mean over its real tokens, over k."""
    for i, (x, y, mask) in enumerate(micro):
        with contextlib.nullcontext() if i == len(micro) - 1 else model.no_sync():
            (loss_fn(model(x), y)[mask].mean() / len(micro)).backward()
    optimizer.step()
    optimizer.zero_grad()


def reference(world: int) -> tuple[list[torch.Tensor], list[torch.Tensor], list[float]]:
    """One process, the whole batch: per-token loss; gradients of the first step, weights
    after every step, and the loss of each step."""
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.3)
    grads, losses = None, []
    for step in range(STEPS):
        x, y, mask = sequences(step, world * sum(SIZES))
        loss = token_loss(model(x), y)[mask].mean()
        loss.backward()
        grads = grads or [p.grad.clone() for p in model.parameters()]
        losses.append(loss.item())
        opt.step()
        opt.zero_grad()
    return grads, [p.detach() for p in model.parameters()], losses


def _grads_of_first_step(rank: int, world: int) -> list[torch.Tensor]:
    from course_lib.ddp import DistributedDataParallel

    model = DistributedDataParallel(make_model())

    class Keep(torch.optim.SGD):
        def step(self, closure=None):
            self.kept = [p.grad.clone() for p in model.module.parameters()]

        def zero_grad(self, set_to_none=True):
            pass

    opt = Keep(model.parameters(), lr=0.3)
    accumulation_step(model, opt, token_loss, micro_batches(0, rank, world))
    return opt.kept


def train(rank: int, world: int) -> dict:
    from course_lib.backend import default_dist
    from course_lib.counting import CountingDist
    from course_lib.ddp import DistributedDataParallel

    out = {"grads": _grads_of_first_step(rank, world)}
    for name, step_fn in (("tokens", accumulation_step), ("loss/k", loss_over_k)):
        counting = CountingDist(default_dist())
        model = DistributedDataParallel(make_model(), dist=counting)
        opt = torch.optim.SGD(model.parameters(), lr=0.3)
        counting.reset()
        returned = [step_fn(model, opt, token_loss, micro_batches(s, rank, world))
                    for s in range(STEPS)]
        out[name] = {"weights": [p.detach() for p in model.module.parameters()],
                     "returned": returned, "calls": counting.calls["all_reduce"]}
    return out


@pytest.mark.parametrize("world,backend", [(2, "gloo"), (3, "scratch"), (4, "scratch")])
def test_accumulation_x_dp_equals_the_whole_batch_per_token(world, backend):
    grads, weights, losses = reference(world)
    for rank, res in enumerate(spawn(train, world, backend=backend, timeout=120)):
        for got, want in zip(res["grads"], grads):
            torch.testing.assert_close(got, want, **TOL)
        for got, want in zip(res["tokens"]["weights"], weights):
            torch.testing.assert_close(got, want, **TOL)
        assert res["tokens"]["calls"] == 2 * STEPS  # the count and the gradient, per step
        # the returned loss is this rank's per token; the whole batch's weighs them by count
        assert all(isinstance(v, float) for v in res["tokens"]["returned"])
        # loss / k: the same data, other weights
        assert not all(torch.allclose(g, w, **TOL)
                       for g, w in zip(res["loss/k"]["weights"], weights)), rank


def test_returned_loss_and_plain_module():
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.3)
    micro = micro_batches(0, 0, 1)
    got = accumulation_step(model, opt, token_loss, micro)
    _, weights, losses = reference(1)
    assert abs(got - losses[0]) < 1e-12
    ref = make_model()
    x, y, mask = sequences(0, sum(SIZES))
    token_loss(ref(x), y)[mask].mean().backward()
    torch.optim.SGD(ref.parameters(), lr=0.3).step()
    for a, b in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(a, b, **TOL)
    with pytest.raises(ValueError, match="at least one"):
        accumulation_step(model, opt, token_loss, [])


def test_activation_memory_grows_linearly_with_batch():
    model = nn.Sequential(nn.Linear(32, 128), nn.ReLU(), nn.Linear(128, 4))
    sizes = [saved_activation_bytes(model, torch.randn(b, 32)) for b in (4, 8, 16)]
    # Linear saves its input (b*32 floats), ReLU its output (b*128), the last Linear its input
    # (the same ReLU output, counted once).
    assert sizes == [4 * b * (32 + 128) for b in (4, 8, 16)]
