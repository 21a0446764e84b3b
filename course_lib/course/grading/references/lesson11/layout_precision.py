"""Lesson 11a's expected values and explanations (layout and precision): the layout's groups by
brute force over the rank grid, a stage's layers, the forward under `torch.autocast`, and fp16's
loss-scale rule written out.
"""

from __future__ import annotations

import functools
import itertools

import torch

from course_lib.course.grading.exercises.lesson11 import layout_precision as ex
from course_lib.course.grading.references.lesson11.common import DTYPES, _close
from course_lib.i18n import _

AXES = ("pp", "dp", "cp", "tp")


def _keeps_rng(fn):
    """Seeding to rebuild a case's model must leave the caller's random state alone (the
    judge runs in the learner's kernel for a check cell)."""
    @functools.wraps(fn)
    def wrapped(*args, **kwargs):
        with torch.random.fork_rng(devices=[]):
            return fn(*args, **kwargs)
    return wrapped


# --- lesson11.layout_groups --------------------------------------------------------------------

def _coords(dp: int, tp: int, pp: int, cp: int) -> dict[int, dict[str, int]]:
    return {((p * dp + d) * cp + c) * tp + t: {"pp": p, "dp": d, "cp": c, "tp": t}
            for p, d, c, t in itertools.product(range(pp), range(dp), range(cp), range(tp))}


def layout_groups(dp: int, tp: int, pp: int, cp: int) -> dict:
    """Brute force over the rank grid: two ranks share an axis's group when every other
    coordinate is equal."""
    coords = _coords(dp, tp, pp, cp)
    out = {}
    for axis in AXES:
        groups: dict[tuple, list[int]] = {}
        for rank in sorted(coords):
            key = tuple(coords[rank][a] for a in AXES if a != axis)
            groups.setdefault(key, []).append(rank)
        out[axis] = sorted((sorted(g, key=lambda r: coords[r][axis]) for g in groups.values()),
                           key=lambda g: g[0])
    return {"groups": out}


def explain_layout_groups(case, rank, expected, got) -> str | None:
    dp, tp, pp, cp = case.args
    want, have = expected["groups"], got.get("groups") if isinstance(got, dict) else None
    if not isinstance(have, dict):
        return None
    coords = _coords(dp, tp, pp, cp)
    degree = {"dp": dp, "tp": tp, "pp": pp, "cp": cp}
    for axis in ("tp", "cp", "dp", "pp"):
        mine, right = have.get(axis), want[axis]
        if mine == right:
            continue
        if not isinstance(mine, list) or not all(isinstance(g, list) for g in mine):
            return None
        if sorted(map(sorted, mine)) == sorted(map(sorted, right)):
            if sorted(mine) == sorted(right):
                return _("the {axis} groups are right but not in order: order the groups by "
                         "their first rank", axis=axis)
            return _("each {axis} group holds the right ranks, but not in the order of their "
                     "{axis} coordinate", axis=axis)
        for g in mine:
            if len(g) != degree[axis]:
                return _("a {axis} group of {n} ranks ({group}): each holds {degree}, one per "
                         "{axis} coordinate", axis=axis, n=len(g), group=g, degree=degree[axis])
            if any(r not in coords for r in g):
                return _("group {group} names a rank that is not in a world of {n}", group=g,
                         n=dp * cp * tp * pp)
            others = [a for a in AXES if a != axis]
            for a in others:
                values = sorted({coords[r][a] for r in g})
                if len(values) > 1:
                    return _("the {axis} group {group} mixes {other} coordinates {values}: its "
                             "ranks may differ only in their {axis} coordinate (ranks are "
                             "counted tp fastest, then cp, then dp, then pp)", axis=axis,
                             group=g, other=a, values=values)
        return _("the {axis} groups are not the ones the rank order gives: {got} for "
                 "{expected}", axis=axis, got=mine, expected=right)
    return None


# --- lesson11.stage_layers ---------------------------------------------------------------------

def stage_layers(n_blocks: int, pp: int, pp_rank: int) -> dict:
    per = n_blocks // pp
    layers = [f"block {i}" for i in range(pp_rank * per, (pp_rank + 1) * per)]
    if pp_rank == 0:
        layers.insert(0, "embedding")
    if pp_rank == pp - 1:
        layers.append("head")
    return {"layers": layers, "the model's own modules": True}


def explain_stage_layers(case, rank, expected, got) -> str | None:
    n_blocks, pp, pp_rank = case.args
    layers = got.get("layers") if isinstance(got, dict) else None
    if not isinstance(layers, list):
        return None
    want = expected["layers"]
    blocks = [x for x in layers if str(x).startswith("block")]
    right_blocks = [x for x in want if x.startswith("block")]
    if ("embedding" in layers) != (pp_rank == 0):
        return (_("stage {stage} of {pp} holds the embedding: only the first stage does",
                  stage=pp_rank, pp=pp) if pp_rank else
                _("the first stage must begin with the embedding"))
    if ("head" in layers) != (pp_rank == pp - 1):
        return (_("stage {stage} of {pp} holds the head: only the last stage does",
                  stage=pp_rank, pp=pp) if pp_rank != pp - 1 else
                _("the last stage must end with the head"))
    if blocks != right_blocks:
        if len(blocks) != len(right_blocks):
            return _("{n} blocks on this stage: {blocks} blocks over {pp} stages make {per} "
                     "each", n=len(blocks), blocks=n_blocks, pp=pp, per=n_blocks // pp)
        return _("blocks {got} on stage {stage}: its share is {want}, in the model's order",
                 got=", ".join(blocks), stage=pp_rank, want=", ".join(right_blocks))
    if layers != want:
        return _("the layers are out of order: the embedding first, the blocks, the head last")
    if got.get("the model's own modules") is False:
        return _("the stage holds copies: it must hold the model's own modules, whose "
                 "parameters the run trains (and, on the last stage, the tied head's)")
    return None


# --- lesson11.precision_forward ----------------------------------------------------------------

@_keeps_rng
def precision_forward(precision: str) -> dict:
    model, x = ex.precision_model(), ex.precision_input()
    dtype = DTYPES[precision]
    if dtype is None:
        return ex.precision_report(model, model(x))
    with torch.autocast("cpu", dtype=dtype):
        out = model(x)
    return ex.precision_report(model, out.float())


def explain_precision_forward(case, rank, expected, got) -> str | None:
    if not isinstance(got, dict) or "parameter dtypes" not in got:
        return None
    precision = case.args[0]
    if got["parameter dtypes"] != ["torch.float32"]:
        return _("the module's parameters are now {dtypes}: its fp32 weights are the masters "
                 "the optimizer updates, and they stay float32 while the computation runs "
                 "in lower precision",
                 dtypes=", ".join(got["parameter dtypes"]))
    if got["output dtype"] != "torch.float32":
        return _("the output is {dtype}: the loss and the next stage must get float32",
                 dtype=got["output dtype"])
    with torch.random.fork_rng(devices=[]):
        plain = ex.precision_model()(ex.precision_input()).detach()
    out = got.get("output")
    if precision == "fp32" and isinstance(out, torch.Tensor) and not torch.equal(out, plain):
        return _("'fp32' must run the module as it is: its output was rounded to a lower "
                 "precision on the way")
    if precision != "fp32" and isinstance(out, torch.Tensor) and torch.equal(out, plain):
        return _("the output is exactly the fp32 computation: the matmuls did not run in "
                 "{precision}", precision=precision)
    if precision != "fp32" and isinstance(out, torch.Tensor):
        other = "bf16" if precision == "fp16" else "fp16"
        if _close(out, precision_forward(other)["output"], 1e-6):
            return _("the output is {other}'s, not {precision}'s", other=other,
                     precision=precision)
    return None


# --- lesson11.update_scale ---------------------------------------------------------------------

def update_scale(overflows: str, growth_interval: int) -> dict:
    scale, tracker, seen = 1024.0, 0, []
    for flag in overflows:
        if flag == "x":
            scale, tracker = scale / 2, 0
        elif tracker + 1 == growth_interval:
            scale, tracker = scale * 2, 0
        else:
            tracker += 1
        seen.append((scale, tracker))
    return {"after each step": seen}


def explain_update_scale(case, rank, expected, got) -> str | None:
    overflows, interval = case.args
    steps = got.get("after each step") if isinstance(got, dict) else None
    if not isinstance(steps, list) or len(steps) != len(overflows):
        return None
    prev = (1024.0, 0)
    for i, (flag, want, have) in enumerate(zip(overflows, expected["after each step"], steps)):
        if tuple(have) == tuple(want):
            prev = want
            continue
        scale, tracker = have
        if flag == "x":
            if scale != prev[0] / 2:
                return _("step {i} overflowed: the scale times backoff_factor, {want:g}, got "
                         "{got:g}", i=i, want=prev[0] / 2, got=scale)
            return _("step {i} overflowed: the count of clean steps restarts at 0, got {got}",
                     i=i, got=tracker)
        if scale > prev[0]:
            return _("the scale grew at step {i} after {n} clean steps in a row; it grows "
                     "after {interval} of them", i=i, n=prev[1] + 1, interval=interval)
        if want[0] > prev[0]:
            return _("step {i} makes {interval} clean steps in a row: the scale grows (times "
                     "growth_factor) and the count restarts at 0", i=i, interval=interval)
        return _("after step {i} (clean) the count of clean steps in a row is {want}, got "
                 "{got}", i=i, want=want[1], got=tracker)
    return None
