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
a DP x TP x PP layout with sharded gradients passes `groups=[tp, pp, dp]`. That core,
`total_norm` over a rank's `Held` pieces, is lesson 11b's exercise (`course_lib.clip_norm`);
this module finds the pieces of each layout and scales them. The clipping factor
`max_norm / (total + 1e-6)`, at most 1, is torch's; every rank scales what it holds by it,
so the ranks' parameters stay as they were relative to each other.
"""

from __future__ import annotations

from typing import Any, Iterable, Sequence

import torch
from torch import nn

from course_lib.backend import default_dist
from course_lib.clip_norm import Held, total_norm
from course_lib.i18n import _
from course_lib.sharded_state import units_of
from course_lib.tp_layers import ParallelLinear

__all__ = ["Held", "clip_grad_norm_", "clip_grads_", "shard_grads", "tp_duplicates", "tp_sharded"]


def clip_grads_(grads: Iterable[torch.Tensor | Held], max_norm: float, norm_type: float = 2.0,
                error_if_nonfinite: bool = False, *, uncounted: Iterable[torch.Tensor] = (),
                groups: Sequence[Any] = (), dist: Any = None) -> torch.Tensor:
    """Scale `grads` (tensors, whole, or `Held` pieces: a shard's padding left out of the norm,
    `shard_grads`) and `uncounted` (scaled, left out of the norm: another rank counts them), in
    place, so that the norm over `groups` is at most `max_norm`; returns that norm before
    clipping, in the gradients' dtype. Every rank of `groups` must call it (a rank holding no
    gradient contributes nothing to the norm but takes part in the reductions)."""
    held = [g if isinstance(g, Held) else Held(g, g.numel()) for g in grads]
    held += [Held(g, g.numel(), False) for g in uncounted]
    total = total_norm(held, norm_type, groups, default_dist(dist))
    if error_if_nonfinite and not torch.isfinite(total):
        raise RuntimeError(_("The total norm of order {order} for gradients from `parameters` "
                             "is non-finite, so it cannot be clipped. To disable this error and "
                             "scale the gradients by the non-finite norm anyway, set "
                             "`error_if_nonfinite=False`", order=float(norm_type)))
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for h in held:
        h.grad.detach().mul_(coef.to(h.grad.dtype))
    # none (a stage without parameters): torch's default dtype
    return total.to(held[0].grad.dtype if held else torch.get_default_dtype())


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


def _pieces(grad: torch.Tensor, layout: Any, rank: int, counted: Sequence[bool]) -> list[Held]:
    """A shard's gradient cut where its parameters' `counted` changes, each piece a view (scaling
    it scales the shard); the flat buffer's padding, past the model's last element, left out."""
    start, stop = rank * layout.shard_numel, (rank + 1) * layout.shard_numel
    ranges: list[list] = []  # [lo, hi, counted]: consecutive parameters are adjacent
    for offset, numel, count in zip(layout.offsets, layout.numels, counted):
        lo, hi = max(offset, start), min(offset + numel, stop)
        if lo >= hi:
            continue
        if ranges and ranges[-1][2] == count:
            ranges[-1][1] = hi
        else:
            ranges.append([lo, hi, count])
    return [Held(grad[lo - start:hi - start], hi - lo, count) for lo, hi, count in ranges]


def tp_sharded(module: nn.Module, name: str) -> bool:
    """Whether `module`'s parameter `name` is split over the TP group (a column-parallel weight
    or bias, a row-parallel weight); every other parameter is replicated: each rank holds it
    whole."""
    return isinstance(module, ParallelLinear) and (
        name == "weight" or name == "bias" and module.dim == 0)


def shard_grads(sharded: Any, *, tp_rank: int = 0, model: nn.Module | None = None) -> list[Held]:
    """This rank's gradient shards, as views that hold the model's elements only (`Held`:
    scaling them scales the shards), of a `ZeroRedundancyOptimizer` (stages 1 and 2: its
    buckets' shards, after `step`'s reduction, i.e. after backward) or a module wrapped by
    `fully_shard` (ZeRO-3). On a TP rank other than the first (`tp_rank`), the elements of
    replicated parameters are held but not counted: the first TP rank counts them; ZeRO-1/2
    find which parameters those are in `model`."""
    def counted(module: nn.Module, name: str) -> bool:
        return tp_rank == 0 or tp_sharded(module, name)

    if hasattr(sharded, "buckets"):  # ZeroRedundancyOptimizer
        if tp_rank and model is None:
            raise ValueError(_("shard_grads: with tp_rank > 0, pass the model whose "
                               "parameters the optimizer holds (which of them are replicated)"))
        owners = {id(p): (m, n) for m in (model.modules() if tp_rank else ())
                  for n, p in m.named_parameters(recurse=False)}
        return [h for b in sharded.buckets if b.shard.grad is not None
                for h in _pieces(b.shard.grad, b.layout, sharded.rank,
                                 [not tp_rank or counted(*owners[id(p)]) for p in b.params])]
    held = []
    for unit in units_of(sharded):
        for flat in unit.flats:
            if flat.shard.grad is None:
                continue
            where = {i: (m, n) for m, n, i in flat.entries}
            held += _pieces(flat.shard.grad, flat.layout, unit.rank,
                            [counted(*where[i]) for i in range(len(flat.layout.numels))])
    return held


def tp_duplicates(module: nn.Module, *, dist: Any = None, group: Any = None) -> list[nn.Parameter]:
    """The parameters of `module` that every rank of the TP `group` holds whole (all but the
    column-parallel weights and biases and the row-parallel weights), on every rank of the
    group but its first: the ones that rank's norm leaves out."""
    if default_dist(dist).get_rank(group) == 0:
        return []
    return [p for m in module.modules() for n, p in m.named_parameters(recurse=False)
            if not tp_sharded(m, n)]
