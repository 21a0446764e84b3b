"""Exercise checks for learners and batch grading for instructors.

A lesson declares its exercises once, in `course_lib/grading/exercises/lessonNN.py`; the
learner's check cell `check("lesson00.shard_sum", shard_sum, cluster=c)` and the instructor's
`course-grade` both run those declarations, never code from the notebook being checked.
"""

from course_lib.grading.exercise import (RANK, WORLD_SIZE, Case, Exercise, case, exercises_for,
                                         get_exercise, lessons, register)
from course_lib.grading.report import CaseResult, Result, Row
from course_lib.grading.runner import check, grade_function

__all__ = ["RANK", "WORLD_SIZE", "Case", "CaseResult", "Exercise", "Result", "Row", "case",
           "check", "exercises_for", "get_exercise", "grade_function", "lessons", "register"]
