"""Lesson 08's expected values and explanations (judge side: see this package's docstring), one
module per part: `zero` (08a) and `fsdp` (08b), what both use in `common`. The names here are
those the declarations give as "lesson08:function".

The expected values of the two training checks come from one process: the gradient path's from
plain PyTorch on the whole batch and the launch order its buckets allow; the FSDP hooks' from
the packaged `fully_shard` itself, run in a world of one rank (`_Solo`: no communication), since
which units hold their parameters when a layer computes does not depend on the world's size.

Components (course_lib.ddp, ...) are imported inside the functions that use them, on
purpose: the learner's overlay decides at each call which version runs (theirs or the
reference), and a name bound at import time would keep the first one.
"""

from course_lib.course.grading.references.lesson08.zero import (
    all_gather_params, explain_all_gather_params, explain_gradient_path,
    explain_reduce_scatter_grads, explain_shard_range, explain_zero1_step, reduce_scatter_grads,
    shard_range, zero1_step, zero_gradient_path)
from course_lib.course.grading.references.lesson08.fsdp import (
    explain_hooks, explain_next_unit, explain_reduce_unit_grad, explain_settle, explain_unshard,
    fsdp_hooks, next_unit, reduce_unit_grad, settle, unshard)

__all__ = ["shard_range", "explain_shard_range", "reduce_scatter_grads",
           "explain_reduce_scatter_grads", "all_gather_params", "explain_all_gather_params",
           "zero1_step", "explain_zero1_step", "zero_gradient_path", "explain_gradient_path",
           "unshard", "explain_unshard", "reduce_unit_grad", "explain_reduce_unit_grad", "settle",
           "explain_settle", "next_unit", "explain_next_unit", "fsdp_hooks", "explain_hooks"]
