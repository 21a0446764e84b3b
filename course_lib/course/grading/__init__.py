"""Exercise checks for learners and batch grading for instructors, one file per role.

- `catalogue`: declaring exercises (`Exercise`, `case`, `register`); each lesson registers its
  own in `exercises/lessonNN.py` (or a package, `exercises/lessonNN/`), so a notebook cannot
  change them; `references/lessonNN.py` (or `references/lessonNN/`) holds the judge's side
  (expected values, explanations).
- `learner`: the learner's check cell, `check("lesson00.shard_sum", shard_sum, cluster=c)`
  (also `course_lib.course.check`), and `grade_function`, the same check returning a `Result`.
- `judge`: expected values, comparison, points and reasons, where the judge runs.
- `report`: a check's `Result`, its per-case, per-rank `Row`s and their `Outcome`.
- `compare`: how a value is compared with the expected one; `plain`: values as JSON data.
- `batch` (with `kernel_session` and `grades`), `cli`, `sandbox`, `containment`, `kernel`,
  `rebuild`: the instructor's `course-grade`.

This package's own namespace holds only the declarations, so that the lessons' exercise files
import it without the checking machinery above them.
"""

from course_lib.course.catalogue import (RANK, WORLD_SIZE, Case, CheckTimeout, Exercise,
                                                case, exercises_for, get_exercise, lessons,
                                                register)
from course_lib.course.grading.report import CaseResult, Outcome, Result, Row

__all__ = ["RANK", "WORLD_SIZE", "Case", "CaseResult", "CheckTimeout", "Exercise", "Outcome",
           "Result", "Row", "case", "exercises_for", "get_exercise", "lessons", "register"]
