"""Lesson 11b's clipping check, `lesson11.total_norm`: the whole model's gradient norm on stand-in
layouts of 2, 3 and 4 ranks, each rank holding its pieces of one model's gradients (tp shards of
the matrices, the biases whole on every tp rank, a stage's own layers, ZeRO's flat shards with
their padding filled with values that are not the model's), with the groups each rank reduced
over recorded. Expected values and explanations:
`course_lib/course/grading/references/lesson11/clipping.py`.

`course_lib.clip_norm.Held` is imported inside the harness on purpose: the learner's overlay
decides which version runs.
"""

from __future__ import annotations

import math

import torch

from course_lib.course.grading import RANK, WORLD_SIZE, case
from course_lib.course.grading.exercises.lesson11.common import PART_B
from course_lib.course.grading.exercises.lesson11.step import (
    LabelledDist, StandInLayout, coordinates, labels_of, on_labelled_ranks)
from course_lib.course.grading.sub_worlds import register_on_sub_worlds

PAD = 5.0  # what a flat shard's padding holds: not an element of the model
ROWS, COLS = 8, 3


def stage_grads(stage: int, pp: int) -> dict[str, torch.Tensor]:
    """One process's gradients of stage `stage`'s layers: a matrix and a bias (none on the
    middle stage of three: a layer without parameters)."""
    if pp == 3 and stage == 1:
        return {}
    g = torch.Generator().manual_seed(11 + stage)
    return {f"w{stage}": torch.randn(ROWS, COLS, generator=g, dtype=torch.float64),
            f"b{stage}": torch.randn(COLS, generator=g, dtype=torch.float64)}


def _shard(flat: torch.Tensor, d: int, n: int) -> tuple[torch.Tensor, int]:
    """Rank d's shard of a flat gradient padded to n equal shards, and its real elements."""
    size = math.ceil(flat.numel() / n)
    padded = torch.cat([flat, torch.full((size * n - flat.numel(),), PAD, dtype=flat.dtype)])
    return padded[d * size:(d + 1) * size].clone(), max(0, min(size, flat.numel() - d * size))


def held_by(coords: dict[str, int], dp: int, tp: int, pp: int,
            zero: bool) -> list[tuple[torch.Tensor, int, bool]]:
    """(grad, numel, counted) of what the rank at `coords` holds: its tp rows of each matrix,
    each bias whole (counted by tp rank 0 only); with ZeRO, its dp shard of each flat buffer."""
    out = []
    for name, g in stage_grads(coords["pp"], pp).items():
        mine = g.chunk(tp, dim=0)[coords["tp"]] if name.startswith("w") else g
        counted = name.startswith("w") or coords["tp"] == 0
        if zero:
            out.append((*_shard(mine.reshape(-1), coords["dp"], dp), counted))
        else:
            out.append((mine.clone(), mine.numel(), counted))
    return out


def axes_of(dp: int, tp: int, pp: int, zero: bool) -> list[str]:
    """The groups the gradient is split over, in the order they are passed."""
    return [a for a, n in (("tp", tp), ("pp", pp), ("dp", dp if zero else 1)) if n > 1]


def _norm_body(dist: LabelledDist, rank: int, fn, dp: int, tp: int, pp: int, zero: bool,
               p: float) -> dict:
    from course_lib.clip_norm import Held

    layout = StandInLayout(rank, dp, tp, pp, dist.pool)
    dist.labels = labels_of(layout, None)
    held = [Held(*h) for h in held_by(coordinates(rank, dp, tp), dp, tp, pp, zero)]
    got = fn(held, p, [layout.group(a) for a in axes_of(dp, tp, pp, zero)], dist)
    norm = float(got) if isinstance(got, torch.Tensor) and got.numel() == 1 else repr(got)[:80]
    return {"comm": dist.comm(), "norm": norm}


def norm_harness(fn, rank: int, world_size: int, k: int, dp: int, tp: int, pp: int,
                 zero: bool, p: float) -> dict | None:
    return on_labelled_ranks(k, _norm_body, fn, dp, tp, pp, zero, p)


def _norm_case(k: int, dp: int, tp: int, pp: int, zero: bool, p: float, *, label: str):
    return case(RANK, WORLD_SIZE, k, dp, tp, pp, zero, p, label=label)


register_on_sub_worlds(
    "lesson11.total_norm", PART_B,
    params=("held", "norm_type", "groups", "dist"),
    cases=[
        _norm_case(2, 2, 1, 1, True, 2.0, label="2 ranks, ZeRO over dp = 2, p = 2"),
        _norm_case(2, 1, 2, 1, False, math.inf, label="2 ranks, tp = 2, p = inf"),
        _norm_case(3, 1, 1, 3, False, 2.0, label="3 stages (the middle one empty), p = 2"),
        _norm_case(3, 3, 1, 1, True, 3.0, label="3 ranks, ZeRO over dp = 3, p = 3"),
        _norm_case(4, 2, 2, 1, False, 2.0, label="4 ranks, (dp, tp, pp) = (2, 2, 1), DDP, p = 2"),
        _norm_case(4, 1, 2, 2, False, math.inf, label="4 ranks, (1, 2, 2), p = inf"),
        _norm_case(4, 2, 1, 2, True, 1.0, label="4 ranks, (2, 1, 2), ZeRO, p = 1"),
    ],
    reference="lesson11:total_norm",
    explain="lesson11:explain_total_norm",
    harness=norm_harness,
    points=2,
    rtol=1e-9,
    time_limit=20.0,
    hints=("One process's norm is one sum (or one maximum) over every element of the model, "
           "each counted exactly once: every rank contributes the elements only it counts, and "
           "the ranks that split the model out combine their contributions.",
           "Picture a 2 x 2 grid of ranks, tp across, pp down: first each row combines what "
           "its tp ranks hold, then each column combines the rows. Copies and padding add "
           "nothing; for inf the combination is a maximum, at every level, and the p-th root "
           "comes once, at the end."),
)
