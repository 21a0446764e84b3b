"""Exercise checks for learners and batch grading for instructors, one file per role.

- `catalogue`: declaring exercises (`Exercise`, `case`, `register`); each lesson registers its
  own in `exercises/lessonNN.py`, so a notebook cannot change them.
- `learner`: the learner's check cell, `check("lesson00.shard_sum", shard_sum, cluster=c)`,
  and `grade_function`, the same check returning a `Result` (tests use it).
- `report`: a check's `Result`, its per-case, per-rank `Row`s and their `Outcome`.
- `compare`: how a value is compared with the expected one.
- `batch` and `cli`: the instructor's `course-grade`; `kernel`: what it runs inside each
  submission's kernel.
"""

from course_lib.grading.catalogue import (RANK, WORLD_SIZE, Case, CheckTimeout, Exercise, case,
                                         exercises_for, get_exercise, lessons, register)
from course_lib.grading.learner import check, grade_function
from course_lib.grading.report import CaseResult, Outcome, Result, Row

__all__ = ["RANK", "WORLD_SIZE", "Case", "CaseResult", "CheckTimeout", "Exercise", "Outcome",
           "Result", "Row", "case", "check", "exercises_for", "get_exercise", "grade_function",
           "lessons", "register"]
