"""Lesson 11's expected values and explanations (judge side: see this package's docstring), one
module per part: `layout_precision` (11a), `step` and `clipping` (11b) and `learn_build_buy`
(11c), what they share in `common`. The names here are those the declarations give as "lesson11:function".

The expected values come from brute force over the rank grid, from one process training the
capstone's GPT with plain PyTorch (`torch.autocast`, `torch.optim.SGD`), and from the lesson's
formulas written out here, never from `course_lib.layout`, `course_lib.precision`,
`course_lib.train` or `course_lib.planning`, the modules being built.

Components (course_lib.gpt, course_lib.run, ...) are imported inside the functions that use
them, on purpose: the learner's overlay decides at each call which version runs (theirs or the
reference), and a name bound at import time would keep the first one.
"""

from course_lib.course.grading.references.lesson11.common import DTYPES
from course_lib.course.grading.references.lesson11.layout_precision import (
    AXES, explain_layout_groups, explain_precision_forward, explain_stage_layers,
    explain_update_scale, layout_groups, precision_forward, stage_layers, update_scale)
from course_lib.course.grading.references.lesson11.step import (
    VARIANTS, explain_reduce_grads, explain_train_step, explain_unscale_grads, reduce_grads,
    train_step, unscale_grads)
from course_lib.course.grading.references.lesson11.clipping import (
    explain_total_norm, total_norm)
from course_lib.course.grading.references.lesson11.learn_build_buy import (
    BYTES_PER_PARAM, STACKS, G, explain_plan, explain_step_cost, plan, step_cost)

__all__ = ["DTYPES", "AXES", "layout_groups", "explain_layout_groups", "stage_layers",
           "explain_stage_layers", "precision_forward", "explain_precision_forward",
           "update_scale", "explain_update_scale", "reduce_grads", "explain_reduce_grads",
           "unscale_grads", "explain_unscale_grads", "VARIANTS", "train_step",
           "explain_train_step", "total_norm", "explain_total_norm", "G", "STACKS",
           "BYTES_PER_PARAM", "step_cost",
           "explain_step_cost", "plan", "explain_plan"]
