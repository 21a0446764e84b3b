"""Tensor parallelism against the unsplit modules in plain single-process PyTorch.

Every rank builds the same full module (same seed), takes its shard, and compares outputs and
all gradients with the full module's (sliced the same way). float64, so the only difference is
the order of the all-reduce's sums: tolerance rtol=1e-9, atol=1e-10.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from course_lib.backend import default_dist
from course_lib.spawn import spawn
from course_lib.tensor_parallel import (ColumnParallelLinear, RowParallelLinear,
                                        TensorParallelAttention, TensorParallelMLP, shard)

RTOL, ATOL = 1e-9, 1e-10


def _max_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """Largest violation of |a - b| <= ATOL + RTOL |b| (<= 0 means equal within tolerance)."""
    return float(((a - b).abs() - (ATOL + RTOL * b.abs())).max())


def _mlp_checks(rank: int, world: int) -> dict[str, float]:
    torch.manual_seed(0)
    fc1, fc2 = nn.Linear(8, 16, dtype=torch.float64), nn.Linear(16, 8, dtype=torch.float64)
    tp = TensorParallelMLP.from_linears(fc1, fc2)
    x = torch.randn(3, 5, 8, dtype=torch.float64)
    x_ref, x_tp = x.clone().requires_grad_(), x.clone().requires_grad_()
    y_ref = fc2(nn.functional.gelu(fc1(x_ref)))
    y_tp = tp(x_tp)
    # A loss that weighs every output differently, so a wrong gradient cannot cancel out.
    w = torch.randn_like(y_ref)
    (y_ref * w).sum().backward()
    (y_tp * w).sum().backward()
    errs = {"out": _max_err(y_tp, y_ref), "grad_x": _max_err(x_tp.grad, x_ref.grad),
            "fc1.w": _max_err(tp.fc1.weight.grad, shard(fc1.weight.grad, 0, rank, world)),
            "fc1.b": _max_err(tp.fc1.bias.grad, shard(fc1.bias.grad, 0, rank, world)),
            "fc2.w": _max_err(tp.fc2.weight.grad, shard(fc2.weight.grad, 1, rank, world)),
            "fc2.b": _max_err(tp.fc2.bias.grad, fc2.bias.grad)}
    # 20 SGD steps on both: the shards stay the shards of the full model.
    ref_params = [fc1.weight, fc1.bias, fc2.weight, fc2.bias]
    opt_ref = torch.optim.SGD(ref_params, lr=0.1)
    opt_tp = torch.optim.SGD(tp.parameters(), lr=0.1)
    for step in range(20):
        xb = torch.randn(4, 8, dtype=torch.float64)
        target = torch.randn(4, 8, dtype=torch.float64)
        for model, opt in ((lambda z: fc2(nn.functional.gelu(fc1(z))), opt_ref), (tp, opt_tp)):
            opt.zero_grad()
            nn.functional.mse_loss(model(xb), target).backward()
            opt.step()
    errs["train.fc1.w"] = _max_err(tp.fc1.weight, shard(fc1.weight, 0, rank, world))
    errs["train.fc1.b"] = _max_err(tp.fc1.bias, shard(fc1.bias, 0, rank, world))
    errs["train.fc2.w"] = _max_err(tp.fc2.weight, shard(fc2.weight, 1, rank, world))
    errs["train.fc2.b"] = _max_err(tp.fc2.bias, fc2.bias)
    return errs


def _attention_checks(rank: int, world: int, causal: bool, steps: int) -> dict[str, float]:
    torch.manual_seed(1)
    embed, heads, t = 16, 4, 6
    mha = nn.MultiheadAttention(embed, heads, batch_first=True, dtype=torch.float64)
    tp = TensorParallelAttention.from_torch(mha, causal=causal)
    mask = nn.Transformer.generate_square_subsequent_mask(t, dtype=torch.float64) if causal \
        else None

    def ref(z):
        return mha(z, z, z, need_weights=False, attn_mask=mask)[0]

    x = torch.randn(2, t, embed, dtype=torch.float64)
    x_ref, x_tp = x.clone().requires_grad_(), x.clone().requires_grad_()
    y_ref, y_tp = ref(x_ref), tp(x_tp)
    w = torch.randn_like(y_ref)
    (y_ref * w).sum().backward()
    (y_tp * w).sum().backward()
    tag = "causal." if causal else ""
    errs = {"out": _max_err(y_tp, y_ref), "grad_x": _max_err(x_tp.grad, x_ref.grad),
            "qkv.w": _max_err(tp.qkv.weight.grad, shard(mha.in_proj_weight.grad, 0, rank,
                                                        world, parts=3)),
            "qkv.b": _max_err(tp.qkv.bias.grad, shard(mha.in_proj_bias.grad, 0, rank, world,
                                                      parts=3)),
            "out.w": _max_err(tp.out_proj.weight.grad,
                              shard(mha.out_proj.weight.grad, 1, rank, world)),
            "out.b": _max_err(tp.out_proj.bias.grad, mha.out_proj.bias.grad)}
    opt_ref = torch.optim.SGD(mha.parameters(), lr=0.05)
    opt_tp = torch.optim.SGD(tp.parameters(), lr=0.05)
    for step in range(steps):
        xb = torch.randn(2, t, embed, dtype=torch.float64)
        target = torch.randn(2, t, embed, dtype=torch.float64)
        for model, opt in ((ref, opt_ref), (tp, opt_tp)):
            opt.zero_grad()
            nn.functional.mse_loss(model(xb), target).backward()
            opt.step()
    errs["train.qkv.w"] = _max_err(tp.qkv.weight, shard(mha.in_proj_weight, 0, rank, world, 3))
    errs["train.qkv.b"] = _max_err(tp.qkv.bias, shard(mha.in_proj_bias, 0, rank, world, 3))
    errs["train.out.w"] = _max_err(tp.out_proj.weight, shard(mha.out_proj.weight, 1, rank, world))
    errs["train.out.b"] = _max_err(tp.out_proj.bias, mha.out_proj.bias)
    return {tag + k: v for k, v in errs.items()}


def _layer_checks(rank: int, world: int) -> dict[str, float]:
    """The layers alone: column with gathered output, row taking the whole input."""
    torch.manual_seed(2)
    lin = nn.Linear(8, 12, dtype=torch.float64)
    x = torch.randn(5, 8, dtype=torch.float64)
    col = ColumnParallelLinear.from_linear(lin, gather_output=True)
    row = RowParallelLinear.from_linear(nn.Linear(8, 12, dtype=torch.float64),
                                        input_is_parallel=False)
    errs = {"col.gather": _max_err(col(x), lin(x))}
    full_row = nn.Linear(8, 12, dtype=torch.float64)
    with torch.no_grad():
        full_row.weight.copy_(torch.cat(_gather(row.weight, world), dim=1))
        full_row.bias.copy_(row.bias)
    errs["row.whole_input"] = _max_err(row(x), full_row(x))
    # Built from scratch with a different seed per rank, the MLP's output (replicated after
    # the all-reduce) must still be the same on every rank: the whole bias starts equal.
    torch.manual_seed(100 + rank)
    mlp = TensorParallelMLP(8, 16).double()
    y = mlp(torch.ones(2, 8, dtype=torch.float64)).detach()
    errs["default_init.same_output_on_all_ranks"] = max(_max_err(o, y) for o in _gather(y, world))
    # With the same seed on every rank (the usual set-up), the shards are the slices of the
    # unsplit nn.Linear layers that one process builds with that seed, so they differ by rank.
    torch.manual_seed(7)
    mlp = TensorParallelMLP(8, 16)
    torch.manual_seed(7)
    fc1, fc2 = nn.Linear(8, 16), nn.Linear(16, 8)
    errs.update({"same_seed.fc1.w": _max_err(mlp.fc1.weight, shard(fc1.weight, 0, rank, world)),
                 "same_seed.fc1.b": _max_err(mlp.fc1.bias, shard(fc1.bias, 0, rank, world)),
                 "same_seed.fc2.w": _max_err(mlp.fc2.weight, shard(fc2.weight, 1, rank, world)),
                 "same_seed.fc2.b": _max_err(mlp.fc2.bias, fc2.bias)})
    shards = _gather(mlp.fc1.weight, world)
    distinct = all(not torch.equal(shards[i], shards[j])
                   for i in range(world) for j in range(i + 1, world))
    errs["same_seed.shards_differ"] = -1.0 if distinct else 1.0
    return errs


def _gather(t: torch.Tensor, world: int) -> list[torch.Tensor]:
    parts = [torch.empty_like(t) for _ in range(world)]
    default_dist().all_gather(parts, t.detach().contiguous())
    return parts


def _all_checks(rank: int, world: int) -> dict[str, float]:
    errs = {f"mlp.{k}": v for k, v in _mlp_checks(rank, world).items()}
    # 20 training steps without the mask; the causal mask changes only the forward: grads.
    for causal, steps in ((False, 20), (True, 1)):
        errs.update({f"attn.{k}": v
                     for k, v in _attention_checks(rank, world, causal, steps).items()})
    errs.update(_layer_checks(rank, world))
    return errs


# Both backends on 4 ranks, ours on 2 as well (the capstone's tests run TP on 4 ranks again).
@pytest.mark.parametrize("world,backend", [(2, "scratch"), (4, "scratch"), (4, "gloo")])
def test_tp_parity_with_unsplit_modules(world, backend):
    per_rank = spawn(_all_checks, world, backend=backend, timeout=120)
    for rank, errs in enumerate(per_rank):
        bad = {k: v for k, v in errs.items() if not v <= 0}
        assert not bad, f"rank {rank}: beyond rtol={RTOL}, atol={ATOL}: {bad}"
    assert len(per_rank[0]) >= 30


class _TwoRanks:
    """Just enough of a dist-like object to build layers (size checks need no communication)."""

    @staticmethod
    def get_rank(group=None):
        return 0

    @staticmethod
    def get_world_size(group=None):
        return 2


@pytest.mark.parametrize("make, message", [
    (lambda d: ColumnParallelLinear(4, 7, dist=d), "out_features (7) is not divisible by the "
                                                   "tensor-parallel group size (2)"),
    (lambda d: RowParallelLinear(7, 4, dist=d), "in_features (7) is not divisible"),
    (lambda d: TensorParallelAttention(12, 3, dist=d), "num_heads (3) is not divisible"),
    (lambda d: TensorParallelAttention(10, 4, dist=d), "embed_dim (10) is not divisible by "
                                                       "num_heads (4)"),
])
def test_sizes_that_do_not_divide_are_refused(make, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        make(_TwoRanks)


def test_tp_benchmark_runs_end_to_end(tmp_path):
    """Rows, JSON and plot on tiny sizes; speed itself is measured by the lead."""
    import json

    from course_lib.course.bench import __main__ as bench_cli

    out, png = tmp_path / "tp.json", tmp_path / "tp.png"
    assert bench_cli.main(["tp", "--worlds", "2", "--d-model", "16", "--d-hidden", "32",
                           "--tokens", "4", "--repeats", "2", "--warmup", "0",
                           "--json", str(out), "--plot", str(png)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [r["world"] for r in rows] == [2]
    # fc1 (16x32 + 32) and fc2's weight split in two; fc2's bias (16) whole on both ranks.
    assert rows[0]["params_per_rank"] == 16 * 32 + 16 + 16
    assert all(r["step_s"] > 0 for r in rows) and png.stat().st_size > 0
