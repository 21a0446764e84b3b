"""Gradient-norm clipping when no rank holds every gradient: `clip_grad_norm_` as torch's, with
the norm's pieces summed over the groups that share the model out.

The norm of the whole model's gradient is (sum over every element of |g|^p)^(1/p). A rank holds
a part of those elements:

- DDP: every rank holds every gradient, already averaged: no group, torch's own computation.
- ZeRO-2 / ZeRO-3: each rank holds a shard of each flat gradient, the last ones padded; the
  pieces are summed over the sharding group and the padding is not an element of the model
  (`shard_grads` gives each shard's real elements).
- Tensor parallel: column- and row-parallel weights are sharded (summed over the TP group);
  the row-parallel bias, norms and embeddings are replicated: every TP rank holds them whole,
  so only one rank of the group counts them (`tp_duplicates` names what the others skip).
- Pipeline parallel: each stage holds its own layers: summed over the PP group.

Each group is reduced in turn (sum of |g|^p; max for p = inf; min for p = -inf), so a rank of
a DP x TP x PP layout with sharded gradients passes `groups=[tp, pp, dp]`. The clipping factor
`max_norm / (total + 1e-6)`, at most 1, is torch's; every rank scales what it holds by it,
so the ranks' parameters stay as they were relative to each other.
"""

from __future__ import annotations

import math
from typing import Any, Iterable, Sequence

import torch
from torch import nn

from course_lib.backend import default_dist
from course_lib.tp_layers import ParallelLinear

__all__ = ["clip_grad_norm_", "clip_grads_", "shard_grads", "tp_duplicates"]


def _local(grads: Sequence[torch.Tensor], p: float) -> torch.Tensor:
    """This rank's piece of the norm: sum |g|^p (for p = 0 the count of non-zero elements:
    torch's counts the non-zero tensors), max |g| for inf, min |g| for -inf; float64."""
    if p == math.inf:
        init, combine = 0.0, torch.max
    elif p == -math.inf:
        init, combine = math.inf, torch.min
    else:
        init, combine = 0.0, torch.sum
    norms = [torch.linalg.vector_norm(g.detach(), p).double() for g in grads if g.numel()]
    if not norms:
        return torch.tensor(init, dtype=torch.float64)
    stacked = torch.stack(norms)
    return combine(stacked) if p in (math.inf, -math.inf) or p == 0 else (stacked ** p).sum()


def total_norm(grads: Sequence[torch.Tensor], norm_type: float = 2.0, *,
               groups: Sequence[Any] = (), dist: Any = None) -> torch.Tensor:
    """The p-norm of the gradients that the ranks of `groups` hold together (float64)."""
    p = float(norm_type)
    piece = _local(grads, p)
    if groups:
        d = default_dist(dist)
        op = (d.ReduceOp.MAX if p == math.inf else d.ReduceOp.MIN if p == -math.inf
              else d.ReduceOp.SUM)
        for group in groups:
            d.all_reduce(piece, op=op, group=group)
    if p in (0.0, math.inf, -math.inf):
        return piece
    return piece ** (1.0 / p)


def clip_grads_(grads: Iterable[torch.Tensor], max_norm: float, norm_type: float = 2.0,
                error_if_nonfinite: bool = False, *, uncounted: Iterable[torch.Tensor] = (),
                groups: Sequence[Any] = (), dist: Any = None) -> torch.Tensor:
    """Scale `grads` (tensors, in place) and `uncounted` (scaled, left out of the norm: another
    rank counts them) so that the norm over `groups` is at most `max_norm`; returns that norm
    before clipping, in the gradients' dtype. Every rank of `groups` must call it (a rank
    holding no gradient contributes nothing to the norm but takes part in the reductions)."""
    grads, uncounted = list(grads), list(uncounted)
    total = total_norm(grads, norm_type, groups=groups, dist=dist)
    if error_if_nonfinite and not torch.isfinite(total):
        raise RuntimeError(f"The total norm of order {float(norm_type)} for gradients from "
                           "`parameters` is non-finite, so it cannot be clipped. To disable this "
                           "error and scale the gradients by the non-finite norm anyway, set "
                           "`error_if_nonfinite=False`")
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for g in grads + uncounted:
        g.detach().mul_(coef.to(g.dtype))
    held = grads + uncounted  # none (a stage without parameters): torch's default dtype
    return total.to(held[0].dtype if held else torch.get_default_dtype())


def clip_grad_norm_(parameters: torch.Tensor | Iterable[torch.Tensor], max_norm: float,
                    norm_type: float = 2.0, error_if_nonfinite: bool = False, *,
                    duplicates: Iterable[torch.Tensor] = (), groups: Sequence[Any] = (),
                    dist: Any = None) -> torch.Tensor:
    """`torch.nn.utils.clip_grad_norm_` over the parameters that the ranks of `groups` hold
    together: `parameters`' gradients count in the norm; the gradients of `duplicates` (this
    rank's copies of parameters another rank of the group counts) are only scaled. With no
    `groups`, torch's own result."""
    if isinstance(parameters, torch.Tensor):
        parameters = [parameters]
    skip = {id(t) for t in duplicates}
    params = [p for p in parameters if p.grad is not None]
    counted = [p.grad for p in params if id(p) not in skip]
    scaled = [p.grad for p in params if id(p) in skip]
    return clip_grads_(counted, max_norm, norm_type, error_if_nonfinite, uncounted=scaled,
                       groups=groups, dist=dist)


def _real(grad: torch.Tensor, layout: Any, rank: int) -> torch.Tensor:
    """The elements of a shard's gradient that are the model's (not the flat buffer's padding)."""
    real = max(0, min(layout.shard_numel, layout.numel - rank * layout.shard_numel))
    return grad[:real]


def shard_grads(sharded: Any) -> list[torch.Tensor]:
    """The real elements of this rank's gradient shards (views: scaling them scales the shards),
    of a `ZeroRedundancyOptimizer` (stages 1 and 2: its buckets' shards, after `step`'s
    reduction, i.e. after backward) or a module wrapped by `fully_shard` (ZeRO-3)."""
    if hasattr(sharded, "buckets"):  # ZeroRedundancyOptimizer
        return [_real(b.shard.grad, b.layout, sharded.rank) for b in sharded.buckets
                if b.shard.grad is not None]
    out = []
    for m in sharded.modules():  # fully_shard's units, outermost first
        unit = getattr(m, "_zero_unit", None)
        for flat in getattr(unit, "flats", []):
            if flat.shard.grad is not None:
                out.append(_real(flat.shard.grad, flat.layout, unit.rank))
    return out


def tp_duplicates(module: nn.Module, *, dist: Any = None, group: Any = None) -> list[nn.Parameter]:
    """The parameters of `module` that every rank of the TP `group` holds whole (all but the
    column-parallel weights and biases and the row-parallel weights), on every rank of the
    group but its first: the ones that rank's norm leaves out."""
    d = default_dist(dist)
    if d.get_rank(group) == 0:
        return []
    sharded = set()
    for m in module.modules():
        if isinstance(m, ParallelLinear):
            sharded.add(id(m.weight))
            if m.dim == 0 and m.bias is not None:
                sharded.add(id(m.bias))
    return [p for p in module.parameters() if id(p) not in sharded]
