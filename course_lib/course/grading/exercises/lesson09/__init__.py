"""Lesson 09 (failures), in two parts, one module per part's subject.

09a (checkpoints): the atomic write (killed mid-write in a child process), the save protocol and
the verified load on the first 2, 3 and 4 ranks of the grader's cluster (shard writes and renames
watched, a full disk on one rank, a checkpoint saved on another number of ranks, a flipped byte,
a missing piece), and the resharding plan. 09b (recovery): the flight recorder's verdict on
another rank from its record, what a checkpoint must hold to resume exactly (checked by
resuming a short run on 2, 3 and 4 ranks), the accumulation that keeps the global batch when
the world shrinks, and which checkpoints are complete.

- `fixtures`: shared folders and fixture checkpoints, written here with
  `course_lib.checkpoint_files`, never through the learner's `save`, so each check stands on
  its own;
- `saving` (09a): `write_atomic` and `save`;
- `loading` (09a): `read_plan` and `load`;
- `recovery` (09b): `standing`, `run_state`, `accumulation_steps` and `checkpoints`.

Importing this package registers them, in that order. Expected values and explanations are
judge-side (`course_lib/course/grading/references/lesson09/`).

Components (course_lib.ddp, ...) are imported inside the functions that use them, on
purpose: the learner's overlay decides at each call which version runs (theirs or the
reference), and a name bound at import time would keep the first one.
"""

from course_lib.course.grading.exercises.lesson09.fixtures import (W_BASE, W_NUMEL, padded_pieces,
                                                                  read_back, saved_values,
                                                                  write_fixture)
from course_lib.course.grading.exercises.lesson09.saving import (CHUNKS, NEW, OLD, PART_A,
                                                                atomic_harness, save_harness,
                                                                save_state)
from course_lib.course.grading.exercises.lesson09.loading import (flat_buffer_pieces,
                                                                 load_harness, load_target,
                                                                 plan_harness)
from course_lib.course.grading.exercises.lesson09.recovery import (
    PART_B, RESUME_PER_RANK, RESUME_SAMPLES, RESUME_STEPS, SCENARIOS, accumulation_harness,
    checkpoints_harness, resume_harness, standing_harness)

__all__ = ["PART_A", "PART_B", "OLD", "NEW", "CHUNKS", "W_NUMEL", "W_BASE", "padded_pieces",
           "write_fixture", "read_back", "saved_values", "atomic_harness", "save_state",
           "save_harness", "plan_harness", "flat_buffer_pieces", "load_target", "load_harness",
           "SCENARIOS", "standing_harness", "RESUME_SAMPLES", "RESUME_PER_RANK", "RESUME_STEPS",
           "resume_harness", "accumulation_harness", "checkpoints_harness"]
