"""Lesson 07b's checks (a stage's messages): `stage_send` and `stage_recv` on every link of 2, 3
and 4 stages, a stage per rank, both ways. Expected values and explanations:
`course_lib/course/grading/references/lesson07.py`.

Components (course_lib.pipeline_stage, ...) are imported inside the functions that use them, on
purpose: the learner's overlay decides at each call which version runs (theirs or the
reference), and a name bound at import time would keep the first one.
"""

from __future__ import annotations

from course_lib.course.grading import RANK, WORLD_SIZE, case
from course_lib.course.catalogue import CheckTimeout
from course_lib.course.grading.sub_worlds import harness, register_on_sub_worlds
from course_lib.i18n import N_

PART_B = "07b_pipeline_messages"


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
                skew: int = 0) -> dict:
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
    return harness(_links_body, which)


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
