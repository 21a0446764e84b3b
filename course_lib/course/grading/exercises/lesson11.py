"""Lesson 11 (the capstone): the layout's groups from (dp, tp, pp), where the casts of mixed
precision go, and the dynamic loss scaler's rule. None of them communicates: each is checked in
the grading process on layouts of 2 to 12 ranks, on a small model, on sequences of overflows."""

from __future__ import annotations

import itertools

import torch
from torch import nn

from course_lib.course.grading import Exercise, case, register

# --- lesson11.layout_groups --------------------------------------------------------------------

AXES = ("pp", "dp", "tp")


def _groups_reference(dp: int, tp: int, pp: int) -> dict:
    """Brute force from the rank formula rank = (pp_rank * dp + dp_rank) * tp + tp_rank: two
    ranks share an axis's group when every other coordinate is equal."""
    coords = {(p * dp + d) * tp + t: {"pp": p, "dp": d, "tp": t}
              for p, d, t in itertools.product(range(pp), range(dp), range(tp))}
    out = {}
    for axis in AXES:
        groups: dict[tuple, list[int]] = {}
        for rank in sorted(coords):
            key = tuple(coords[rank][a] for a in AXES if a != axis)
            groups.setdefault(key, []).append(rank)
        out[axis] = sorted((sorted(g, key=lambda r: coords[r][axis]) for g in groups.values()),
                           key=lambda g: g[0])
    return {"groups": out}


def groups_harness(fn, dp: int, tp: int, pp: int) -> dict:
    got = fn(dp, tp, pp)
    if not isinstance(got, dict) or set(got) != set(AXES):
        return {"groups": f"a dict with keys {sorted(AXES)} expected, got {got!r}"[:300]}
    return {"groups": {a: [[int(r) for r in g] for g in got[a]] for a in AXES}}


register(Exercise(
    name="lesson11.layout_groups",
    notebook="11_capstone",
    params=("dp", "tp", "pp"),
    cases=[
        case(4, 1, 1, label="(4,1,1): data parallel only"),
        case(2, 2, 1, label="(2,2,1)"),
        case(2, 1, 2, label="(2,1,2)"),
        case(1, 2, 2, label="(1,2,2)"),
        case(2, 2, 2, label="(2,2,2): 8 ranks"),
        case(3, 2, 1, label="(3,2,1): 6 ranks, dp not a power of two"),
        case(1, 3, 2, label="(1,3,2): tp of 3"),
        case(2, 3, 2, label="(2,3,2): 12 ranks"),
        case(1, 1, 3, label="(1,1,3): pipeline only"),
    ],
    reference=_groups_reference,
    harness=groups_harness,
    points=2,
    hints=("rank = (pp_rank * dp + dp_rank) * tp + tp_rank: a tp group is tp consecutive ranks; "
          "a dp group keeps pp_rank and tp_rank fixed (stride tp, inside one stage); a pp group "
          "keeps dp_rank and tp_rank fixed (stride dp * tp). Order each group by its coordinate "
          "and the groups by their first rank.",),
))


# --- lesson11.precision_forward ---------------------------------------------------------------


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(12, 32), nn.GELU(), nn.Linear(32, 5))


def _report(model: nn.Module, out: torch.Tensor) -> dict:
    if not isinstance(out, torch.Tensor):
        return {"output": f"a tensor expected, got {type(out).__name__}"}
    out.float().square().mean().backward()
    return {"output": out.detach().float(), "output dtype": str(out.dtype),
            "parameter dtypes": sorted({str(p.dtype) for p in model.parameters()}),
            "gradient dtypes": sorted({str(p.grad.dtype) for p in model.parameters()
                                       if p.grad is not None})}


def precision_harness(fn, precision: str) -> dict:
    model = _model()
    x = torch.linspace(-2, 2, 7 * 12).reshape(7, 12)
    return _report(model, fn(model, (x,), precision))


def _precision_reference(precision: str) -> dict:
    model = _model()
    x = torch.linspace(-2, 2, 7 * 12).reshape(7, 12)
    dtype = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}[precision]
    if dtype is None:
        return _report(model, model(x))
    with torch.autocast("cpu", dtype=dtype):
        out = model(x)
    return _report(model, out.float())


register(Exercise(
    name="lesson11.precision_forward",
    notebook="11_capstone",
    params=("module", "args", "precision"),
    cases=[case("bf16", label="bf16"), case("fp16", label="fp16"),
           case("fp32", label="fp32: no autocast at all")],
    reference=_precision_reference,
    harness=precision_harness,
    rtol=1e-6,
    points=2,
    hints=("Run the module under torch.autocast('cpu', dtype=...) for bf16 and fp16 and return "
          "its output as float32; never cast the module itself (its fp32 weights are the "
          "masters the optimizer updates). fp32 runs the module as it is.",),
))


# --- lesson11.update_scale ---------------------------------------------------------------------


def scale_harness(fn, overflows: str, growth_interval: int) -> dict:
    """The (scale, tracker) after each step of a run whose overflows are the 'x's."""
    scale, tracker, seen = 1024.0, 0, []
    for flag in overflows:
        scale, tracker = fn(scale, tracker, flag == "x", growth_interval=growth_interval)
        seen.append((float(scale), int(tracker)))
    return {"after each step": seen}


def _scale_reference(overflows: str, growth_interval: int) -> dict:
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


register(Exercise(
    name="lesson11.update_scale",
    notebook="11_capstone",
    params=("scale", "growth_tracker", "found_inf"),
    cases=[
        case("....", 2, label="clean steps: grow every 2"),
        case(".x...", 3, label="an overflow restarts the count"),
        case("xx.x", 2, label="overflows in a row keep shrinking"),
        case("......", 1, label="growth_interval 1: grow every clean step"),
        case("..x..x...", 4, label="never 4 clean steps in a row"),
    ],
    reference=_scale_reference,
    harness=scale_harness,
    points=1,
    hints=("On an overflow: scale * backoff_factor and the tracker back to 0 (the step is "
          "skipped). Otherwise count the clean step; when the count reaches growth_interval, "
          "scale * growth_factor and the count back to 0.",),
))
