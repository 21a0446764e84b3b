"""Lesson 12's exercises: the solutions score full points, realistic wrong versions less (the
zigzag split, the merge and one ring step on one process; SP's all-gather / reduce-scatter pair
on 2, 3 and 4 ranks of a 4-rank scratch cluster, collectives counted; the random streams'
seeds on 2, 3 and 4-rank layouts)."""

from __future__ import annotations

import sys

import cloudpickle
import pytest
import torch

from conftest import full, less
from course_lib.context_parallel import (block_attention, contiguous_split, merge, ring_step,
                                         zigzag_split)
from course_lib.rng_seeds import REPLICATED, SHARDED, stream_seed, stream_seeds
from course_lib.sequence_parallel import (_all_gather, _reduce_scatter, _split,
                                          gather_from_sequence_parallel,
                                          reduce_scatter_to_sequence_parallel)

cloudpickle.register_pickle_by_value(sys.modules[__name__])  # engines cannot import tests/


# --- lesson12.zigzag_split ------------------------------------------------------------------------

def _contiguous(x, cp, rank, dim=1):
    """Contiguous chunks: the layout without balance."""
    return contiguous_split(x, cp, rank, dim)


def _not_padded(x, cp, rank, dim=1):
    """Chunks by tensor_split: unequal parts when T does not divide by 2 cp."""
    chunks = x.tensor_split(2 * cp, dim=dim)
    return torch.cat([chunks[rank], chunks[2 * cp - 1 - rank]], dim=dim)


def test_zigzag_split_solution_and_mistakes():
    full("lesson12.zigzag_split", zigzag_split)
    r = less("lesson12.zigzag_split", _contiguous)
    assert r.points == 0 and "one early and one late chunk" in r.reason, r.reason
    assert "[10, 26, 42, 58]" in str(r.cases[-1]), r.cases[-1]
    r = less("lesson12.zigzag_split", _not_padded)
    assert r.points == pytest.approx(2 * 5 / 7, abs=0.01) and "padded" in r.reason, r.reason


# --- lesson12.merge -----------------------------------------------------------------------------------

def _merge_without_max(out_a, lse_a, out_b, lse_b):
    w_a, w_b = torch.exp(lse_a), torch.exp(lse_b)
    total = w_a + w_b
    return (w_a.unsqueeze(-1) * out_a + w_b.unsqueeze(-1) * out_b) / total.unsqueeze(-1), \
        torch.log(total)


def _merge_averaging(out_a, lse_a, out_b, lse_b):
    return (out_a + out_b) / 2, torch.logaddexp(lse_a, lse_b)


def test_merge_solution_and_mistakes():
    full("lesson12.merge", merge)
    r = less("lesson12.merge", _merge_without_max)
    assert r.points == pytest.approx(2 * 3 / 5, abs=0.01) and "overflows" in r.reason, r.reason
    r = less("lesson12.merge", _merge_averaging)
    assert r.points == pytest.approx(2 / 5, abs=0.01) and "share of the total" in r.reason, r.reason


# --- lesson12.ring_step -------------------------------------------------------------------------------

def _ring_step_local_mask(q, k, v, q_pos, k_pos, out, lse, causal, seq_len, scale):
    """The causal mask by the block's own row and column numbers."""
    mask = torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool)
    if causal:
        mask = mask.tril()
    return merge(out, lse, *block_attention(q, k, v, mask, scale))


def test_ring_step_solution_and_mistakes():
    full("lesson12.ring_step", ring_step)
    r = less("lesson12.ring_step", _ring_step_local_mask)
    assert r.points == pytest.approx(2 / 5, abs=0.01) and "holds positions [0, 1, 6, 7]" in r.reason, \
        r.reason


# --- lesson12.gather_from_sequence_parallel / reduce_scatter_to_sequence_parallel -------------

class _GatherAllReduceBackward(torch.autograd.Function):
    """Lesson 06's f after the gather: the sum by all_reduce, then this rank's slice."""

    @staticmethod
    def forward(ctx, x, dist, group):
        ctx.dist, ctx.group = dist, group
        return _all_gather(x, 1, dist, group)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous().clone()
        ctx.dist.all_reduce(grad, group=ctx.group)
        return _split(grad, 1, ctx.dist, ctx.group), None, None


class _GatherSliceBackward(torch.autograd.Function):
    """As if what follows the gather were computed whole on every rank."""

    @staticmethod
    def forward(ctx, x, dist, group):
        ctx.dist, ctx.group = dist, group
        return _all_gather(x, 1, dist, group)

    @staticmethod
    def backward(ctx, grad):
        return _split(grad, 1, ctx.dist, ctx.group), None, None


class _ReduceScatterSliceBackward(torch.autograd.Function):
    """The backward keeps only this rank's slice of the gradient, zeros elsewhere."""

    @staticmethod
    def forward(ctx, x, dist, group):
        ctx.dist, ctx.group, ctx.k = dist, group, dist.get_world_size(group)
        return _reduce_scatter(x, 1, dist, group)

    @staticmethod
    def backward(ctx, grad):
        rank = ctx.dist.get_rank(ctx.group)
        parts = [torch.zeros_like(grad) for _ in range(ctx.k)]
        parts[rank] = grad
        return torch.cat(parts, dim=1), None, None


class _ReduceScatterByAllReduce(torch.autograd.Function):
    """All-reduce then slice forward: right values, twice the bytes."""

    @staticmethod
    def forward(ctx, x, dist, group):
        ctx.dist, ctx.group = dist, group
        total = x.contiguous().clone()
        dist.all_reduce(total, group=group)
        return _split(total, 1, dist, group)

    @staticmethod
    def backward(ctx, grad):
        return _all_gather(grad, 1, ctx.dist, ctx.group), None, None


def _apply(cls):
    def fn(x, dist=None, group=None):
        return cls.apply(x, dist, group)
    fn.__name__ = cls.__name__
    return fn


@pytest.mark.cluster
def test_sequence_parallel_pair_solution_and_mistakes(scratch_cluster_4):
    c = scratch_cluster_4
    gather, scatter = "lesson12.gather_from_sequence_parallel", \
        "lesson12.reduce_scatter_to_sequence_parallel"
    full(gather, gather_from_sequence_parallel, c)
    full(scatter, reduce_scatter_to_sequence_parallel, c)
    r = less(gather, _apply(_GatherAllReduceBackward), c)
    assert r.points == 0 and "twice the bytes" in r.reason, r.reason
    r = less(gather, _apply(_GatherSliceBackward), c)
    assert r.points == 0 and "misses the other ranks' contributions" in r.reason, r.reason
    r = less(scatter, _apply(_ReduceScatterSliceBackward), c)
    assert r.points == 0 and "gradient of the whole output" in r.reason, r.reason
    r = less(scatter, _apply(_ReduceScatterByAllReduce), c)
    assert r.points == 0 and "twice the bytes" in r.reason, r.reason


# --- lesson12.stream_seeds ------------------------------------------------------------------------

def _one_seed_everywhere(seed, tp_rank, dp_rank, pp_rank):
    """The public run's bug: every rank seeded alike (two streams, two seeds)."""
    return {REPLICATED: seed, SHARDED: seed + 1}


def _same_on_dp_replicas(seed, tp_rank, dp_rank, pp_rank):
    return {REPLICATED: stream_seed(seed, REPLICATED, pp=pp_rank),
            SHARDED: stream_seed(seed, SHARDED, pp=pp_rank, tp=tp_rank)}


def _per_rank_where_replicated(seed, tp_rank, dp_rank, pp_rank):
    coords = dict(dp=dp_rank, pp=pp_rank, tp=tp_rank)
    return {REPLICATED: stream_seed(seed, REPLICATED, **coords),
            SHARDED: stream_seed(seed, SHARDED, **coords)}


def _sharded_alike_on_tp(seed, tp_rank, dp_rank, pp_rank):
    return {REPLICATED: stream_seed(seed, REPLICATED, dp=dp_rank, pp=pp_rank),
            SHARDED: stream_seed(seed, SHARDED, dp=dp_rank, pp=pp_rank)}


@pytest.mark.cluster
def test_stream_seeds_solution_and_mistakes(scratch_cluster_4):
    c = scratch_cluster_4
    full("lesson12.stream_seeds", stream_seeds, c)
    reasons = {f.__name__: str(less("lesson12.stream_seeds", f, c))
               for f in (_one_seed_everywhere, _same_on_dp_replicas, _per_rank_where_replicated,
                         _sharded_alike_on_tp)}
    assert "one seed everywhere" in reasons["_one_seed_everywhere"]
    assert "another data-parallel replica" in reasons["_same_on_dp_replicas"]
    assert "drew different masks in the replicated" in reasons["_per_rank_where_replicated"]
    assert "same sharded masks" in reasons["_sharded_alike_on_tp"]
