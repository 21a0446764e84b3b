"""The RNG tracker (`course_lib.rng`) and dropout in the TP layers.

A TP block with dropout on equals one process that draws each mask the way the ranks do: the
sharded activation's slice r from TP rank r's `SHARDED` stream, the replicated output from the
group's `REPLICATED` stream. The reference draws every slice from its own stream, so a TP block
whose ranks share one stream (one seed everywhere) fails the comparison; a test plants that bug.
Two DP replicas of a TP group draw different masks. float64, rtol=1e-9, atol=1e-10.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from course_lib.backend import default_dist
from course_lib.rng import (REPLICATED, SHARDED, RNGStatesTracker, get_rng_tracker, seed_streams,
                            stream_seed)
from course_lib.spawn import spawn
from course_lib.tensor_parallel import TensorParallelAttention, TensorParallelMLP, shard

RTOL, ATOL, P, SEED = 1e-9, 1e-10, 0.3, 1234


def _max_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(((a - b).abs() - (ATOL + RTOL * b.abs())).max())


def test_fork_uses_the_stream_and_restores_the_default_generator():
    tracker = RNGStatesTracker()
    tracker.add("a", 1)
    torch.manual_seed(5)
    outside = torch.get_rng_state()
    with tracker.fork("a"):
        first = torch.rand(4)
    assert torch.equal(torch.get_rng_state(), outside)
    assert torch.equal(first, torch.rand(4, generator=torch.Generator().manual_seed(1)))
    saved = tracker.get_states()
    with tracker.fork("a"):
        second = torch.rand(4)
    assert not torch.equal(first, second)  # the stream advanced
    tracker.set_states(saved)
    with tracker.fork("a"):
        assert torch.equal(torch.rand(4), second)  # restored: the same draw again
    with pytest.raises(KeyError, match="never added"):
        with tracker.fork("b"):
            pass
    with pytest.raises(ValueError, match="already used"):
        tracker.add("b", 1)


def test_seed_policy_same_inside_tp_distinct_across_tp_shards_dp_pp():
    def seeds(tp, dp, pp):
        t = seed_streams(SEED, tp_rank=tp, dp_rank=dp, pp_rank=pp, tracker=RNGStatesTracker())
        return {n: _draw(t, n) for n in t.names}

    a, b = seeds(0, 0, 0), seeds(1, 0, 0)
    assert torch.equal(a[REPLICATED], b[REPLICATED])
    assert not torch.equal(a[SHARDED], b[SHARDED])
    for other in (seeds(0, 1, 0), seeds(0, 0, 1)):
        assert all(not torch.equal(a[n], other[n]) for n in (REPLICATED, SHARDED))
    # the hash keeps (dp=10, pp=0) and (dp=0, pp=1) apart, which seed + 10 dp + 100 pp does not
    assert stream_seed(0, REPLICATED, dp=10, pp=0) != stream_seed(0, REPLICATED, dp=0, pp=10)


def _draw(tracker: RNGStatesTracker, name: str) -> torch.Tensor:
    with tracker.fork(name):
        return torch.rand(8)


def _trackers(world: int) -> list[RNGStatesTracker]:
    return [seed_streams(SEED, tp_rank=r, tracker=RNGStatesTracker()) for r in range(world)]


def _drop_slices(h: torch.Tensor, trackers: list[RNGStatesTracker]) -> torch.Tensor:
    """One process: slice r of the last dimension dropped with TP rank r's sharded stream."""
    parts = h.chunk(len(trackers), dim=-1)
    out = []
    for part, t in zip(parts, trackers):
        with t.fork(SHARDED):
            out.append(F.dropout(part.contiguous(), P, training=True))
    return torch.cat(out, dim=-1)


def _drop_whole(y: torch.Tensor, tracker: RNGStatesTracker) -> torch.Tensor:
    with tracker.fork(REPLICATED):
        return F.dropout(y, P, training=True)


def _dropout_checks(rank: int, world: int, one_seed: bool) -> dict[str, float]:
    torch.manual_seed(0)
    fc1, fc2 = nn.Linear(8, 24, dtype=torch.float64), nn.Linear(24, 8, dtype=torch.float64)
    mha = nn.MultiheadAttention(24, 12, batch_first=True, dtype=torch.float64)
    # one seed everywhere: every TP rank seeded as rank 0 is
    mine = seed_streams(SEED, tp_rank=0 if one_seed else rank, tracker=RNGStatesTracker())
    mlp = TensorParallelMLP.from_linears(fc1, fc2, dropout=P, tracker=mine)
    attn = TensorParallelAttention.from_torch(mha, dropout=P, tracker=mine)
    refs = _trackers(world)
    errs = {}
    for step in range(2):  # the streams advance: the second step's masks are new ones
        x = torch.randn(2, 3, 8, dtype=torch.float64)
        x_ref, x_tp = x.clone().requires_grad_(), x.clone().requires_grad_()
        y_tp = mlp(x_tp)
        y_ref = _drop_whole(fc2(_drop_slices(F.gelu(fc1(x_ref)), refs)), refs[0])
        w = torch.randn_like(y_ref)
        (y_ref * w).sum().backward()
        (y_tp * w).sum().backward()
        errs.update({f"mlp{step}.out": _max_err(y_tp, y_ref),
                     f"mlp{step}.grad_x": _max_err(x_tp.grad, x_ref.grad),
                     f"mlp{step}.fc1.w": _max_err(mlp.fc1.weight.grad,
                                                  shard(fc1.weight.grad, 0, rank, world))})
        for p in [*mlp.parameters(), fc1.weight, fc1.bias, fc2.weight, fc2.bias]:
            p.grad = None
    z = torch.randn(2, 5, 24, dtype=torch.float64)
    b, t, e = z.shape
    q, k, v = F.linear(z, mha.in_proj_weight, mha.in_proj_bias).view(b, t, 3, 12, 2).unbind(2)
    heads = F.scaled_dot_product_attention(*(u.transpose(1, 2) for u in (q, k, v)))
    heads = heads.transpose(1, 2).reshape(b, t, e)
    ref = _drop_whole(mha.out_proj(_drop_slices(heads, refs)), refs[0])
    errs["attn.out"] = _max_err(attn(z), ref)
    attn.eval()  # no dropout in evaluation: the unsplit module's output
    errs["attn.eval"] = _max_err(attn(z), mha(z, z, z, need_weights=False)[0])
    return errs


@pytest.mark.parametrize("world,backend", [(2, "scratch"), (3, "gloo"), (4, "scratch")])
def test_tp_dropout_equals_one_process_drawing_the_same_masks(world, backend):
    per_rank = spawn(_dropout_checks, world, False, backend=backend, timeout=60)
    for rank, errs in enumerate(per_rank):
        bad = {k: v for k, v in errs.items() if not v <= 0}
        assert not bad, f"rank {rank}: beyond rtol={RTOL}, atol={ATOL}: {bad}"


def test_one_seed_everywhere_fails_the_comparison():
    per_rank = spawn(_dropout_checks, 2, True, backend="scratch", timeout=60)
    # rank 0's slice is drawn as the reference draws it; rank 1 repeats rank 0's masks
    assert per_rank[1]["mlp0.fc1.w"] > 0 and per_rank[0]["mlp0.out"] > 0


def _replica_masks(rank: int, world: int) -> dict[str, bool]:
    """tp=2 x dp=2: ranks (0, 1) and (2, 3) are TP groups; same input on every rank."""
    d = default_dist()
    tp_rank, dp_rank = rank % 2, rank // 2
    groups = [d.new_group([0, 1]), d.new_group([2, 3])]
    seed_streams(SEED, tp_rank=tp_rank, dp_rank=dp_rank)  # the process's own tracker
    torch.manual_seed(0)
    mlp = TensorParallelMLP(8, 16, dropout=P, group=groups[dp_rank]).double()
    y = mlp(torch.ones(4, 8, dtype=torch.float64)).detach()
    hidden = _draw(get_rng_tracker(), SHARDED)
    ys, hs = [torch.empty_like(y) for _ in range(4)], [torch.empty_like(hidden) for _ in range(4)]
    d.all_gather(ys, y)
    d.all_gather(hs, hidden)
    return {"tp_group_same_output": torch.equal(ys[0], ys[1]) and torch.equal(ys[2], ys[3]),
            "dp_replicas_differ": not torch.equal(ys[0], ys[2]),
            "sharded_streams_all_differ": all(not torch.equal(hs[i], hs[j])
                                              for i in range(4) for j in range(i + 1, 4))}


def test_dp_replicas_draw_different_masks():
    for rank, facts in enumerate(spawn(_replica_masks, 4, backend="gloo", timeout=60)):
        assert all(facts.values()), f"rank {rank}: {facts}"


def _checkpoint_round_trip(rank: int, world: int, folder: str) -> bool:
    """The tracker's streams go through lesson 09's checkpoint with the rank's other RNGs."""
    from course_lib.checkpoint import load, save
    from course_lib.training_state import rng_state, set_rng_state

    seed_streams(SEED, tp_rank=rank)
    _draw(get_rng_tracker(), SHARDED)
    save({"rng": {f"rank{rank}": rng_state()}}, folder)
    after = [_draw(get_rng_tracker(), n) for n in (SHARDED, REPLICATED)]
    seed_streams(SEED + 1, tp_rank=rank)  # another run's streams, then the checkpoint's
    state = {"rng": {f"rank{rank}": rng_state()}}
    load(state, folder)
    set_rng_state(state["rng"][f"rank{rank}"])
    again = [_draw(get_rng_tracker(), n) for n in (SHARDED, REPLICATED)]
    return all(torch.equal(a, b) for a, b in zip(after, again))


def test_tracker_streams_saved_and_restored_by_checkpoints(tmp_path):
    assert all(spawn(_checkpoint_round_trip, 1, str(tmp_path / "ckpt"), backend="scratch",
                     timeout=60))


def _gpt_with_dropout(rank: int, world: int) -> dict[str, float]:
    """The capstone's GPT with dropout on, its blocks split on `world` TP ranks, against one
    process whose hooks draw each mask as the ranks do (slices from per-rank streams)."""
    from course_lib.gpt import GPT, GPTConfig, parallelize_blocks

    cfg = GPTConfig(vocab_size=11, block_size=6, n_layer=2, n_head=4, n_embd=16, dropout=P)
    torch.manual_seed(0)
    one = GPT(cfg).double()
    torch.manual_seed(0)
    tp = GPT(cfg).double()
    parallelize_blocks(tp)
    seed_streams(SEED, tp_rank=rank)
    refs = _trackers(world)

    def drawn_like_the_ranks(x, stream):
        return _drop_slices(x, refs) if stream == SHARDED else _drop_whole(x, refs[0])

    for m in one.modules():
        if hasattr(m, "_drop"):
            m._drop = drawn_like_the_ranks
    idx = torch.randint(0, 11, (3, 6), generator=torch.Generator().manual_seed(1))
    errs = {}
    for step in range(2):
        y_one, y_tp = one(idx), tp(idx)
        w = torch.randn_like(y_one)
        (y_one * w).sum().backward()
        (y_tp * w).sum().backward()
        errs[f"logits{step}"] = _max_err(y_tp, y_one)
        errs[f"wte.grad{step}"] = _max_err(tp[0].wte.weight.grad, one[0].wte.weight.grad)
        one.zero_grad()
        tp.zero_grad()
    return errs


def test_gpt_dropout_on_tp_ranks_equals_one_process_with_the_same_masks():
    for rank, errs in enumerate(spawn(_gpt_with_dropout, 2, backend="scratch", timeout=60)):
        bad = {k: v for k, v in errs.items() if not v <= 0}
        assert not bad, f"rank {rank}: {bad}"
