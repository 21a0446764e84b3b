"""Lesson 11 (the capstone), in three parts, one module each.

- `layout_precision` (11a): the layout's groups, a pipeline stage's layers, where mixed
  precision casts, fp16's loss-scale rule (checked in the grading process);
- `step` (11b): the training step's gradient reductions, the loss scaler's unscale and skip, and
  the whole step, on 2, 3 and 4 ranks, with every collective counted by the group it ran on
  (`LabelledDist`, the pool of groups and the stand-in layout they share);
- `clipping` (11b): the whole model's gradient norm from each rank's pieces;
- `learn_build_buy` (11c): a job's memory, communication and time per step, and the layout and
  stack chosen for it;
- `common`: the parts' notebooks and the layout's axes.

Importing this package registers them, 11a first. Expected values and the explanations of wrong
ones are judge-side, in `course_lib/course/grading/references/lesson11/`: one-process PyTorch and
the lesson's formulas, never the package's own answers.

Components (course_lib.run, course_lib.backend, ...) are imported inside the functions that use
them, on purpose: the learner's overlay decides at each call which version runs (theirs or the
reference), and a name bound at import time would keep the first one.
"""

from course_lib.course.grading.exercises.lesson11.common import AXES, PART_A, PART_B, PART_C
from course_lib.course.grading.exercises.lesson11.layout_precision import (
    groups_harness, precision_harness, precision_input, precision_model, precision_report,
    scale_harness, stage_harness, stand_in_model)
from course_lib.course.grading.exercises.lesson11.step import (
    STEP_MODEL, LabelledDist, StandInLayout, all_subsets, coordinates, grad_value, group_pool,
    labels_of, rank_params, reduce_harness, step_config, step_harness, unscale_harness)
from course_lib.course.grading.exercises.lesson11.clipping import norm_harness
from course_lib.course.grading.exercises.lesson11.learn_build_buy import (
    A100, G, H100, SCENARIOS, SMALL_GPU, as_scenario, cost_harness, plan_harness, scenario,
    scenarios)

__all__ = ["PART_A", "PART_B", "PART_C", "AXES", "groups_harness", "stand_in_model",
           "stage_harness", "precision_model", "precision_input", "precision_report",
           "precision_harness", "scale_harness", "all_subsets", "group_pool", "LabelledDist",
           "coordinates", "StandInLayout", "labels_of", "grad_value", "rank_params",
           "reduce_harness", "unscale_harness", "STEP_MODEL", "step_config", "step_harness",
           "norm_harness", "G",
           "A100", "H100", "SMALL_GPU", "scenario", "SCENARIOS", "as_scenario", "scenarios",
           "cost_harness", "plan_harness"]
