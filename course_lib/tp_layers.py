"""The set-up of lesson 06's tensor-parallel modules, around the functions the lesson writes.

`course_lib.tensor_parallel` (lesson 06's export) subclasses these classes and plugs the
lesson's functions into their hooks:

- `ParallelLinear._initial_slice(bias)`: this rank's slice of one full `nn.Linear`
  initialization (`initial_slice`, Exercise 5);
- `ParallelLinear._shard(tensor, dim, parts)`: this rank's slice of a full tensor (`shard`,
  Exercise 1), for `from_linear`;
- `forward`: `column_parallel_forward`, `row_parallel_forward` (Exercises 6 and 7) and
  `attention_forward` (Exercise 8);
- `column` and `row`: the layer classes a `ParallelMLP` or `HeadParallelAttention` builds.

What is here is what no exercise asks for: the group, its size and this rank, the size checks,
the row-parallel bias made equal on every rank, and taking this rank's shard of a full
`nn.Linear` or `nn.MultiheadAttention`, and dropout (`dropout=p`, off by default) drawn
through the RNG tracker (`course_lib.rng`): on the sharded activation (the MLP's hidden
features, the attention's heads before `out_proj`) from the `SHARDED` stream, one per TP rank;
on the whole output, which every rank of the group holds, from the `REPLICATED` stream, the
same on every rank of the group. Hooks apply it, so the lesson's forwards stay as they are.
This module imports nothing from `course_lib.tensor_parallel`.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn

from course_lib.backend import default_dist, global_rank
from course_lib.i18n import _
from course_lib.rng import REPLICATED, SHARDED, RNGStatesTracker, get_rng_tracker

__all__ = ["divide", "TrackedDropout", "ParallelLinear", "ColumnParallel", "RowParallel", "ParallelMLP",
           "HeadParallelAttention"]


def divide(n: int, world_size: int, what: str) -> int:
    """n // world_size, or a clear error when the split would be uneven."""
    if n % world_size:
        raise ValueError(_("{what} ({n}) is not divisible by the tensor-parallel group size "
                           "({world_size}); choose sizes that split evenly", what=what, n=n,
                           world_size=world_size))
    return n // world_size


class TrackedDropout:
    """Dropout with probability `dropout` on a TP module's sharded activation (the input of its
    row-parallel layer, `inner`) and on its output, each drawn from its stream of `tracker`
    (default: the process's, `course_lib.rng.get_rng_tracker()`), only in training mode."""

    dropout: float = 0.0
    tracker: RNGStatesTracker | None = None

    def _drop(self, x: torch.Tensor, stream: str) -> torch.Tensor:
        if not (self.training and self.dropout):
            return x
        tracker = self.tracker or get_rng_tracker()
        with tracker.fork(stream):
            return F.dropout(x, self.dropout, training=True)

    def _drop_input(self, module: nn.Module, args: tuple) -> tuple:  # `inner`'s pre-hook
        return (self._drop(args[0], SHARDED), *args[1:])

    def _drop_output(self, module: nn.Module, args: tuple, out: torch.Tensor) -> torch.Tensor:
        return self._drop(out, REPLICATED)

    def _install_dropout(self, inner: nn.Module) -> None:
        """Hook `inner` (its input is sharded) and this module (its output is replicated)."""
        for handle in getattr(self, "_dropout_hooks", []):
            handle.remove()
        self._dropout_hooks = [inner.register_forward_pre_hook(self._drop_input),
                               self.register_forward_hook(self._drop_output)]


class ParallelLinear(nn.Module):
    """What both layers share: the group, its size and this rank, and this rank's slice of one
    full `nn.Linear(in_features, out_features)` initialization (`_initial_slice`): rows for a
    column-parallel layer (`dim = 0`), columns for a row-parallel one (`dim = 1`, whose bias
    every rank holds whole). `parts` > 1: the weight packs that many equal blocks of rows
    (q, k and v) and a column-parallel rank keeps its rows of each.

    Built with the same seed on every rank, the shards are the slices of the `nn.Linear` one
    process builds with that seed (the result of Megatron-LM's CPU initialization, which builds
    the whole weight and splits it). It is drawn on the CPU and moved to `device` (None: stays
    on the CPU); `from_linear` takes the unsplit layer's device.
    """

    dim = 0  # the dimension of the weight that is split: 0 rows (outputs), 1 columns (inputs)

    def __init__(self, in_features: int, out_features: int, bias: bool, dist: Any, group: Any,
                 parts: int = 1, device: Any = None):
        super().__init__()
        self.dist, self.group = default_dist(dist), group
        self.rank = self.dist.get_rank(group)
        self.world_size = self.dist.get_world_size(group)
        self.in_features, self.out_features, self.parts = in_features, out_features, parts
        weight, b = self._initial_slice(bias)  # drawn on the CPU, then moved to `device`
        self.weight = nn.Parameter(weight.to(device))
        self.bias = None if b is None else nn.Parameter(b.to(device))

    def _initial_slice(self, bias: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
        raise NotImplementedError(_("a subclass plugs in the initialization (initial_slice)"))

    def _shard(self, tensor: torch.Tensor, dim: int, parts: int) -> torch.Tensor:
        raise NotImplementedError(_("a subclass plugs in the slicing (shard)"))

    def load_full(self, full: nn.Linear) -> None:
        """Take this rank's slice of the unsplit layer `full` (its dtype too)."""
        with torch.no_grad():
            self.weight = nn.Parameter(self._shard(full.weight, self.dim, self.parts).clone())
            if full.bias is None:
                self.bias = None
            else:
                whole = self.dim == 1  # a row-parallel layer adds the whole bias once
                mine = full.bias if whole else self._shard(full.bias, 0, self.parts)
                self.bias = nn.Parameter(mine.clone())

    @classmethod
    def _sliced(cls, linear: nn.Linear, **kwargs: Any) -> "ParallelLinear":
        """A layer holding this rank's slice of `linear`; its own throwaway initialization
        leaves the caller's random state as it was."""
        with torch.random.fork_rng(devices=[]):
            layer = cls(linear.in_features, linear.out_features, linear.bias is not None,
                        device=linear.weight.device, **kwargs)
        layer.load_full(linear)
        return layer

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None}, rank={self.rank}/{self.world_size}")


class ColumnParallel(ParallelLinear):
    """y = x A^T + b with A split by rows (output features): each rank computes a slice of y.

    With `gather_output=False` (the usual case, feeding a row-parallel layer) the output stays
    split; with True it is all-gathered so every rank holds the whole y.
    """

    dim = 0

    def __init__(self, in_features: int, out_features: int, bias: bool = True, *,
                 gather_output: bool = False, dist: Any = None, group: Any = None,
                 parts: int = 1, device: Any = None):
        d = default_dist(dist)
        divide(out_features, d.get_world_size(group) * parts, "out_features")
        super().__init__(in_features, out_features, bias, d, group, parts, device)
        self.gather_output = gather_output

    @classmethod
    def from_linear(cls, linear: nn.Linear, *, gather_output: bool = False, dist: Any = None,
                    group: Any = None, parts: int = 1) -> "ColumnParallel":
        """This rank's shard of a full `linear` (rows of its weight and bias); `parts` > 1
        shards each of that many packed blocks (e.g. 3 for q, k, v)."""
        return cls._sliced(linear, gather_output=gather_output, dist=dist, group=group,
                           parts=parts)


class RowParallel(ParallelLinear):
    """y = x A^T + b with A split by columns (input features): each rank holds a slice of x,
    computes a partial y, and the partial results are summed by one all-reduce.

    `input_is_parallel=True` (the usual case, after a column-parallel layer) expects x already
    split along its last dimension; False takes the whole x and keeps this rank's slice. The
    bias is whole on every rank, added once after the sum, and broadcast from the group's first
    rank at construction, so ranks seeded differently still agree on it (on `device`: a
    NCCL group takes CUDA tensors only).
    """

    dim = 1

    def __init__(self, in_features: int, out_features: int, bias: bool = True, *,
                 input_is_parallel: bool = True, dist: Any = None, group: Any = None,
                 device: Any = None):
        d = default_dist(dist)
        divide(in_features, d.get_world_size(group), "in_features")
        super().__init__(in_features, out_features, bias, d, group, device=device)
        if self.bias is not None and self.world_size > 1:
            self.dist.broadcast(self.bias.data, global_rank(self.dist, group, 0), group=group)
        self.input_is_parallel = input_is_parallel

    @classmethod
    def from_linear(cls, linear: nn.Linear, *, input_is_parallel: bool = True, dist: Any = None,
                    group: Any = None) -> "RowParallel":
        """This rank's shard of a full `linear` (columns of its weight; the whole bias)."""
        return cls._sliced(linear, input_is_parallel=input_is_parallel, dist=dist, group=group)


class ParallelMLP(TrackedDropout, nn.Module):
    """fc2(activation(fc1(x))) with fc1 a `column` layer and fc2 a `row` layer (the classes a
    subclass names): each rank holds 1/p of both weight matrices. `dropout`: see
    `TrackedDropout` (fc2's input, then the output)."""

    column: type[ColumnParallel]
    row: type[RowParallel]

    def __init__(self, d_model: int, d_hidden: int, bias: bool = True, *,
                 activation: Callable[[torch.Tensor], torch.Tensor] = F.gelu, dist: Any = None,
                 group: Any = None, dropout: float = 0.0,
                 tracker: RNGStatesTracker | None = None, device: Any = None):
        super().__init__()
        self.fc1 = self.column(d_model, d_hidden, bias, dist=dist, group=group, device=device)
        self.fc2 = self.row(d_hidden, d_model, bias, dist=dist, group=group, device=device)
        self.activation = activation
        self.dropout, self.tracker = dropout, tracker
        self._install_dropout(self.fc2)

    @classmethod
    def from_linears(cls, fc1: nn.Linear, fc2: nn.Linear, *,
                     activation: Callable[[torch.Tensor], torch.Tensor] = F.gelu,
                     dist: Any = None, group: Any = None, dropout: float = 0.0,
                     tracker: RNGStatesTracker | None = None) -> "ParallelMLP":
        """This rank's shard of the unsplit MLP `fc2(activation(fc1(x)))`."""
        if fc1.out_features != fc2.in_features:
            raise ValueError(_("fc1 gives {out_features} features but fc2 takes "
                               "{in_features}", out_features=fc1.out_features,
                               in_features=fc2.in_features))
        with torch.random.fork_rng(devices=[]):  # its own initialization is replaced below
            mlp = cls(fc1.in_features, fc1.out_features, activation=activation, dist=dist,
                      group=group, dropout=dropout, tracker=tracker, device=fc1.weight.device)
        mlp.fc1 = cls.column.from_linear(fc1, dist=dist, group=group)
        mlp.fc2 = cls.row.from_linear(fc2, dist=dist, group=group)
        mlp._install_dropout(mlp.fc2)
        return mlp


class HeadParallelAttention(TrackedDropout, nn.Module):
    """Multi-head self-attention split by heads: each rank owns `local_heads = num_heads / p`
    heads, `head_dim` features each: its rows of the packed q, k, v projection (`qkv`, a
    `column` layer with `parts=3`) and the matching columns of the output projection
    (`out_proj`, a `row` layer). Inputs are (batch, seq, embed_dim), as for
    `nn.MultiheadAttention(batch_first=True)`; `causal` masks the future. `dropout`: see
    `TrackedDropout` (this rank's heads' outputs, before `out_proj`, then the output).
    """

    column: type[ColumnParallel]
    row: type[RowParallel]

    def __init__(self, embed_dim: int, num_heads: int, bias: bool = True, *,
                 causal: bool = False, dist: Any = None, group: Any = None,
                 dropout: float = 0.0, tracker: RNGStatesTracker | None = None,
                 device: Any = None):
        super().__init__()
        d = default_dist(dist)
        if embed_dim % num_heads:
            raise ValueError(_("embed_dim ({embed_dim}) is not divisible by num_heads "
                               "({num_heads})", embed_dim=embed_dim, num_heads=num_heads))
        self.local_heads = divide(num_heads, d.get_world_size(group), "num_heads")
        self.head_dim = embed_dim // num_heads
        self.embed_dim, self.num_heads, self.causal = embed_dim, num_heads, causal
        # One packed projection; this rank's rows are [its q heads; its k heads; its v heads].
        self.qkv = self.column(embed_dim, 3 * embed_dim, bias, dist=d, group=group, parts=3,
                               device=device)
        self.out_proj = self.row(embed_dim, embed_dim, bias, dist=d, group=group, device=device)
        self.dropout, self.tracker = dropout, tracker
        self._install_dropout(self.out_proj)

    @classmethod
    def from_torch(cls, mha: nn.MultiheadAttention, *, causal: bool = False, dist: Any = None,
                   group: Any = None, dropout: float = 0.0,
                   tracker: RNGStatesTracker | None = None) -> "HeadParallelAttention":
        """This rank's heads of a full `nn.MultiheadAttention(batch_first=True)`."""
        if not (mha.batch_first and mha._qkv_same_embed_dim) or mha.bias_k is not None:
            raise ValueError(_("expected nn.MultiheadAttention(batch_first=True) with kdim = "
                               "vdim = embed_dim and no add_bias_kv"))
        has_bias = mha.in_proj_bias is not None
        with torch.random.fork_rng(devices=[]):  # its own initialization is replaced below
            attn = cls(mha.embed_dim, mha.num_heads, has_bias, causal=causal, dist=dist,
                       group=group, dropout=dropout, tracker=tracker,
                       device=mha.in_proj_weight.device)
        packed = nn.Linear(mha.embed_dim, 3 * mha.embed_dim, bias=has_bias,
                           dtype=mha.in_proj_weight.dtype, device=mha.in_proj_weight.device)
        with torch.no_grad():
            packed.weight.copy_(mha.in_proj_weight)
            if has_bias:
                packed.bias.copy_(mha.in_proj_bias)
        attn.qkv = cls.column.from_linear(packed, dist=dist, group=group, parts=3)
        attn.out_proj = cls.row.from_linear(mha.out_proj, dist=dist, group=group)
        attn._install_dropout(attn.out_proj)
        return attn
