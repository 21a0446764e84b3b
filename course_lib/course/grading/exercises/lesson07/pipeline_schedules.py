"""Lesson 07c's checks (schedules): the executor's forward and backward actions, one training
step on a stage per rank, and the GPipe and 1F1B orders. Expected values and explanations:
`course_lib/course/grading/references/lesson07.py`.

Components (course_lib.pipeline, ...) are imported inside the functions that use them, on
purpose: the learner's overlay decides at each call which version runs (theirs or the
reference), and a name bound at import time would keep the first one.
"""

from __future__ import annotations

from course_lib.course.grading import RANK, WORLD_SIZE, Exercise, case, register
from course_lib.course.grading.exercises.lesson07.pipeline_split import model_and_batch
from course_lib.course.grading.sub_worlds import harness, register_on_sub_worlds
from course_lib.i18n import N_

PART_C = "07c_pipeline_schedules"


# --- 07c: lesson07.forward_step and backward_step, the executor on real ranks ------------------
# One training step of the library's schedule with the learner's function for F or B, a stage
# per rank on the first 2, 3 and 4 ranks, against one process on the whole batch.

MICROBATCH = 2  # samples per micro-batch


def _executor_body(dist, rank: int, fn, which: str, kind: str, m: int, seed: int) -> dict:
    from torch.nn import functional as F

    from course_lib import pipeline

    k = dist.get_world_size()
    model, x, y = model_and_batch(seed, batch=MICROBATCH * m)
    stage = pipeline.PipelineStage(pipeline.split_sequential(model, k)[rank], rank, k, dist=dist)
    schedule = {"1F1B": pipeline.Schedule1F1B, "GPipe": pipeline.ScheduleGPipe}[kind](
        stage, m, loss_fn=F.mse_loss)
    if which == "F":
        schedule._forward = lambda mb: fn(schedule, mb)
    else:
        schedule._backward = lambda mb: fn(schedule, mb)
    last = rank == k - 1
    losses: list = []
    out = schedule.step(*([x] if rank == 0 else []), target=y if last else None,
                        losses=losses if last else None)
    result = {"stage gradients": [p.grad for p in stage.submodule.parameters()],
              "messages sent": dist.calls["isend"] + dist.calls["send"],
              "bytes sent": dist.payload["isend"] + dist.payload["send"]}
    if last:
        result["output"], result["losses"] = out, losses
    return result


def executor_harness(which: str):
    """The harness of the executor check with the learner's `fn` as action `which`."""
    return harness(_executor_body, which)


EXECUTOR_CASES = [
    case(RANK, WORLD_SIZE, 2, "1F1B", 4, 0, label="2 stages, 1F1B, 4 micro-batches"),
    case(RANK, WORLD_SIZE, 3, "1F1B", 5, 1, label="3 stages, 1F1B, 5 micro-batches"),
    case(RANK, WORLD_SIZE, 4, "1F1B", 2, 2, label="4 stages, 1F1B, 2 < 4 micro-batches"),
    case(RANK, WORLD_SIZE, 4, "GPipe", 4, 3, label="4 stages, GPipe, 4 micro-batches"),
]

for _which, _name, _hints in (
        ("F", "forward_step",
         (N_("F of micro-batch mb on one stage: get the input (the batch's slice on the first "
             "stage, else the previous stage's activation of mb), compute, keep what B of mb will "
             "need, and pass the output on; the last stage turns it into the micro-batch's loss."),
          N_("A received activation is where this stage's autograd graph begins: it must require "
             "grad, or B cannot send its gradient back. Post the next micro-batch's receive as "
             "soon as this one has arrived. The last stage keeps the loss divided by m for B, and "
             "records the output and the undivided loss."))),
        ("B", "backward_step",
         (N_("B of micro-batch mb mirrors its F: the gradient of this stage's output arrives from "
             "the next stage, goes backward through what F of mb kept, and the gradient of this "
             "stage's input goes to the previous stage."),
          N_("Take micro-batch mb's own stash, never another's (none is an error). The last stage "
             "has no incoming gradient: it starts from its scaled loss. Receive a gradient only "
             "when its B runs: the next stage sends it after an activation this stage sends "
             "first. Time the backward in the schedule's measure, as F times its compute.")))):
    register_on_sub_worlds(
        f"lesson07.{_name}", PART_C,
        params=("sched", "mb"),
        cases=EXECUTOR_CASES,
        reference="lesson07:executor",
        explain="lesson07:explain_executor",
        harness=executor_harness(_which),
        points=3,
        time_limit=5.0,  # a step takes well under a second; a message to the wrong peer hangs
        rtol=1e-9,
        atol=1e-12,
        hints=_hints,
    )


# --- 07c: lesson07.gpipe_order and one_f_one_b_order -------------------------------------------

def order_harness(fn, n_microbatches: int, num_stages: int, stage_index: int) -> list:
    return [tuple(a) for a in fn(n_microbatches, num_stages, stage_index)]


ORDER_CASES = [case(4, 2, 0, label="m=4, p=2, stage 0"), case(4, 2, 1, label="m=4, p=2, stage 1"),
               case(8, 4, 0, label="m=8, p=4, stage 0"), case(8, 4, 2, label="m=8, p=4, stage 2"),
               case(2, 4, 0, label="m=2 < p=4, stage 0"), case(1, 3, 2, label="m=1, p=3, last")]

register(Exercise(
    name="lesson07.gpipe_order",
    notebook=PART_C,
    params=("n_microbatches", "num_stages", "stage_index"),
    cases=ORDER_CASES,
    reference="lesson07:gpipe_order",
    explain="lesson07:explain_gpipe_order",
    harness=order_harness,
    points=1,
    hints=("Every stage: all the forwards, then all the backwards, the backwards in the same "
           "micro-batch order as the forwards, and the same list on every stage.",
           "The list is of (action, micro-batch) pairs; for two micro-batches it reads F0, F1, "
           "B0, B1 on every stage."),
))

register(Exercise(
    name="lesson07.one_f_one_b_order",
    notebook=PART_C,
    params=("n_microbatches", "num_stages", "stage_index"),
    cases=ORDER_CASES,
    reference="lesson07:one_f_one_b_order",
    explain="lesson07:explain_1f1b_order",
    harness=order_harness,
    points=2,
    hints=("Three phases: warm up with forwards, then alternate one forward and one backward "
           "(the oldest micro-batch still stored), then drain the backwards left. The last "
           "stage needs no warm-up; each stage before it keeps one more micro-batch in flight "
           "than the stage after it.",
           "Picture p = 4, m = 8: stage 3 runs F0 B0 F1 B1 ..., stage 2 F0 F1 B0 F2 B1 ..., "
           "stage 0 starts with four forwards before B0. With fewer micro-batches than the "
           "warm-up wants, the warm-up stops at m."),
))
