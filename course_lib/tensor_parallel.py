"""Tensor parallelism (Megatron-style): split each weight matrix across the ranks of a group.

A column-parallel linear keeps a slice of the output features, a row-parallel linear a slice of
the input features; put one after the other and the pair needs one all-reduce forward and one
backward. `f` (identity forward, all-reduce backward) and `g` (all-reduce forward, identity
backward) are the two autograd functions that make the gradients come out right.
"""

from __future__ import annotations

import math
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn

from course_lib.data import default_dist


def _all_reduce_sum(tensor: torch.Tensor, dist: Any, group: Any) -> torch.Tensor:
    """Sum `tensor` over the group into a fresh contiguous tensor (the input is left alone)."""
    out = tensor.contiguous().clone()
    dist.all_reduce(out, op=dist.ReduceOp.SUM, group=group)
    return out


class CopyToParallel(torch.autograd.Function):
    """`f`: identity forward; all-reduce backward, since every rank's shard used the same input."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, dist: Any, group: Any) -> torch.Tensor:
        ctx.dist, ctx.group = dist, group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _all_reduce_sum(grad, ctx.dist, ctx.group), None, None


class ReduceFromParallel(torch.autograd.Function):
    """`g`: all-reduce forward (sum the partial outputs); identity backward."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, dist: Any, group: Any) -> torch.Tensor:
        return _all_reduce_sum(x, dist, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, None, None


class GatherFromParallel(torch.autograd.Function):
    """All-gather the last dimension forward; keep this rank's slice of the gradient backward."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, dist: Any, group: Any) -> torch.Tensor:
        ctx.rank, ctx.world = dist.get_rank(group), dist.get_world_size(group)
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(ctx.world)]
        dist.all_gather(parts, x, group=group)
        return torch.cat(parts, dim=-1)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad.chunk(ctx.world, dim=-1)[ctx.rank].contiguous(), None, None


def divide(n: int, world_size: int, what: str) -> int:
    """n // world_size, or a clear error when the split would be uneven."""
    if n % world_size:
        raise ValueError(f"{what} ({n}) is not divisible by the tensor-parallel group size "
                         f"({world_size}); choose sizes that split evenly")
    return n // world_size


def shard(tensor: torch.Tensor, dim: int, rank: int, world_size: int,
          parts: int = 1) -> torch.Tensor:
    """This rank's slice of `tensor` along `dim`; with `parts` > 1 (e.g. packed q, k, v), the
    rank's slice of each of the `parts` equal blocks, concatenated."""
    blocks = tensor.chunk(parts, dim=dim)
    size = divide(blocks[0].shape[dim], world_size, f"size of dim {dim} per block")
    return torch.cat([b.narrow(dim, rank * size, size) for b in blocks], dim=dim).clone()


class _ParallelLinear(nn.Module):
    """Shared set-up: the group, its size and rank, and nn.Linear's default initialization."""

    def __init__(self, in_features: int, out_features: int, bias: bool, dist: Any, group: Any,
                 local_shape: tuple[int, int], bias_size: int):
        super().__init__()
        self.dist, self.group = default_dist(dist), group
        self.rank = self.dist.get_rank(group)
        self.world_size = self.dist.get_world_size(group)
        self.in_features, self.out_features = in_features, out_features
        # Same distribution as nn.Linear's default: uniform(+-1/sqrt(in_features)).
        bound = 1 / math.sqrt(in_features)
        self.weight = nn.Parameter(torch.empty(local_shape).uniform_(-bound, bound))
        self.bias = nn.Parameter(torch.empty(bias_size).uniform_(-bound, bound)) if bias else None

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None}, rank={self.rank}/{self.world_size}")


class ColumnParallelLinear(_ParallelLinear):
    """y = x A^T + b with A split by rows (output features): each rank computes a slice of y.

    With `gather_output=False` (the usual case, feeding a RowParallelLinear) the output stays
    split; with True it is all-gathered so every rank holds the whole y.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True, *,
                 gather_output: bool = False, dist: Any = None, group: Any = None):
        d = default_dist(dist)
        local = divide(out_features, d.get_world_size(group), "out_features")
        super().__init__(in_features, out_features, bias, d, group, (local, in_features), local)
        self.gather_output = gather_output

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = CopyToParallel.apply(x, self.dist, self.group)
        y = F.linear(x, self.weight, self.bias)
        return GatherFromParallel.apply(y, self.dist, self.group) if self.gather_output else y

    @classmethod
    def from_linear(cls, linear: nn.Linear, *, gather_output: bool = False, dist: Any = None,
                    group: Any = None, parts: int = 1) -> "ColumnParallelLinear":
        """This rank's shard of a full `linear` (rows of its weight and bias), for parity tests;
        `parts` > 1 shards each of that many packed blocks (e.g. 3 for q, k, v)."""
        layer = cls(linear.in_features, linear.out_features, linear.bias is not None,
                    gather_output=gather_output, dist=dist,
                    group=group).to(linear.weight.dtype)
        with torch.no_grad():
            layer.weight.copy_(shard(linear.weight, 0, layer.rank, layer.world_size, parts))
            if linear.bias is not None:
                layer.bias.copy_(shard(linear.bias, 0, layer.rank, layer.world_size, parts))
        return layer


class RowParallelLinear(_ParallelLinear):
    """y = x A^T + b with A split by columns (input features): each rank holds a slice of x,
    computes a partial y, and the partial results are summed by one all-reduce.

    `input_is_parallel=True` (the usual case, after a ColumnParallelLinear) expects x already
    split along its last dimension; False takes the whole x and keeps this rank's slice.
    The bias is whole on every rank and added once, after the sum.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True, *,
                 input_is_parallel: bool = True, dist: Any = None, group: Any = None):
        d = default_dist(dist)
        local = divide(in_features, d.get_world_size(group), "in_features")
        super().__init__(in_features, out_features, bias, d, group, (out_features, local),
                         out_features)
        self.input_is_parallel = input_is_parallel

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.input_is_parallel:
            x = CopyToParallel.apply(x, self.dist, self.group)
            x = x.chunk(self.world_size, dim=-1)[self.rank]
        y = ReduceFromParallel.apply(F.linear(x, self.weight), self.dist, self.group)
        return y + self.bias if self.bias is not None else y

    @classmethod
    def from_linear(cls, linear: nn.Linear, *, input_is_parallel: bool = True, dist: Any = None,
                    group: Any = None) -> "RowParallelLinear":
        """This rank's shard of a full `linear` (columns of its weight; the whole bias)."""
        layer = cls(linear.in_features, linear.out_features, linear.bias is not None,
                    input_is_parallel=input_is_parallel, dist=dist,
                    group=group).to(linear.weight.dtype)
        with torch.no_grad():
            layer.weight.copy_(shard(linear.weight, 1, layer.rank, layer.world_size))
            if linear.bias is not None:
                layer.bias.copy_(linear.bias)
        return layer


class TensorParallelMLP(nn.Module):
    """fc2(act(fc1(x))) with fc1 column-parallel and fc2 row-parallel: one all-reduce forward,
    one backward, and each rank holds 1/p of both weight matrices."""

    def __init__(self, d_model: int, d_hidden: int, bias: bool = True, *,
                 activation: Callable[[torch.Tensor], torch.Tensor] = F.gelu, dist: Any = None,
                 group: Any = None):
        super().__init__()
        self.fc1 = ColumnParallelLinear(d_model, d_hidden, bias, dist=dist, group=group)
        self.fc2 = RowParallelLinear(d_hidden, d_model, bias, dist=dist, group=group)
        self.activation = activation

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.activation(self.fc1(x)))

    @classmethod
    def from_linears(cls, fc1: nn.Linear, fc2: nn.Linear, *,
                     activation: Callable[[torch.Tensor], torch.Tensor] = F.gelu,
                     dist: Any = None, group: Any = None) -> "TensorParallelMLP":
        """This rank's shard of the unsplit MLP `fc2(activation(fc1(x)))`."""
        if fc1.out_features != fc2.in_features:
            raise ValueError(f"fc1 gives {fc1.out_features} features but fc2 takes "
                             f"{fc2.in_features}")
        mlp = cls(fc1.in_features, fc1.out_features, activation=activation, dist=dist,
                  group=group)
        mlp.fc1 = ColumnParallelLinear.from_linear(fc1, dist=dist, group=group)
        mlp.fc2 = RowParallelLinear.from_linear(fc2, dist=dist, group=group)
        return mlp


class TensorParallelAttention(nn.Module):
    """Multi-head self-attention split by heads: each rank owns num_heads/p heads (its slice of
    the q, k, v projections, column-parallel) and the matching columns of the output projection
    (row-parallel). Inputs are (batch, seq, embed_dim), like nn.MultiheadAttention(batch_first=True).
    """

    def __init__(self, embed_dim: int, num_heads: int, bias: bool = True, *,
                 causal: bool = False, dist: Any = None, group: Any = None):
        super().__init__()
        d = default_dist(dist)
        world = d.get_world_size(group)
        if embed_dim % num_heads:
            raise ValueError(f"embed_dim ({embed_dim}) is not divisible by num_heads "
                             f"({num_heads})")
        self.local_heads = divide(num_heads, world, "num_heads")
        self.head_dim = embed_dim // num_heads
        self.embed_dim, self.num_heads, self.causal = embed_dim, num_heads, causal
        # One packed projection; local rows are [q_local; k_local; v_local].
        self.qkv = ColumnParallelLinear(embed_dim, 3 * embed_dim, bias, dist=d, group=group)
        self.out_proj = RowParallelLinear(embed_dim, embed_dim, bias, dist=d, group=group)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.local_heads, self.head_dim).unbind(dim=2)
        q, k, v = (z.transpose(1, 2) for z in (q, k, v))  # (batch, local heads, seq, head_dim)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=self.causal)
        return self.out_proj(y.transpose(1, 2).reshape(b, t, self.local_heads * self.head_dim))

    @classmethod
    def from_torch(cls, mha: nn.MultiheadAttention, *, causal: bool = False, dist: Any = None,
                   group: Any = None) -> "TensorParallelAttention":
        """This rank's heads of a full `nn.MultiheadAttention(batch_first=True)`."""
        if not (mha.batch_first and mha._qkv_same_embed_dim) or mha.bias_k is not None:
            raise ValueError("expected nn.MultiheadAttention(batch_first=True) with kdim = vdim "
                             "= embed_dim and no add_bias_kv")
        has_bias = mha.in_proj_bias is not None
        attn = cls(mha.embed_dim, mha.num_heads, has_bias, causal=causal, dist=dist, group=group)
        packed = nn.Linear(mha.embed_dim, 3 * mha.embed_dim, bias=has_bias,
                           dtype=mha.in_proj_weight.dtype)
        with torch.no_grad():
            packed.weight.copy_(mha.in_proj_weight)
            if has_bias:
                packed.bias.copy_(mha.in_proj_bias)
        attn.qkv = ColumnParallelLinear.from_linear(packed, dist=dist, group=group, parts=3)
        attn.out_proj = RowParallelLinear.from_linear(mha.out_proj, dist=dist, group=group)
        return attn
