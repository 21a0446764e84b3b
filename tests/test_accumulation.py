"""Gradient accumulation: p ranks x k micro-batches of b equal one process on p*k*b samples,
and `no_sync` really keeps the first k-1 micro-batches off the network."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from course_lib.accumulation import accumulation_step, saved_activation_bytes
from course_lib.counting import CountingDist
from course_lib.spawn import spawn
from test_ddp import TOL, as_tensor, batch, flat_state, make_model, make_optimizer, portable, \
    reference, STEPS

B, K = 2, 4


def micro_batches(step: int, rank: int, world: int, k: int = K, b: int = B):
    x, y = batch(step, world * k * b)
    xs, ys = x[rank::world], y[rank::world]
    return [(xs[m * b:(m + 1) * b], ys[m * b:(m + 1) * b]) for m in range(k)]


def accumulation_worker(rank: int, world: int, optimizers: tuple) -> dict:
    from course_lib.backend import default_dist
    from course_lib.ddp import DistributedDataParallel

    out = {}
    for opt_kind in optimizers:
        model = make_model("mlp", seed=rank)
        counting = CountingDist(default_dist())
        wrapped = DistributedDataParallel(model, bucket_cap_mb=0.002, first_bucket_cap_mb=0.0005,
                                          dist=counting)
        opt = make_optimizer(opt_kind, wrapped)
        setup_calls = counting.calls["all_reduce"]
        for step in range(STEPS):
            accumulation_step(wrapped, opt, nn.functional.mse_loss,
                              micro_batches(step, rank, world))
        out["state", opt_kind] = flat_state(model)
        out["calls", opt_kind] = (counting.calls["all_reduce"] - setup_calls, len(wrapped.buckets))
    return portable(out)


def check(results: list[dict], world: int, optimizers: tuple) -> None:
    for opt_kind in optimizers:
        ref = reference("mlp", opt_kind, world, B, micro=K)
        for rank, res in enumerate(results):
            torch.testing.assert_close(as_tensor(res["state", opt_kind]), ref, **TOL,
                                       msg=lambda m: f"{opt_kind} rank {rank}: {m}")
            calls, buckets = res["calls", opt_kind]
            assert buckets > 1 and calls == STEPS * buckets  # one sync per step, not per micro


@pytest.mark.parametrize("backend,world,optimizers", [("gloo", 2, ("sgd", "adam")),
                                                      ("scratch", 4, ("sgd",))])
def test_accumulation_matches_one_big_batch(backend, world, optimizers):
    results = spawn(accumulation_worker, world, optimizers, backend=backend, timeout=120)
    check(results, world, optimizers)


def test_without_loss_scaling_the_step_is_k_times_too_large():
    """The mistake the lesson warns about, shown to be visible on one process: without dividing
    each micro-batch's loss by K, the accumulated gradient (and so an SGD step) is K times the
    full batch's."""
    def run(scale: bool) -> torch.Tensor:
        model = make_model("mlp", seed=0)
        micro = micro_batches(0, 0, 1)
        for x, y in micro:
            (nn.functional.mse_loss(model(x), y) / (K if scale else 1)).backward()
        return torch.cat([p.grad.reshape(-1) for p in model.parameters()])

    model = make_model("mlp", seed=0)
    x, y = batch(0, K * B)
    nn.functional.mse_loss(model(x), y).backward()
    full = torch.cat([p.grad.reshape(-1) for p in model.parameters()])
    torch.testing.assert_close(run(scale=True), full, **TOL)
    torch.testing.assert_close(run(scale=False), K * full, **TOL)


def test_accumulation_step_single_process_and_errors():
    model = make_model("mlp", seed=0)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    accumulation_step(model, opt, nn.functional.mse_loss, micro_batches(0, 0, 1))
    ref = make_model("mlp", seed=0)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    x, y = batch(0, K * B)
    nn.functional.mse_loss(ref(x), y).backward()
    ref_opt.step()
    torch.testing.assert_close(flat_state(model), flat_state(ref), **TOL)
    with pytest.raises(ValueError, match="at least one"):
        accumulation_step(model, opt, nn.functional.mse_loss, [])
    x, y = batch(0, 5)
    with pytest.raises(ValueError, match="equal sizes"):
        accumulation_step(model, opt, nn.functional.mse_loss, [(x[:2], y[:2]), (x[2:], y[2:])])


def test_activation_memory_grows_linearly_with_batch():
    model = nn.Sequential(nn.Linear(32, 128), nn.ReLU(), nn.Linear(128, 4))
    sizes = [saved_activation_bytes(model, torch.randn(b, 32)) for b in (4, 8, 16)]
    # Linear saves its input (b*32 floats), ReLU its output (b*128), the last Linear its input
    # (the same ReLU output, counted once).
    assert sizes == [4 * b * (32 + 128) for b in (4, 8, 16)]
