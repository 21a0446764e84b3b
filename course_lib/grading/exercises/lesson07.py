"""Lesson 07 (pipeline parallel): micro-batches through stages in one process; the executor's
forward and backward actions on a stage per rank (2, 3 and 4 of them); schedule orders."""

from __future__ import annotations

from course_lib.grading import RANK, WORLD_SIZE, Exercise, case, register
from course_lib.grading.sub_worlds import register_on_sub_worlds


def partition_harness(fn, costs: list, n_stages: int) -> dict | str:
    """Whether `fn`'s ranges are a valid split, and its largest stage cost: any split with the
    smallest largest stage is right (ties may be broken either way)."""
    try:
        ranges = [range(r.start, r.stop) for r in fn(costs, n_stages)]
    except ValueError:
        return "raises ValueError"
    valid = (len(ranges) == n_stages and all(len(r) > 0 and r.step == 1 for r in ranges)
             and [i for r in ranges for i in r] == list(range(len(costs))))
    return {"n_stages non-empty contiguous ranges covering every layer in order": valid,
            "largest stage cost": max(sum(costs[i] for i in r) for r in ranges) if valid else None}


def _partition_reference(costs: list, n_stages: int) -> dict | str:
    from course_lib.pipeline import partition

    return partition_harness(partition, costs, n_stages)


register(Exercise(
    name="lesson07.partition",
    notebook="07_pipeline_parallel",
    params=("costs", "n_stages"),
    cases=[
        case([1, 1, 1, 1], 2, label="4 equal layers, 2 stages"),
        case([5, 1, 1, 1, 1, 1], 2, label="a heavy first layer"),
        case([1, 2, 3, 4, 5, 6, 7, 8, 9], 3, label="growing costs, 3 stages"),
        case([4, 1, 1, 4, 1, 1, 4], 3, label="greedy filling to the average fails"),
        case([3, 3, 3], 3, label="one layer per stage"),
        case([1, 100, 1, 1], 3, label="one layer dominates"),
        case([2, 2], 3, label="more stages than layers: an error"),
    ],
    reference=_partition_reference,
    harness=partition_harness,
    points=2,
    hints=("Dynamic programming over prefix sums: best[k][i] = the smallest largest stage cost of "
          "layers[:i] in k stages = min over j of max(best[k-1][j], cost(j..i)); remember the j "
          "that won, and walk the cuts back from best[n_stages][n]. Every stage non-empty; "
          "n_stages > len(costs) is a ValueError.",),
))


def _model_and_batch(seed: int, batch: int = 8):
    import torch
    from torch import nn

    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 7), nn.Tanh(),
                          nn.Linear(7, 6), nn.Tanh(), nn.Linear(6, 3)).double()
    g = torch.Generator().manual_seed(seed + 100)
    return (model, torch.randn(batch, 5, generator=g, dtype=torch.float64),
            torch.randn(batch, 3, generator=g, dtype=torch.float64))


def pipeline_harness(fn, seed: int, n_stages: int, n_microbatches: int) -> list:
    """Split the model into stages, let `fn` run the micro-batches, return every .grad."""
    from torch.nn import functional as F

    from course_lib.pipeline import split_sequential

    model, x, y = _model_and_batch(seed)
    fn(split_sequential(model, n_stages), x, y, F.mse_loss, n_microbatches)
    return [p.grad for p in model.parameters()]


def _full_batch_grads(seed: int, n_stages: int, n_microbatches: int) -> list:
    from torch.nn import functional as F

    model, x, y = _model_and_batch(seed)
    F.mse_loss(model(x), y).backward()
    return [p.grad for p in model.parameters()]


register(Exercise(
    name="lesson07.pipeline_grads",
    notebook="07_pipeline_parallel",
    params=("stages", "x", "target", "loss_fn", "n_microbatches"),
    cases=[case(0, 2, 1, label="2 stages, 1 micro-batch"),
           case(0, 2, 4, label="2 stages, 4 micro-batches"),
           case(1, 3, 4, label="3 stages, 4 micro-batches"),
           case(2, 4, 8, label="4 stages, 8 micro-batches")],
    reference=_full_batch_grads,
    harness=pipeline_harness,
    points=3,
    rtol=1e-9, atol=1e-12,
    hints=("Forward each micro-batch through the stages, giving every stage a detached copy of "
          "its input with requires_grad and keeping (input, output) per stage. Backward each "
          "micro-batch: loss / n_microbatches on the last stage, then out.backward(grad) with "
          "the grad of the next stage's input, for the SAME micro-batch.",),
))


def _order(kind: str):
    from course_lib import pipeline

    return getattr(pipeline, kind)


def _reference(kind: str):
    def ref(n_microbatches: int, num_stages: int, stage_index: int) -> list:
        return [tuple(a) for a in _order(kind)(n_microbatches, num_stages, stage_index)]
    return ref


def order_harness(fn, n_microbatches: int, num_stages: int, stage_index: int) -> list:
    return [tuple(a) for a in fn(n_microbatches, num_stages, stage_index)]


_ORDER_CASES = [case(4, 2, 0, label="m=4, p=2, stage 0"), case(4, 2, 1, label="m=4, p=2, stage 1"),
                case(8, 4, 0, label="m=8, p=4, stage 0"), case(8, 4, 2, label="m=8, p=4, stage 2"),
                case(2, 4, 0, label="m=2 < p=4, stage 0"), case(1, 3, 2, label="m=1, p=3, last")]

register(Exercise(
    name="lesson07.gpipe_order",
    notebook="07_pipeline_parallel",
    params=("n_microbatches", "num_stages", "stage_index"),
    cases=_ORDER_CASES,
    reference=_reference("gpipe_order"),
    harness=order_harness,
    points=1,
    hints=("All forwards F0..F(m-1), then all backwards B0..B(m-1), in the same micro-batch order "
         "on every stage, so a gradient always meets its own activations.",),
))

register(Exercise(
    name="lesson07.one_f_one_b_order",
    notebook="07_pipeline_parallel",
    params=("n_microbatches", "num_stages", "stage_index"),
    cases=_ORDER_CASES,
    reference=_reference("one_f_one_b_order"),
    harness=order_harness,
    points=2,
    hints=("Warm up with min(p - 1 - stage, m) forwards; then for each remaining micro-batch one "
         "forward (the next one) and one backward (the oldest); then the leftover backwards.",),
))


# --- lesson07.forward_step and lesson07.backward_step: the executor on real ranks --------------
# One training step of the library's schedule with the learner's function for F or B, a stage
# per rank on the first 2, 3 and 4 ranks, against one process on the whole batch.

_MB = 2  # samples per micro-batch


def _executor_body(dist, rank: int, fn, which: str, kind: str, m: int, seed: int) -> dict:
    from torch.nn import functional as F

    from course_lib import pipeline

    k = dist.get_world_size()
    model, x, y = _model_and_batch(seed, batch=_MB * m)
    stage = pipeline.PipelineStage(pipeline.split_sequential(model, k)[rank], rank, k, dist=dist)
    schedule = {"1F1B": pipeline.Schedule1F1B, "GPipe": pipeline.ScheduleGPipe}[kind](
        stage, m, loss_fn=F.mse_loss)
    if which == "F":
        schedule._forward = lambda mb: fn(schedule, mb)
    elif which == "B":
        schedule._backward = lambda mb: fn(schedule, mb)
    elif which == "send":
        stage.send = lambda *args: fn(stage, *args)
    else:
        stage.recv = lambda *args: fn(stage, *args)
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
        from course_lib.grading.sub_worlds import on_first_ranks

        return on_first_ranks(k, _executor_body, fn, which, kind, m, seed)
    return harness


def _executor_reference(rank: int, world_size: int, k: int, kind: str, m: int, seed: int):
    from torch.nn import functional as F

    from course_lib.pipeline import MAX_DIMS, split_sequential

    if rank >= k:
        return None
    model, x, y = _model_and_batch(seed, batch=_MB * m)
    out = model(x)
    F.mse_loss(out, y).backward()
    stages = split_sequential(model, k)
    crossing, h = [], x[:_MB]  # the bytes of one micro-batch's activation after each cut
    for s in stages[:-1]:
        h = s(h)
        crossing.append(h.numel() * h.element_size())
    header = (3 + MAX_DIMS) * 8
    # Every micro-batch crosses each of this stage's links once each way, a header and a tensor:
    # out to the next stage as an activation, back to the previous one as a gradient.
    links = ([crossing[rank]] if rank < k - 1 else []) + ([crossing[rank - 1]] if rank else [])
    result = {"stage gradients": [p.grad for p in stages[rank].parameters()],
              "messages sent": 2 * m * len(links),
              "bytes sent": m * sum(header + n for n in links)}
    if rank == k - 1:
        result["output"] = out.detach()
        result["losses"] = [F.mse_loss(model(xc), yc).detach()
                            for xc, yc in zip(x.chunk(m), y.chunk(m))]
    return result


_EXECUTOR_CASES = [
    case(RANK, WORLD_SIZE, 2, "1F1B", 4, 0, label="2 stages, 1F1B, 4 micro-batches"),
    case(RANK, WORLD_SIZE, 3, "1F1B", 5, 1, label="3 stages, 1F1B, 5 micro-batches"),
    case(RANK, WORLD_SIZE, 4, "1F1B", 2, 2, label="4 stages, 1F1B, 2 < 4 micro-batches"),
    case(RANK, WORLD_SIZE, 4, "GPipe", 4, 3, label="4 stages, GPipe, 4 micro-batches"),
]

for _which, _name, _hint in (
        ("send", "stage_send",
         "For the header (_header(tensor, microbatch)) and then the detached, contiguous "
         "tensor: stage._sending.append((stage.dist.isend(t, dst, group=stage.group, tag=tag), "
         "t, dst, what)). Never wait here; wrap a transport error in stage._fail(what, dst, exc)."),
        ("recv", "stage_recv",
         "posted = stage._posted.pop((src, tag), None): if posted, wait for its works; else "
         "recv a 3 + MAX_DIMS int64 header, torch.empty(shape[:ndim], dtype=DTYPES[code]) and "
         "recv into it, all with group=stage.group and tag. Raise if header[1] != microbatch "
         "(or a posted header disagrees with _header(tensor, microbatch))."),
        ("F", "forward_step",
         "First stage: [a[mb] for a in sched.inputs]; else recv(prev, ACTIVATION_TAG, mb) and "
         ".requires_grad_(), then irecv micro-batch mb + 1. Compute inside sched.measure('F', "
         "mb); the last stage's loss is divided by n_microbatches (scale_grads). Stash (input, "
         "output or scaled loss) under mb; send the output to stage.next unless last."),
        ("B", "backward_step",
         "Pop sched.stash[mb] (missing: an error naming stage and micro-batch). Unless last, "
         "recv(next, GRADIENT_TAG, mb) and irecv mb + 1. torch.autograd.backward(out, grad) "
         "inside sched.measure('B', mb); unless first, send input.grad to stage.prev with "
         "GRADIENT_TAG.")):
    register_on_sub_worlds(
        f"lesson07.{_name}", "07_pipeline_parallel",
        params=("stage", "tensor", "dst", "tag", "microbatch") if _which == "send" else
        ("stage", "src", "tag", "microbatch") if _which == "recv" else ("sched", "mb"),
        cases=_EXECUTOR_CASES,
        reference=_executor_reference,
        harness=executor_harness(_which),
        points=3,
        time_limit=5.0,  # a step takes well under a second; a message to the wrong peer hangs
        rtol=1e-9,
        atol=1e-12,
        hints=(_hint,),
    )


# --- lesson07.bubble_fractions -----------------------------------------------------------------

def bubble_harness(fn, spans: list) -> dict | str:
    """Events from (stage, action, start, end) tuples; the fractions `fn` computes, rounded."""
    from course_lib.pipeline import Event

    events = [Event(rank, action, i, start, end) for i, (rank, action, start, end)
              in enumerate(spans)]
    try:
        return {r: round(f, 9) for r, f in fn(events).items()}
    except ValueError:
        return "raises ValueError"


def _bubble_reference(spans: list) -> dict | str:
    from course_lib.pipeline import bubble_fractions

    return bubble_harness(bubble_fractions, spans)


register(Exercise(
    name="lesson07.bubble_fractions",
    notebook="07_pipeline_parallel",
    params=("events",),
    cases=[
        case([(0, "F", 0.0, 1.0), (1, "F", 1.0, 2.0), (1, "B", 2.0, 3.0), (0, "B", 3.0, 4.0)],
             label="2 stages, one micro-batch: half idle each"),
        case([(0, "F", 0.0, 1.0), (0, "F", 1.0, 2.0), (1, "F", 1.0, 2.0), (1, "F", 2.0, 3.0),
              (1, "B", 3.0, 4.0), (1, "B", 4.0, 5.0), (0, "B", 4.0, 5.0), (0, "B", 5.0, 6.0)],
             label="2 stages, GPipe, m = 2"),
        case([(2, "F", 5.0, 6.0), (0, "F", 0.0, 3.0), (1, "F", 3.0, 5.0)],
             label="3 stages, uneven, out of order"),
        case([], label="no events: an error"),
    ],
    reference=_bubble_reference,
    harness=bubble_harness,
    points=1,
    hints=("span = max(e.end) - min(e.start) over all events; per e.rank, busy = sum of e.end - "
          "e.start; fraction = 1 - busy / span, for each stage; raise ValueError on [].",),
))
