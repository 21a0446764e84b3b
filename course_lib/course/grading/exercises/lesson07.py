"""Lesson 07 (pipeline parallel), in three parts. 07a: the bubble of a timeline, balanced stages,
micro-batches through the stages in one process. 07b: a stage's messages (header + tensor) on a
stage per rank (2, 3 and 4 of them). 07c: the executor's forward and backward actions, and the
schedule orders. Expected values and explanations: `course_lib/course/grading/references/lesson07.py`.

Components (course_lib.ddp, ...) are imported inside the functions that use them, on
purpose: the learner's overlay decides at each call which version runs (theirs or the
reference), and a name bound at import time would keep the first one.
"""

from __future__ import annotations

from course_lib.course.grading import RANK, WORLD_SIZE, Exercise, case, register
from course_lib.course.catalogue import CheckTimeout
from course_lib.course.grading.sub_worlds import register_on_sub_worlds
from course_lib.i18n import N_
from course_lib.course.grading.sub_worlds import on_first_ranks

PART_A, PART_B, PART_C = "07a_pipeline_split", "07b_pipeline_messages", "07c_pipeline_schedules"

# --- 07a: lesson07.bubble_fractions ------------------------------------------------------------

VALID = "a split of the layers"  # n_stages non-empty contiguous ranges, every layer once, in order


def bubble_harness(fn, spans: list) -> dict | str:
    """Events from (stage, action, start, end) tuples; the fractions `fn` computes, rounded."""
    from course_lib.pipeline_split import Event

    events = [Event(rank, action, i, start, end) for i, (rank, action, start, end)
              in enumerate(spans)]
    try:
        return {r: round(f, 9) for r, f in fn(events).items()}
    except ValueError:
        return "raises ValueError"


register(Exercise(
    name="lesson07.bubble_fractions",
    notebook=PART_A,
    params=("events",),
    cases=[
        case([(0, "F", 0.0, 1.0), (1, "F", 1.0, 2.0), (1, "B", 2.0, 3.0), (0, "B", 3.0, 4.0)],
             label="2 stages, one micro-batch: half idle each"),
        case([(0, "F", 0.0, 1.0), (0, "F", 1.0, 2.0), (1, "F", 1.0, 2.0), (1, "F", 2.0, 3.0),
              (1, "B", 3.0, 4.0), (1, "B", 4.0, 5.0), (0, "B", 4.0, 5.0), (0, "B", 5.0, 6.0)],
             label="2 stages, all forwards then all backwards, m = 2"),
        case([(2, "F", 5.0, 6.0), (0, "F", 0.0, 3.0), (1, "F", 3.0, 5.0)],
             label="3 stages, uneven, out of order"),
        case([], label="no events: an error"),
    ],
    reference="lesson07:bubble_fractions",
    explain="lesson07:explain_bubble",
    harness=bubble_harness,
    points=1,
    hints=("A stage's bubble is its idle share of the whole step. The step runs from the "
           "earliest start of any stage to the latest end of any stage: one span, the same for "
           "every stage, so a stage that starts late is idle until it starts.",
           "Add up each stage's busy time (how long each of its events lasts); what is left of "
           "the span is idle. Picture the first case: stage 1 starts one unit late and stage 0 "
           "waits one unit in the middle, so each is idle half of the four units."),
))


# --- 07a: lesson07.partition -------------------------------------------------------------------

def partition_harness(fn, costs: list, n_stages: int) -> dict | str:
    """Whether `fn`'s ranges are a valid split (or what is wrong with them), and its largest
    stage cost: any split with the smallest largest stage is right (ties either way)."""
    try:
        ranges = list(fn(costs, n_stages))
    except ValueError:
        return "raises ValueError"
    layers = [i for r in ranges for i in r]
    problem = (N_("not one range per stage") if len(ranges) != n_stages else
               N_("a stage is empty") if any(len(r) == 0 for r in ranges) else
               N_("a range that skips layers") if any(r.step != 1 for r in ranges) else
               N_("not every layer once, in order") if layers != list(range(len(costs))) else
               None)
    return {VALID: problem or True,
            "largest stage cost": None if problem else max(sum(costs[i] for i in r)
                                                          for r in ranges)}


register(Exercise(
    name="lesson07.partition",
    notebook=PART_A,
    params=("costs", "n_stages"),
    cases=[
        case([1, 1, 1, 1], 2, label="4 equal layers, 2 stages"),
        case([5, 1, 1, 1, 1, 1], 2, label="a heavy first layer"),
        case([1, 2, 3, 4, 5, 6, 7, 8, 9], 3, label="growing costs, 3 stages"),
        case([4, 1, 1, 4, 1, 1, 4], 3, label="three heavy layers, 3 stages"),
        case([3, 3, 3], 3, label="one layer per stage"),
        case([1, 100, 1, 1], 3, label="one layer dominates"),
        case([2, 2], 3, label="more stages than layers: an error"),
    ],
    reference="lesson07:partition",
    explain="lesson07:explain_partition",
    harness=partition_harness,
    points=2,
    hints=("Build a table over (stages, layers): the smallest largest stage for the first few "
           "layers in a few stages. An entry follows from entries with one stage fewer, because "
           "the best split ends with one last stage after the best split of what comes before.",
           "For a prefix of layers in k stages, try every place for the last cut: the candidate "
           "is the larger of the table's entry before the cut (k - 1 stages) and the cost of the "
           "layers after it; keep the smallest, and remember which cut won. Walking the winning "
           "cuts back from all layers in all stages gives the ranges."),
))


# --- 07a: lesson07.pipeline_grads --------------------------------------------------------------

def model_and_batch(seed: int, batch: int = 8):
    """The float64 model every stage check splits, and its batch."""
    import torch
    from torch import nn

    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 7), nn.Tanh(),
                          nn.Linear(7, 6), nn.Tanh(), nn.Linear(6, 3)).double()
    g = torch.Generator().manual_seed(seed + 100)
    return (model, torch.randn(batch, 5, generator=g, dtype=torch.float64),
            torch.randn(batch, 3, generator=g, dtype=torch.float64))


def pipeline_harness(fn, seed: int, n_stages: int, n_microbatches: int) -> dict:
    """Split the model into stages, let `fn` run the micro-batches, return each stage's .grad."""
    from torch.nn import functional as F

    from course_lib.pipeline_split import split_sequential

    model, x, y = model_and_batch(seed)
    stages = split_sequential(model, n_stages)
    fn(stages, x, y, F.mse_loss, n_microbatches)
    return {f"stage {s} gradients": [p.grad for p in stage.parameters()]
            for s, stage in enumerate(stages)}


register(Exercise(
    name="lesson07.pipeline_grads",
    notebook=PART_A,
    params=("stages", "x", "target", "loss_fn", "n_microbatches"),
    cases=[case(0, 2, 1, label="2 stages, 1 micro-batch"),
           case(0, 2, 4, label="2 stages, 4 micro-batches"),
           case(1, 3, 4, label="3 stages, 4 micro-batches"),
           case(2, 4, 8, label="4 stages, 8 micro-batches")],
    reference="lesson07:full_batch_grads",
    explain="lesson07:explain_stage_grads",
    harness=pipeline_harness,
    points=3,
    rtol=1e-9, atol=1e-12,
    hints=("Two invariants. Each micro-batch's loss counts for 1/m of the batch's loss. And a "
           "stage's backward for a micro-batch starts from the gradient that the next stage's "
           "input received for that same micro-batch.",
           "Keep, for every micro-batch and every stage, the detached input you fed the stage "
           "and the output it gave. Then, micro-batch by micro-batch, go backward from the last "
           "stage's scaled loss and walk the stages back, each one's output taking the gradient "
           "that the next stage's input received."),
))


# --- 07b: lesson07.stage_send and stage_recv: every link of 2, 3 and 4 stages, both ways -------
# Stage s sends micro-batch j's activation to stage s + 1 as a (2, 3 + s) tensor full of
# 10 s + j, and its gradient to stage s - 1 as a (2, 2 + s) tensor full of -(10 s + j); it sends
# everything first, then receives, so one stage's error never leaves another waiting. Each rank
# returns what it received, in order (described: dtype, shape, values), and the messages and
# bytes it sent. The check of stage_send receives without stage_recv (the next exercise): into
# buffers shaped as sent, returning each header too.


def link_value(s: int, j: int, tag: int, dtype):
    """What stage s sends for micro-batch j with `tag` (1: activation, 2: gradient)."""
    import torch

    if tag == 1:
        return torch.full((2, 3 + s), 10 * s + j, dtype=dtype)
    return torch.full((2, 2 + s), -(10 * s + j), dtype=dtype)


def describe(t) -> list:
    """A received tensor as the check shows it: [dtype, shape, its distinct values (up to 3)]."""
    import torch

    if not isinstance(t, torch.Tensor):
        return [type(t).__name__]
    values = sorted({float(v) for v in t.detach().flatten().tolist()})
    return [str(t.dtype).removeprefix("torch."), list(t.shape), values[:3]]


def _links_body(dist, rank: int, fn, which: str, dtype: str, m: int, post: bool,
                skew: int) -> dict:
    import torch

    from course_lib import pipeline_stage as ps

    k = dist.get_world_size()
    stage = ps.PipelineStage(torch.nn.Identity(), rank, k, dist=dist)
    if which == "send":
        stage.send = lambda *args: fn(stage, *args)
    else:
        stage.recv = lambda *args: fn(stage, *args)
    kind = getattr(torch, dtype)
    received: list = []
    result: dict = {"received": received}
    try:
        for tag, dst in ((ps.ACTIVATION_TAG, stage.next), (ps.GRADIENT_TAG, stage.prev)):
            for j in range(m if dst is not None else 0):
                # `skew` labels stage 0's activations wrongly: a schedule out of step
                label = j + skew if tag == ps.ACTIVATION_TAG and rank == 0 else j
                stage.send(link_value(rank, j, tag, kind), dst, tag, label)
        for tag, src in ((ps.ACTIVATION_TAG, stage.prev), (ps.GRADIENT_TAG, stage.next)):
            for j in range(m if src is not None else 0):
                if which == "send":  # no stage_recv yet: buffers shaped as sent, and the header
                    sender = rank - 1 if tag == ps.ACTIVATION_TAG else rank + 1
                    stage.irecv(src, tag, j, like=link_value(sender, j, tag, kind))
                    posted = stage.take_posted(src, tag)
                    for work in posted.works:
                        work.wait()
                    tensor = posted.tensor
                    result.setdefault("headers", []).append(posted.header.tolist())
                else:
                    tensor = stage.recv(src, tag, j)
                    if post and j + 1 < m:
                        stage.irecv(src, tag, j + 1, like=tensor)
                received.append(describe(tensor))
        stage.wait_sends()
    except (NotImplementedError, CheckTimeout):
        raise  # a stub is "not implemented yet"; a call past its time limit must stop
    except Exception as exc:  # noqa: BLE001 - what the learner's code raised is the result
        result["raised"] = type(exc).__name__ if skew else \
            f"{type(exc).__name__}: {str(exc)[:200]}"
    result["messages sent"] = dist.calls["isend"] + dist.calls["send"]
    result["bytes sent"] = dist.payload["isend"] + dist.payload["send"]
    return result


def links_harness(which: str):
    def harness(fn, rank: int, world_size: int, k: int, dtype: str, m: int, post: bool,
                skew: int = 0):
        return on_first_ranks(k, _links_body, fn, which, dtype, m, post, skew)
    return harness


LINK_CASES = [
    case(RANK, WORLD_SIZE, 2, "float64", 3, True, label="2 stages, float64, 3 micro-batches"),
    case(RANK, WORLD_SIZE, 3, "float32", 4, False,
         label="3 stages, float32, 4 micro-batches, no posted receives"),
    case(RANK, WORLD_SIZE, 4, "float16", 3, True, label="4 stages, float16, 3 micro-batches"),
    case(RANK, WORLD_SIZE, 3, "float64", 2, False, 3,
         label="3 stages, stage 0 out of step (labels micro-batch j as j + 3)"),
]

for _which, _name, _hints in (
        ("send", "stage_send",
         (N_("Each call is two messages, in the order the receiver reads them: the header, which "
             "describes the tensor and names its micro-batch, then the tensor itself, both with "
             "the caller's tag. A stage never waits for its own send: it starts it and moves on."),
          N_("Send a detached, contiguous copy (autograd history and strides do not travel). The "
             "stage waits for every started send later, in wait_sends, so hand it each send's work "
             "and tensor (the tensor must outlive the send). A transport error becomes the "
             "stage's error, naming what was sent, to which rank."))),
        ("recv", "stage_recv",
         (N_("The header arrives first and says how to allocate the tensor (dtype, number of "
             "dimensions, shape) and which micro-batch it is. Receive it, build the buffer it "
             "describes, receive into it, and only then trust it: a header for another "
             "micro-batch than the one asked for is an error."),
          N_("If irecv already posted this peer and tag, the buffers exist and the receives are "
             "running: wait for them instead of receiving again, and check the header against "
             "both the micro-batch asked for and the buffer posted for it. Any transport error "
             "becomes the stage's error, naming what was expected, from which rank.")))):
    register_on_sub_worlds(
        f"lesson07.{_name}", PART_B,
        params=("stage", "tensor", "dst", "tag", "microbatch") if _which == "send" else
        ("stage", "src", "tag", "microbatch"),
        cases=LINK_CASES,
        reference=f"lesson07:links_{_which}",
        explain="lesson07:explain_links",
        harness=links_harness(_which),
        points=3,
        time_limit=5.0,  # well under a second; a receive of a message never sent hangs
        hints=_hints,
    )


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
    def harness(fn, rank: int, world_size: int, k: int, kind: str, m: int, seed: int):
        return on_first_ranks(k, _executor_body, fn, which, kind, m, seed)
    return harness


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
             "has no incoming gradient: it starts from its scaled loss. Post the next gradient's "
             "receive once this one has arrived, and time the backward in the schedule's "
             "measure, as F times its compute.")))):
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
