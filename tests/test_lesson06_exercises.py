"""Lesson 06's exercises: the solutions score full points, realistic wrong versions less (the
distributed ones on 2, 3 and 4 ranks of a 4-rank scratch cluster, collectives counted)."""

from __future__ import annotations

import sys

import cloudpickle
import pytest
import torch

import torch.nn.functional as F

from conftest import full, less
from course_lib.backend import default_dist
from course_lib.course.grading.learner import grade_function
from course_lib.tensor_parallel import (column_parallel_forward, copy_to_parallel, divide,
                                        gather_from_parallel, reduce_from_parallel,
                                        row_parallel_forward, shard)

cloudpickle.register_pickle_by_value(sys.modules[__name__])  # engines cannot import tests/


def _shard_ignores_parts(tensor, dim, rank, world_size, parts=1):
    size = divide(tensor.shape[dim], world_size, "dim")
    return tensor.narrow(dim, rank * size, size).clone()


def _shard_wrong_offset(tensor, dim, rank, world_size, parts=1):
    blocks = tensor.chunk(parts, dim=dim)
    size = blocks[0].shape[dim] // world_size
    return torch.cat([b.narrow(dim, rank, size) for b in blocks], dim=dim)


def _shard_interleaved(tensor, dim, rank, world_size, parts=1):
    index = torch.arange(rank, tensor.shape[dim], world_size)
    return tensor.index_select(dim, index)


def test_shard_exercise_scores_solution_and_rejects_wrong_shards():
    full("lesson06.shard", shard)
    for wrong, why in ((_shard_ignores_parts, "each of the 3 packed blocks"),
                       (_shard_wrong_offset, "a contiguous run of rows, but not rank 1's"),
                       (_shard_interleaved, "interleaved")):
        result = less("lesson06.shard", wrong)
        assert why in result.reason, (wrong.__name__, result.reason)


class _NoAllReduceBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dist, group):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad, None, None


def _copy_missing_all_reduce(x, dist=None, group=None):
    return _NoAllReduceBackward.apply(x, dist, group)


class _AllReduceBothWays(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dist, group):
        ctx.dist = default_dist(dist)
        out = x.clone()
        ctx.dist.all_reduce(out)
        return out

    @staticmethod
    def backward(ctx, grad):
        grad = grad.clone()
        ctx.dist.all_reduce(grad)
        return grad, None, None


def _reduce_also_in_backward(x, dist=None, group=None):
    return _AllReduceBothWays.apply(x, dist, group)


def _in_place_sum(x, dist=None, group=None):
    """g that sums into its input: right output, but the caller's partial result is destroyed."""
    class InPlace(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, dist, group):
            dist.all_reduce(x.data, group=group)
            return x.view_as(x)

        @staticmethod
        def backward(ctx, grad):
            return grad, None, None
    return InPlace.apply(x, default_dist(dist), group)


class _GatherWholeGrad(torch.autograd.Function):
    """Gathers right, but hands every rank the whole gradient back (wrong shape: autograd
    refuses it) - or, if sliced from the wrong end, another rank's slice."""

    @staticmethod
    def forward(ctx, x, dist, group):
        ctx.rank, ctx.world = dist.get_rank(group), dist.get_world_size(group)
        parts = [torch.empty_like(x) for _ in range(ctx.world)]
        dist.all_gather(parts, x.contiguous(), group=group)
        return torch.cat(parts, dim=-1)

    @staticmethod
    def backward(ctx, grad):
        return grad.chunk(ctx.world, dim=-1)[ctx.world - 1 - ctx.rank].contiguous(), None, None


def _gather_reversed_slice(x, dist=None, group=None):
    return _GatherWholeGrad.apply(x, default_dist(dist), group)


def _gather_by_all_reduce(x, dist=None, group=None):
    """The whole output from an all_reduce of a zero-padded copy: right values and gradients,
    p times the bytes of an all_gather."""
    dist = default_dist(dist)
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    n = x.shape[-1]

    class Padded(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, dist, group):
            out = x.new_zeros(*x.shape[:-1], n * world)
            out[..., rank * n:(rank + 1) * n] = x
            dist.all_reduce(out, group=group)
            return out

        @staticmethod
        def backward(ctx, grad):
            return grad[..., rank * n:(rank + 1) * n].contiguous(), None, None
    return Padded.apply(x, dist, group)


@pytest.mark.cluster
def test_f_g_and_gather_catch_misplaced_communication(scratch_cluster_4):
    c = scratch_cluster_4
    full("lesson06.copy_to_parallel", copy_to_parallel, c)
    full("lesson06.reduce_from_parallel", reduce_from_parallel, c)
    full("lesson06.gather_from_parallel", gather_from_parallel, c)
    missing = less("lesson06.copy_to_parallel", _copy_missing_all_reduce, c)
    assert missing.points == 0 and "only its own shard's term" in missing.reason, missing.reason
    # g used where f belongs: the forward already sums, so the values are wrong too.
    both = less("lesson06.copy_to_parallel", _reduce_also_in_backward, c)
    assert both.points == 0 and "forward pass ran all_reduce" in both.reason, both.reason
    twice = less("lesson06.reduce_from_parallel", _reduce_also_in_backward, c)
    assert twice.points == 0 and "backward pass ran all_reduce" in twice.reason, twice.reason
    in_place = less("lesson06.reduce_from_parallel", _in_place_sum, c)
    assert "overwritten by the sum" in in_place.reason, in_place.reason
    reversed_ = less("lesson06.gather_from_parallel", _gather_reversed_slice, c)
    assert "got the gradient of rank" in reversed_.reason, reversed_.reason
    r = less("lesson06.gather_from_parallel", _gather_by_all_reduce, c)
    assert "forward pass ran all_reduce" in r.reason, r.reason  # right values, an all_reduce


def _column_without_f(layer, x):
    """Forgets f: the output is right, dL/dx holds only this rank's shard's part."""
    y = F.linear(x, layer.weight, layer.bias)
    return gather_from_parallel(y, layer.dist, layer.group) if layer.gather_output else y


def _column_never_gathers(layer, x):
    return F.linear(copy_to_parallel(x, layer.dist, layer.group), layer.weight, layer.bias)


def _row_bias_before_sum(layer, x):
    """Adds the bias to each partial result: the sum holds it world_size times."""
    if not layer.input_is_parallel:
        x = copy_to_parallel(x, layer.dist, layer.group)
        x = x.chunk(layer.world_size, dim=-1)[layer.rank]
    return reduce_from_parallel(F.linear(x, layer.weight, layer.bias), layer.dist, layer.group)


def _row_slice_without_f(layer, x):
    """Slices the whole input without f: dL/dx is right only in this rank's own chunk."""
    if not layer.input_is_parallel:
        x = x.chunk(layer.world_size, dim=-1)[layer.rank]
    y = reduce_from_parallel(F.linear(x, layer.weight), layer.dist, layer.group)
    return y + layer.bias


def _row_split_in_half(layer, x):
    """Takes the first or second half of the input, as on 2 ranks, whatever the world size."""
    if not layer.input_is_parallel:
        x = copy_to_parallel(x, layer.dist, layer.group)
        x = x.chunk(2, dim=-1)[layer.rank % 2]
    y = reduce_from_parallel(F.linear(x, layer.weight), layer.dist, layer.group)
    return y + layer.bias


@pytest.mark.cluster
def test_layer_forwards_solution_and_mistakes(scratch_cluster_4):
    c = scratch_cluster_4
    full("lesson06.column_parallel_forward", column_parallel_forward, c)
    full("lesson06.row_parallel_forward", row_parallel_forward, c)
    for wrong, why in ((_column_without_f, "only its own shard's term"),
                       (_column_never_gathers, "with gather_output every rank needs all")):
        r = less("lesson06.column_parallel_forward", wrong, c)
        assert why in r.reason, (wrong.__name__, r.reason)
    for wrong, why in ((_row_bias_before_sum, "holds the bias 2 times"),
                       (_row_slice_without_f, "right only in rank 0's chunk"),
                       (_row_split_in_half, "3 ranks, whole input")):
        r = less("lesson06.row_parallel_forward", wrong, c)
        assert why in r.reason, (wrong.__name__, r.reason)


def _attention_heads_last(attn, x):
    """Splits the packed projection as (heads, 3) instead of (3, heads): q, k, v mixed up."""
    b, t, _ = x.shape
    q, k, v = attn.qkv(x).view(b, t, attn.local_heads, 3, attn.head_dim).unbind(dim=3)
    q, k, v = (z.transpose(1, 2) for z in (q, k, v))
    y = F.scaled_dot_product_attention(q, k, v, is_causal=attn.causal)
    return attn.out_proj(y.transpose(1, 2).reshape(b, t, attn.local_heads * attn.head_dim))


def _attention_never_causal(attn, x):
    b, t, _ = x.shape
    q, k, v = attn.qkv(x).view(b, t, 3, attn.local_heads, attn.head_dim).unbind(dim=2)
    q, k, v = (z.transpose(1, 2) for z in (q, k, v))
    y = F.scaled_dot_product_attention(q, k, v)
    return attn.out_proj(y.transpose(1, 2).reshape(b, t, attn.local_heads * attn.head_dim))


def _attention_reshape_without_transpose(attn, x):
    """Puts the heads back with a reshape of (b, heads, t, d): sequence and heads interleaved."""
    b, t, _ = x.shape
    q, k, v = attn.qkv(x).view(b, t, 3, attn.local_heads, attn.head_dim).unbind(dim=2)
    q, k, v = (z.transpose(1, 2) for z in (q, k, v))
    y = F.scaled_dot_product_attention(q, k, v, is_causal=attn.causal)
    return attn.out_proj(y.reshape(b, t, attn.local_heads * attn.head_dim))


@pytest.mark.cluster
def test_attention_forward_solution_and_mistakes(scratch_cluster_4):
    from course_lib.tensor_parallel import attention_forward

    c = scratch_cluster_4
    full("lesson06.attention_forward", attention_forward, c)
    for wrong, why in ((_attention_heads_last, "q, k and v were taken from the wrong places"),
                       (_attention_reshape_without_transpose, "positions and heads are mixed")):
        r = less("lesson06.attention_forward", wrong, c)
        assert why in r.reason, (wrong.__name__, r.reason)
    r = less("lesson06.attention_forward", _attention_never_causal, c)
    assert "without the causal mask" in r.reason, r.reason


# lesson06.initial_slice -----------------------------------------------------------------------

def init_local_shape(layer, bias):
    """Draws only the local shard's shape: with one seed every rank gets the same numbers."""
    bound = 1 / layer.in_features ** 0.5
    p = layer.world_size
    rows = layer.out_features // p if layer.dim == 0 else layer.out_features
    cols = layer.in_features if layer.dim == 0 else layer.in_features // p
    w = torch.empty(rows, cols).uniform_(-bound, bound)
    n_bias = rows if layer.dim == 0 else layer.out_features
    return w, torch.empty(n_bias).uniform_(-bound, bound) if bias else None


def init_bias_first(layer, bias):
    """Draws the bias before the weight: another stream than nn.Linear's."""
    from course_lib.tensor_parallel import initial_slice
    b = torch.empty(layer.out_features).uniform_(-1, 1) if bias else None
    w, _ = initial_slice(layer, False)
    if b is not None:
        bound = 1 / layer.in_features ** 0.5
        b = (b * bound)
        if layer.dim == 0:
            b = shard(b, 0, layer.rank, layer.world_size, layer.parts)
    return w, b


def init_ignores_parts(layer, bias):
    """Contiguous rows for the rank, as if q, k and v were one block."""
    from types import SimpleNamespace
    from course_lib.tensor_parallel import initial_slice
    return initial_slice(SimpleNamespace(**{**vars(layer), "parts": 1}), bias)


def test_initial_slice_solution_and_mistakes():
    from course_lib.tensor_parallel import initial_slice

    full("lesson06.initial_slice", initial_slice)
    for wrong, why in ((init_local_shape, "the first numbers nn.Linear draws"),
                       (init_bias_first, "nn.Linear's order"),
                       (init_ignores_parts, "rows in each of the 3 blocks")):
        r = less("lesson06.initial_slice", wrong)
        assert why in r.reason, (wrong.__name__, r.reason)


def test_a_stub_gets_one_line():
    def stub(tensor, dim, rank, world_size, parts=1):
        raise NotImplementedError

    r = grade_function("lesson06.shard", stub)
    assert r.points == 0 and len(str(r).splitlines()) == 1, str(r)
