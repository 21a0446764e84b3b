"""Lesson 11a's checks (layout and precision): the layout's groups, a pipeline stage's layers,
where mixed precision casts, and fp16's loss-scale rule, each checked in the grading process.
Expected values and explanations:
`course_lib/course/grading/references/lesson11/layout_precision.py`.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from course_lib.course.grading import Exercise, case, register
from course_lib.course.grading.exercises.lesson11.common import PART_A


# --- 11a: lesson11.layout_groups ---------------------------------------------------------------

GROUP_AXES = ("pp", "dp", "cp", "tp")  # the layout's axes, outermost to innermost


def groups_harness(fn, dp: int, tp: int, pp: int, cp: int) -> dict:
    got = fn(dp, tp, pp, cp)
    if not isinstance(got, dict) or set(got) != set(GROUP_AXES):
        return {"groups": f"a dict with keys {sorted(GROUP_AXES)} expected, got {got!r}"[:300]}
    return {"groups": {a: [[int(r) for r in g] for g in got[a]] for a in GROUP_AXES}}


register(Exercise(
    name="lesson11.layout_groups",
    notebook=PART_A,
    params=("dp", "tp", "pp", "cp"),
    cases=[
        case(4, 1, 1, 1, label="(4,1,1): data parallel only"),
        case(2, 2, 1, 1, label="(2,2,1)"),
        case(2, 1, 2, 1, label="(2,1,2)"),
        case(1, 2, 2, 1, label="(1,2,2)"),
        case(2, 2, 2, 1, label="(2,2,2): 8 ranks"),
        case(3, 2, 1, 1, label="(3,2,1): 6 ranks, dp not a power of two"),
        case(1, 3, 2, 1, label="(1,3,2): tp of 3"),
        case(2, 3, 2, 1, label="(2,3,2): 12 ranks"),
        case(1, 1, 3, 1, label="(1,1,3): pipeline only"),
        case(1, 1, 1, 4, label="(1,1,1), cp=4: context parallel only"),
        case(2, 1, 1, 2, label="(2,1,1), cp=2"),
        case(1, 2, 1, 2, label="(1,2,1), cp=2"),
        case(2, 2, 2, 2, label="(2,2,2), cp=2: 16 ranks"),
        case(1, 2, 2, 3, label="(1,2,2), cp=3: 12 ranks"),
    ],
    reference="lesson11:layout_groups",
    explain="lesson11:explain_layout_groups",
    harness=groups_harness,
    points=2,
    hints=("Each rank has a coordinate on each of the four axes, and the ranks are counted with "
           "the tp coordinate changing fastest, then cp, then dp, then pp. A group of one axis is "
           "the ranks whose other three coordinates are equal.",
           "Picture the ranks as pp tables, one per stage, each of dp rows; each row holds cp "
           "blocks of tp cells, filled cell by cell, row by row and table after table: a tp "
           "group is one block, a cp group the same cell of every block of a row, a dp group the "
           "same cell of every row of a table, a pp group the same cell of every table. List "
           "each in the order of its own coordinate."),
))


# --- 11a: lesson11.stage_layers ----------------------------------------------------------------

class _Named(nn.Module):
    """A stand-in layer: a name and one parameter (whose identity the check follows)."""

    def __init__(self, name: str):
        super().__init__()
        self.name = name
        self.weight = nn.Parameter(torch.zeros(1))

    def extra_repr(self) -> str:
        return self.name


def stand_in_model(n_blocks: int) -> nn.Sequential:
    return nn.Sequential(_Named("embedding"), *(_Named(f"block {i}") for i in range(n_blocks)),
                         _Named("head"))


def stage_harness(fn, n_blocks: int, pp: int, pp_rank: int) -> dict:
    model = stand_in_model(n_blocks)
    got = fn(model, pp, pp_rank)
    if not isinstance(got, nn.Sequential):
        return {"layers": f"an nn.Sequential expected, got {type(got).__name__}"}
    own = {id(m) for m in model}
    return {"layers": [getattr(m, "name", type(m).__name__) for m in got],
            "the model's own modules": all(id(m) in own for m in got)}


register(Exercise(
    name="lesson11.stage_layers",
    notebook=PART_A,
    params=("model", "pp", "pp_rank"),
    cases=[
        case(4, 1, 0, label="4 blocks, pp=1: one stage holds all"),
        case(4, 2, 0, label="4 blocks, pp=2, the first stage"),
        case(4, 2, 1, label="4 blocks, pp=2, the last stage"),
        case(6, 3, 1, label="6 blocks, pp=3, the middle stage"),
        case(6, 3, 2, label="6 blocks, pp=3, the last stage"),
        case(8, 4, 0, label="8 blocks, pp=4, the first stage"),
        case(8, 4, 2, label="8 blocks, pp=4, stage 2"),
    ],
    reference="lesson11:stage_layers",
    explain="lesson11:explain_stage_layers",
    harness=stage_harness,
    points=2,
    hints=("A stage is a contiguous run of the blocks, the same number on every stage, in the "
           "model's order; the first stage also begins with the embedding and the last also ends "
           "with the head. With one stage, it is both.",
           "Picture 6 blocks on 3 stages: [embedding, blocks 0-1], [blocks 2-3], [blocks 4-5, "
           "head]. Keep the modules themselves, not copies: the stage must train the model's "
           "own parameters."),
))


# --- 11a: lesson11.precision_forward -----------------------------------------------------------


def precision_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(12, 32), nn.GELU(), nn.Linear(32, 5))


def precision_input() -> torch.Tensor:
    return torch.linspace(-2, 2, 7 * 12).reshape(7, 12)


def precision_report(model: nn.Module, out: Any) -> dict:
    if not isinstance(out, torch.Tensor):
        return {"output": f"a tensor expected, got {type(out).__name__}"}
    out.float().square().mean().backward()
    return {"output": out.detach().float(), "output dtype": str(out.dtype),
            "parameter dtypes": sorted({str(p.dtype) for p in model.parameters()}),
            "gradient dtypes": sorted({str(p.grad.dtype) for p in model.parameters()
                                       if p.grad is not None})}


def precision_harness(fn, precision: str) -> dict:
    with torch.random.fork_rng(devices=[]):
        model = precision_model()
    return precision_report(model, fn(model, (precision_input(),), precision))


register(Exercise(
    name="lesson11.precision_forward",
    notebook=PART_A,
    params=("module", "args", "precision"),
    cases=[case("bf16", label="bf16"), case("fp16", label="fp16"),
           case("fp32", label="fp32: the module as it is")],
    reference="lesson11:precision_forward",
    explain="lesson11:explain_precision_forward",
    harness=precision_harness,
    rtol=1e-6,
    points=2,
    hints=("Two invariants: the module's parameters stay fp32 (they are the masters the "
           "optimizer updates, with fp32 gradients), and what comes out is fp32; in between, "
           "each matmul runs in the lower precision.",
           "The rules above the exercise name the tool that casts each op's inputs as it runs, "
           "for the span of a with-block: run the module inside it for bf16 and fp16, then "
           "convert what comes out. For fp32 there is nothing to do."),
))


# --- 11a: lesson11.update_scale ----------------------------------------------------------------

def scale_harness(fn, overflows: str, growth_interval: int) -> dict:
    """The (scale, tracker) after each step of a run whose overflows are the 'x's."""
    scale, tracker, seen = 1024.0, 0, []
    for flag in overflows:
        scale, tracker = fn(scale, tracker, flag == "x", growth_interval=growth_interval)
        seen.append((float(scale), int(tracker)))
    return {"after each step": seen}


register(Exercise(
    name="lesson11.update_scale",
    notebook=PART_A,
    params=("scale", "growth_tracker", "found_inf"),
    cases=[
        case("....", 2, label="clean steps: grow every 2"),
        case(".x...", 3, label="an overflow restarts the count"),
        case("xx.x", 2, label="overflows in a row keep shrinking"),
        case("......", 1, label="growth_interval 1: grow every clean step"),
        case("..x..x...", 4, label="never 4 clean steps in a row"),
    ],
    reference="lesson11:update_scale",
    explain="lesson11:explain_update_scale",
    harness=scale_harness,
    points=1,
    hints=("The scale is the largest power of two that has not overflowed lately: every "
           "overflow shrinks it at once, growth_interval clean steps in a row grow it, and any "
           "change of the scale starts the count of clean steps again.",
           "Follow the lesson's table one step at a time: first what an overflow does to both "
           "numbers; otherwise count the clean step, and only then ask whether the count has "
           "just reached the interval."),
))
