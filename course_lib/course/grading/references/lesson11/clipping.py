"""Lesson 11b's clipping check, judge side: the expected norm is one process's
`torch.nn.utils.clip_grad_norm_` over the whole model's gradients; the explanations recompute
the realistic wrong norms (the local norm, the copies counted tp times, the padding counted, the
maxima summed) over the same layout."""

from __future__ import annotations

import math

import torch
from torch import nn

from course_lib.course.grading.exercises.lesson11 import clipping as ex
from course_lib.course.grading.exercises.lesson11.step import coordinates
from course_lib.i18n import _


def total_norm(rank: int, world_size: int, k: int, dp: int, tp: int, pp: int, zero: bool,
               p: float):
    if rank >= k:
        return None
    params = []
    for stage in range(pp):
        for g in ex.stage_grads(stage, pp).values():
            params.append(nn.Parameter(torch.zeros_like(g)))
            params[-1].grad = g.clone()
    norm = torch.nn.utils.clip_grad_norm_(params, max_norm=1e30, norm_type=p)
    return {"comm": ", ".join(sorted(ex.axes_of(dp, tp, pp, zero))) or "none",
            "norm": float(norm)}


def _piece(held, p: float, *, counted: bool = True, real: bool = True) -> float:
    values = torch.cat([torch.zeros(0, dtype=torch.float64)] + [
        g.reshape(-1)[:n if real else None].abs() for g, n, c in held if c or not counted])
    if p == math.inf:
        return float(values.max()) if values.numel() else 0.0
    return float((values ** p).sum())


def _reduced(k: int, dp: int, tp: int, pp: int, zero: bool, p: float, rank: int, *,
             op=None, **variant) -> float:
    """The norm rank `rank` ends with when every rank's piece is computed as `variant` says and
    reduced over the layout's groups with `op` (default: the right one)."""
    pieces = {r: _piece(ex.held_by(coordinates(r, dp, tp), dp, tp, pp, zero), p, **variant)
              for r in range(k)}
    op = op or (max if p == math.inf else sum)
    where = {r: coordinates(r, dp, tp) for r in range(k)}
    for axis in ex.axes_of(dp, tp, pp, zero):
        mates = {r: [s for s in range(k) if all(where[s][a] == where[r][a]
                                                for a in where[r] if a != axis)]
                 for r in range(k)}
        pieces = {r: op(pieces[s] for s in mates[r]) for r in range(k)}
    return pieces[rank] if p == math.inf else pieces[rank] ** (1.0 / p)


def _is(a: float, b: float) -> bool:
    return math.isclose(a, b, rel_tol=1e-9, abs_tol=1e-12)


def explain_total_norm(case, rank, expected, got) -> str | None:
    if expected is None or not isinstance(got, dict):
        return None
    k, dp, tp, pp, zero, p = case.args[2:8]
    want = expected["comm"]
    if got.get("comm") != want:
        return _("rank {rank} reduced over {got}; the gradient is split over {want} only: a "
                 "group whose ranks hold the same elements (dp without ZeRO) counts them again, "
                 "and a group left out leaves its ranks' elements out of the norm",
                 rank=rank, got=got.get("comm"), want=want)
    norm = got.get("norm")
    if not isinstance(norm, float):
        return None
    args = (k, dp, tp, pp, zero, p, rank)
    held = ex.held_by(coordinates(rank, dp, tp), dp, tp, pp, zero)
    local = _piece(held, p)
    if _is(norm, local if p == math.inf else local ** (1.0 / p)):
        return _("rank {rank} returned the norm of its own pieces only: the other ranks' "
                 "elements are missing, and each rank would clip by a different factor",
                 rank=rank)
    if tp > 1 and _is(norm, _reduced(*args, counted=False)):
        return _("the biases every tp rank holds whole were counted on each of the {tp} tp "
                 "ranks: a copy another rank counts adds nothing to the norm", tp=tp)
    if zero and _is(norm, _reduced(*args, real=False)):
        return _("the padding at the end of the flat shards was counted: only the first "
                 "numel elements of a shard are the model's")
    if p == math.inf and _is(norm, _reduced(*args, op=sum)):
        return _("the largest |g| of each rank were added up: the inf-norm of the whole model "
                 "is the largest of them, so every group combines with a maximum")
    return None
