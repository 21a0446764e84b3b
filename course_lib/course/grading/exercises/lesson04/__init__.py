"""Lesson 04 (data parallel), in two parts, one module each. `data_parallel` (04a): identical
starting weights, averaging gradients per parameter and in one flat buffer, buckets and their
launch order. `ddp` (04b): the DDP core (the bucket launch, the hook, the end of backward)
trained on 2, 3 and 4 ranks, with a weight used twice in the forward and a gradient that arrives
twice in one backward. Importing this package registers them, 04a first.

Expected values and the reasons for wrong ones are judge-side (course_lib.course.grading.references.
lesson04); here are the cases and the harnesses, which run on the engines.

Components (course_lib.ddp, ...) are imported inside the functions that use them, on
purpose: the learner's overlay decides at each call which version runs (theirs or the
reference), and a name bound at import time would keep the first one.
"""

from course_lib.course.grading.exercises.lesson04.data_parallel import (
    PART_A, allreduce_harness, buckets_harness, coalesced_harness, grad_of, launch_harness,
    state_of)
from course_lib.course.grading.exercises.lesson04.ddp import (CAP_MB, FIRST_GRAD, PART_B,
                                                             SPARE_GRADS, TWICE_CAP_MB,
                                                             TWICE_EARLY, TWICE_RAISED, Net,
                                                             batch, ddp_harness)

__all__ = ["PART_A", "PART_B", "grad_of", "state_of", "coalesced_harness", "allreduce_harness",
           "buckets_harness", "launch_harness", "CAP_MB", "TWICE_CAP_MB", "Net", "batch",
           "FIRST_GRAD", "SPARE_GRADS", "TWICE_RAISED", "TWICE_EARLY", "ddp_harness"]
