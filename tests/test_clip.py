"""`course_lib.clip.clip_grad_norm_` on sharded gradients against one process's
`torch.nn.utils.clip_grad_norm_`: the norm it returns and the parameters after 3 clipped SGD
steps, for DDP, ZeRO-2, ZeRO-3, TP and PP, norms 2, 3, inf and -inf; and the wrong versions
(each rank's local norm, replicated parameters counted on every TP rank, the shards' padding
counted) differ from it. float64: rtol=1e-9, atol=1e-10 (only the order of sums differs).

The model has 137 parameters (a prime): every ZeRO world of 2, 3 and 4 ranks pads its flat
gradient; 12 hidden features split in 2, 3 and 4 TP ranks.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from course_lib.clip import clip_grad_norm_, clip_grads_, shard_grads, tp_duplicates
from course_lib.spawn import spawn

IN, H, OUT, B, STEPS, LR, MAX_NORM = 5, 12, 5, 2, 3, 0.5, 0.05
RTOL, ATOL = 1e-9, 1e-10
NORMS = (2.0, 3.0, math.inf, -math.inf)


def _net() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(IN, H), nn.Tanh(), nn.Linear(H, OUT)).double()


def _batch(step: int, world: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    return (torch.randn(world * B, IN, generator=g, dtype=torch.float64),
            torch.randn(world * B, OUT, generator=g, dtype=torch.float64))


def _reference(world: int, p: float) -> tuple[list[float], nn.Sequential]:
    model, norms = _net(), []
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    for step in range(STEPS):
        x, y = _batch(step, world)
        opt.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM, p)))
        opt.step()
    return norms, model


def _close(a: torch.Tensor | float, b: torch.Tensor | float) -> bool:
    a, b = torch.as_tensor(a, dtype=torch.float64), torch.as_tensor(b, dtype=torch.float64)
    return bool(torch.allclose(a, b, rtol=RTOL, atol=ATOL))


def _train(model, opt, rank, world, clip, split=True, dp=None):
    """3 steps on this rank's part of the batch (all of it when `split` is False; the rows of
    data-parallel rank `rank` of `dp` when `dp` is given)."""
    norms = []
    for step in range(STEPS):
        x, y = _batch(step, world)
        if split:
            x, y = x[rank::dp or world], y[rank::dp or world]
        opt.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        norms.append(float(clip()))
        opt.step()
    return norms


def _layouts(rank: int, world: int) -> dict[str, bool]:
    from course_lib import zero
    from course_lib.ddp import DistributedDataParallel
    from course_lib.pipeline import PipelineStage, ScheduleGPipe
    from course_lib.tensor_parallel import TensorParallelMLP, shard

    torch.set_default_dtype(torch.float64)  # the norm of a stage with no gradients: float64
    out = {}
    for p in NORMS:
        ref_norms, ref = _reference(world, p)
        ref_params = [t.detach() for t in ref.parameters()]

        # DDP: every rank holds every averaged gradient: torch's computation, no group.
        if p != -math.inf:  # (-inf: the sharded layouts only, where the padding is)
            ddp = DistributedDataParallel(_net())
            opt = torch.optim.SGD(ddp.parameters(), lr=LR)
            norms = _train(ddp, opt, rank, world, lambda: clip_grad_norm_(ddp.parameters(),
                                                                          MAX_NORM, p))
            out[f"ddp.{p}"] = _close(norms, ref_norms) and all(
                _close(a, b) for a, b in zip(ddp.module.parameters(), ref_params))

        # ZeRO-2: each rank a shard of the flat gradient; the norm summed over the group.
        model = _net()
        opt = zero.ZeroRedundancyOptimizer(model.parameters(), torch.optim.SGD, stage=2, lr=LR)
        norms = _train(model, opt, rank, world,
                       lambda: clip_grads_(shard_grads(opt), MAX_NORM, p, groups=[None]))
        out[f"zero2.{p}"] = _close(norms, ref_norms) and all(
            _close(a, b) for a, b in zip(model.parameters(), ref_params))
        if p == 2.0:  # wrong: each rank clips by the norm of its own shard
            model = _net()
            opt = zero.ZeroRedundancyOptimizer(model.parameters(), torch.optim.SGD, stage=2,
                                               lr=LR)
            norms = _train(model, opt, rank, world,
                           lambda: clip_grads_(shard_grads(opt), MAX_NORM, p))
            out["wrong.local_norm_differs"] = not _close(norms, ref_norms)
        if p == -math.inf:  # wrong: the padding's zeros counted as gradient elements
            model = _net()
            opt = zero.ZeroRedundancyOptimizer(model.parameters(), torch.optim.SGD, stage=2,
                                               lr=LR)
            padded = lambda: clip_grads_([b.shard.grad for b in opt.buckets], MAX_NORM, p,  # noqa: E731
                                         groups=[None])
            norms = _train(model, opt, rank, world, padded)
            out["wrong.padding_differs"] = not _close(norms, ref_norms)

        # ZeRO-3: fully_shard's flat shards (two units: the first layer, then the rest).
        model = _net()
        zero.fully_shard(model[0])
        zero.fully_shard(model)
        opt = torch.optim.SGD(model.parameters(), lr=LR)
        norms = _train(model, opt, rank, world,
                       lambda: clip_grads_(shard_grads(model), MAX_NORM, p, groups=[None]))
        full = zero.full_state_dict(model, rank0_only=False)
        out[f"zero3.{p}"] = _close(norms, ref_norms) and all(
            _close(full[k], v) for k, v in ref.state_dict().items())

        if p == -math.inf:
            continue
        # TP: fc1's rows, fc2's columns sharded; fc2's bias replicated, counted by rank 0 only.
        net = _net()
        tp = TensorParallelMLP.from_linears(net[0], net[2], activation=torch.tanh)
        opt = torch.optim.SGD(tp.parameters(), lr=LR)
        norms = _train(tp, opt, rank, world, lambda: clip_grad_norm_(
            tp.parameters(), MAX_NORM, p, duplicates=tp_duplicates(tp), groups=[None]),
            split=False)
        want = [shard(ref[0].weight, 0, rank, world), shard(ref[0].bias, 0, rank, world),
                shard(ref[2].weight, 1, rank, world), ref[2].bias]
        out[f"tp.{p}"] = _close(norms, ref_norms) and all(
            _close(a, b) for a, b in zip(tp.parameters(), want))
        if p == 2.0:  # wrong: every TP rank counts the replicated bias
            net = _net()
            tp = TensorParallelMLP.from_linears(net[0], net[2], activation=torch.tanh)
            opt = torch.optim.SGD(tp.parameters(), lr=LR)
            norms = _train(tp, opt, rank, world, lambda: clip_grad_norm_(
                tp.parameters(), MAX_NORM, p, groups=[None]), split=False)
            out["wrong.replicated_counted_tp_times_differs"] = not _close(norms, ref_norms)

        # PP on 3 stages (the 3-rank world): Linear, Tanh (no parameters), Linear.
        if world == 3:
            mine = nn.Sequential(list(_net())[rank])
            stage = PipelineStage(mine, rank, world)
            sched = ScheduleGPipe(stage, 2, loss_fn=nn.functional.mse_loss)
            norms = []
            for step in range(STEPS):
                x, y = _batch(step, world)
                sched.step(*([x] if rank == 0 else []), target=y if rank == 2 else None)
                norms.append(float(clip_grad_norm_(mine.parameters(), MAX_NORM, p,
                                                   groups=[None])))
                with torch.no_grad():  # SGD (the middle stage has no parameters)
                    for q in mine.parameters():
                        q -= LR * q.grad
                        q.grad = None
            mine_ref = list(ref[rank].parameters())
            out[f"pp.{p}"] = _close(norms, ref_norms) and all(
                _close(a, b) for a, b in zip(mine.parameters(), mine_ref))
        if world == 4:
            out.update(_zero_with_tp(rank, p, ref_norms, ref))
    return out


def _zero_with_tp(rank: int, p: float, ref_norms: list[float], ref: nn.Sequential) -> dict:
    """dp=2 x tp=2: ZeRO-2 and ZeRO-3 shard each TP rank's part of the MLP over dp; a shard
    holds sharded and replicated parameters side by side, and the replicated ones (fc2's bias)
    count on TP rank 0 only."""
    from course_lib import zero
    from course_lib.dist import new_group
    from course_lib.sharded_state import full_state_dict
    from course_lib.tensor_parallel import TensorParallelMLP, shard

    d, t = divmod(rank, 2)
    tp_groups = [new_group([2 * i, 2 * i + 1]) for i in range(2)]
    dp_groups = [new_group([i, i + 2]) for i in range(2)]
    tp_g, dp_g = tp_groups[d], dp_groups[t]
    want = [shard(ref[0].weight, 0, t, 2), shard(ref[0].bias, 0, t, 2),
            shard(ref[2].weight, 1, t, 2), ref[2].bias]
    out = {}

    def mlp() -> nn.Module:
        net = _net()
        return TensorParallelMLP.from_linears(net[0], net[2], activation=torch.tanh,
                                              group=tp_g)

    for wrong in (False, True) if p == 2.0 else (False,):  # wrong: tp_rank 0 everywhere,
        tp_rank = 0 if wrong else t                          # fc2's bias counted twice
        model = mlp()
        opt = zero.ZeroRedundancyOptimizer(model.parameters(), torch.optim.SGD, stage=2, lr=LR,
                                           group=dp_g)
        norms = _train(model, opt, d, 4, lambda: clip_grads_(
            shard_grads(opt, tp_rank=tp_rank, model=model), MAX_NORM, p,
            groups=[dp_g, tp_g]), dp=2)
        if wrong:
            out["wrong.zero_replicated_counted_tp_times_differs"] = not _close(norms, ref_norms)
        else:
            out[f"zero2+tp.{p}"] = _close(norms, ref_norms) and all(
                _close(a, b) for a, b in zip(model.parameters(), want))

    model = mlp()
    zero.fully_shard(model, group=dp_g)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    norms = _train(model, opt, d, 4, lambda: clip_grads_(
        shard_grads(model, tp_rank=t), MAX_NORM, p, groups=[dp_g, tp_g]), dp=2)
    full = full_state_dict(model, rank0_only=False)
    names = ("fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias")
    out[f"zero3+tp.{p}"] = _close(norms, ref_norms) and all(
        _close(full[n], w) for n, w in zip(names, want))
    return out


@pytest.mark.parametrize("world,backend", [(2, "scratch"), (3, "gloo"), (4, "scratch")])
def test_clipping_on_every_layout_equals_one_process(world, backend):
    for rank, facts in enumerate(spawn(_layouts, world, backend=backend, timeout=120)):
        bad = [k for k, ok in facts.items() if not ok]
        assert not bad, f"rank {rank} of {world} ({backend}): {bad}"
        assert len(facts) >= 3 * 4 + 2 + 3 + 3 * (world == 3) + 7 * (world == 4)


def test_no_group_is_torchs_clip_grad_norm():
    for p in NORMS + (1.0,):
        a, b = _net(), _net()
        x, y = _batch(0, 1)
        for m in (a, b):
            nn.functional.mse_loss(m(x), y).backward()
        want = torch.nn.utils.clip_grad_norm_(a.parameters(), MAX_NORM, p)
        got = clip_grad_norm_(b.parameters(), MAX_NORM, p)
        assert got.dtype == want.dtype and _close(got, want), (p, got, want)
        assert all(_close(u.grad, v.grad) for u, v in zip(a.parameters(), b.parameters()))
    b[0].weight.grad[0, 0] = math.nan
    with pytest.raises(RuntimeError, match="non-finite"):
        clip_grad_norm_(b.parameters(), 1.0, error_if_nonfinite=True)
