"""Lesson 07 (pipeline parallel), in four parts, one module each. `pipeline_split` (07a): the
bubble of a timeline, balanced stages, micro-batches through the stages in one process.
`pipeline_messages` (07b): a stage's messages (header + tensor) on a stage per rank (2, 3 and 4
of them). `pipeline_schedules` (07c): the executor's forward and backward actions, and the
schedule orders. Importing this package registers them, in that order. Expected values and
explanations: `course_lib/course/grading/references/lesson07.py`.

Components (course_lib.ddp, ...) are imported inside the functions that use them, on
purpose: the learner's overlay decides at each call which version runs (theirs or the
reference), and a name bound at import time would keep the first one.
"""

from course_lib.course.grading.exercises.lesson07.pipeline_split import (
    PART_A, VALID, bubble_harness, model_and_batch, partition_harness, pipeline_harness)
from course_lib.course.grading.exercises.lesson07.pipeline_messages import (
    LINK_CASES, PART_B, describe, link_value, links_harness)
from course_lib.course.grading.exercises.lesson07.pipeline_schedules import (
    EXECUTOR_CASES, MICROBATCH, ORDER_CASES, PART_C, executor_harness, order_harness)
from course_lib.course.grading.exercises.lesson07.pipeline_beyond import (
    CONFLICT_CASES, INTERLEAVED_CASES, PART_D, SPLIT_CASES, pair_of, split_body)

__all__ = ["PART_A", "PART_B", "PART_C", "VALID", "bubble_harness", "partition_harness",
           "model_and_batch", "pipeline_harness", "link_value", "describe", "links_harness",
           "LINK_CASES", "MICROBATCH", "executor_harness", "EXECUTOR_CASES", "order_harness",
           "ORDER_CASES", "PART_D", "INTERLEAVED_CASES", "SPLIT_CASES", "CONFLICT_CASES",
           "pair_of", "split_body"]
