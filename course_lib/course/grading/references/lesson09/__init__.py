"""Lesson 09's expected values and explanations (judge side: see this package's docstring), one
module per module of the lesson's declarations: `saving` and `loading` (09a), `recovery` (09b).
The names here are those the declarations give as "lesson09:function".

Components (course_lib.ddp, ...) are imported inside the functions that use them, on
purpose: the learner's overlay decides at each call which version runs (theirs or the
reference), and a name bound at import time would keep the first one.
"""

from course_lib.course.grading.references.lesson09.saving import (DURABLE, explain_save,
                                                                 explain_write_atomic, save,
                                                                 write_atomic)
from course_lib.course.grading.references.lesson09.loading import (explain_load,
                                                                  explain_read_plan, load,
                                                                  read_plan)
from course_lib.course.grading.references.lesson09.recovery import (
    accumulation_steps, checkpoints, explain_accumulation_steps, explain_checkpoints,
    explain_run_state, explain_standing, run_state, standing)

__all__ = ["DURABLE", "write_atomic", "explain_write_atomic", "save", "explain_save",
           "read_plan", "explain_read_plan", "load", "explain_load", "standing",
           "explain_standing", "run_state", "explain_run_state", "accumulation_steps",
           "explain_accumulation_steps", "checkpoints", "explain_checkpoints"]
