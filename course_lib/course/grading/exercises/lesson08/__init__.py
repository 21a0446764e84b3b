"""Lesson 08 (ZeRO and FSDP), in two parts, one module each.

- `zero` (08a): padded shard bounds, a gradient's reduce-scatter, the parameters' all-gather,
  the ZeRO-1 step, and the gradient path of ZeRO-1/2 (`on_grad_ready`, `finish_backward`),
  checked by training the library's `ZeroRedundancyOptimizer` with the learner's function in
  its place;
- `fsdp` (08b): the FSDP unit's gather, its post-backward reduction, `settle`, the prefetch order
  and the unit's hooks (`pre_forward`, `post_forward`, `pre_backward`), the hooks checked by
  training the library's `fully_shard` with the learner's hook in its place;
- `common`: the parts' notebooks, lesson 08's defaults for an exercise on sub-worlds, and what
  both parts' harnesses use.

Importing this package registers them, 08a first. Distributed checks run on the first 2, 3 and
4 ranks of the grader's 4-rank cluster through a counting `dist` whose async reduce-scatters
land only at `wait()`. Expected values and the explanations of wrong ones are judge-side:
`course_lib/course/grading/references/lesson08/`.

Components (course_lib.ddp, ...) are imported inside the functions that use them, on
purpose: the learner's overlay decides at each call which version runs (theirs or the
reference), and a name bound at import time would keep the first one.
"""

from course_lib.course.grading.exercises.lesson08.common import A, B, register_on_sub_worlds
from course_lib.course.grading.exercises.lesson08.zero import (ZeroNet, ag_harness, rs_harness,
                                                              shard_range_harness, zero1_harness,
                                                              zero_batch, zero_harness)
from course_lib.course.grading.exercises.lesson08.fsdp import (UnitNet, hooks_body, hooks_harness,
                                                              reduce_harness, settle_harness,
                                                              unshard_harness)

__all__ = ["A", "B", "register_on_sub_worlds", "shard_range_harness", "rs_harness",
           "ag_harness", "zero1_harness", "ZeroNet", "zero_batch", "zero_harness",
           "unshard_harness", "reduce_harness", "settle_harness", "UnitNet", "hooks_body",
           "hooks_harness"]
