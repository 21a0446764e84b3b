"""Lesson 08a's checks (ZeRO): padded shard bounds, a gradient's reduce-scatter, the parameters'
all-gather, the ZeRO-1 step, and the gradient path of ZeRO-1/2 (`on_grad_ready`,
`finish_backward`), checked by training the library's `ZeroRedundancyOptimizer` with the
learner's function in its place. Expected values and explanations:
`course_lib/course/grading/references/lesson08/zero.py`.

Components (course_lib.sharding, course_lib.zero, ...) are imported inside the functions that
use them, on purpose: the learner's overlay decides at each call which version runs (theirs or
the reference), and a name bound at import time would keep the first one.
"""

from __future__ import annotations

import torch
from torch import nn

from course_lib.course.grading import RANK, WORLD_SIZE, Exercise, case, register
from course_lib.course.catalogue import CheckTimeout
from course_lib.course.grading.exercises.lesson08.common import (A, _error, _values,
                                                                register_on_sub_worlds)
from course_lib.course.grading.harnesses import graded_class, seeded_batch
from course_lib.course.grading.sub_worlds import SUB_WORLDS, harness, on_first_ranks
from course_lib.i18n import N_


# --- lesson08.shard_range ----------------------------------------------------------------------


def shard_range_harness(fn, numel: int, world_size: int) -> dict:
    """Every rank's range."""
    return {"ranges": [tuple(int(v) for v in fn(numel, world_size, r)) for r in range(world_size)]}


register(Exercise(
    name="lesson08.shard_range",
    notebook=A,
    params=("numel", "world_size", "rank"),
    cases=[
        case(12, 4, label="12 elements, 4 ranks: divides"),
        case(10, 4, label="10 elements, 4 ranks: 2 of padding"),
        case(10, 3, label="10 elements, 3 ranks"),
        case(7, 2, label="7 elements, 2 ranks"),
        case(2, 4, label="2 elements, 4 ranks: ranks 2 and 3 own only padding"),
        case(1001, 3, label="1001 elements, 3 ranks"),
    ],
    reference="lesson08:shard_range",
    explain="lesson08:explain_shard_range",
    harness=shard_range_harness,
    points=1,
    hints=("Every rank owns as many elements as every other, the fewest that cover the whole "
           "buffer together; the padding at the end makes up the difference.",
           "Picture 10 elements on 4 ranks: three each, twelve in all, the last rank holding "
           "one element and two of padding; each rank's range starts where the previous "
           "rank's stops."),
))


# --- lesson08.reduce_scatter_grads -------------------------------------------------------------


def _rs_body(dist, rank: int, fn, n_per_rank: int, async_op: bool) -> dict:
    k = dist.get_world_size()
    flat = _values(rank, n_per_rank * k)
    shard = torch.full((n_per_rank,), float("nan"), dtype=torch.float64)
    work = fn(flat, shard, dist=dist, async_op=async_op)
    if async_op:
        if work is None:
            return {"shard": shard, "calls": dict(dist.calls), "returned a work": False}
        work.wait()
    return {"shard": shard, "calls": dict(dist.calls), "returned a work": True}


def rs_harness(fn, rank: int, world_size: int, k: int, n_per_rank: int, async_op: bool):
    return on_first_ranks(k, _rs_body, fn, n_per_rank, async_op)


register_on_sub_worlds(
    "lesson08.reduce_scatter_grads", A,
    params=("flat_grad", "shard"),
    cases=[case(RANK, WORLD_SIZE, k, n, a, label=f"{k} ranks, {n} per rank"
                + (", async" if a else ""))
           for k, n, a in ((2, 3, False), (3, 5, False), (4, 2, False), (3, 4, True),
                           (4, 1, True))],
    harness=rs_harness,
    points=2,
    hints=("A reduce-scatter sums chunk r of every rank's buffer into rank r: the flat gradient "
           "cut into as many equal chunks as there are ranks, in rank order. It sums; the "
           "average is yours to make.",
           "With async_op the sum is not there until the work has been waited for: the "
           "division belongs after that wait, in the work you return (Then runs something "
           "once its work is done)."),
)


# --- lesson08.all_gather_params ----------------------------------------------------------------


def _ag_body(dist, rank: int, fn, numels: list, async_op: bool, own: bool) -> dict:
    from course_lib.sharding import FlatLayout

    k = dist.get_world_size()
    layout = FlatLayout([torch.Size([n]) for n in numels], k, torch.float64)
    flat = torch.full((layout.padded_numel,), float("nan"), dtype=torch.float64)
    mine = torch.arange(layout.shard_numel, dtype=torch.float64) + 1000 * (rank + 1)
    if own:  # the shard is this rank's own chunk of the buffer, as in the ZeRO step
        shard = flat[rank * layout.shard_numel:(rank + 1) * layout.shard_numel]
        shard.copy_(mine)
    else:
        shard = mine
    work = fn(flat, shard, layout, dist=dist, async_op=async_op)
    out = {"flat buffer": flat, "calls": dict(dist.calls)}
    if async_op:
        out["returned a work"] = work is not None
        if work is not None:
            work.wait()
    return out


def ag_harness(fn, rank: int, world_size: int, k: int, numels: list, async_op: bool,
               own: bool):
    return on_first_ranks(k, _ag_body, fn, numels, async_op, own)


register_on_sub_worlds(
    "lesson08.all_gather_params", A,
    params=("flat", "shard", "layout"),
    cases=[case(RANK, WORLD_SIZE, k, numels, a, own, label=label)
           for k, numels, a, own, label in (
               (2, [5], False, False, N_("2 ranks, 5 elements")),
               (3, [7, 3], True, False, N_("3 ranks, tensors of 7 and 3, async")),
               (4, [9], True, True,
                N_("4 ranks, 9 elements, async, the shard a view of the buffer")),
               (3, [2], False, True, N_("3 ranks, 2 elements: rank 2 holds only padding")))],
    harness=ag_harness,
    points=1,
    hints=("An all-gather writes each rank's tensor into that rank's slot of a list of outputs; "
           "here the slots can be the ranks' shards of the flat buffer itself, so that nothing "
           "needs copying afterwards.",
           "The layout cuts a flat buffer into the ranks' shards, in rank order, as views: "
           "writing a view writes the buffer."),
)


# --- lesson08.zero1_step -----------------------------------------------------------------------


def _zero1_body(dist, rank: int, fn, numels: list) -> dict:
    from course_lib.sharding import FlatLayout

    k = dist.get_world_size()
    flats, shards, layouts = [], [], []
    for i, n in enumerate(numels):
        layout = FlatLayout([torch.Size([n])], k, torch.float64)
        flat = torch.arange(layout.padded_numel, dtype=torch.float64) + 100 * i
        shard = torch.nn.Parameter(layout.chunks(flat)[rank])
        shard.grad = torch.full_like(shard, float(rank + 1))  # this rank's reduced gradient
        flats.append(flat), shards.append(shard), layouts.append(layout)
    optim = torch.optim.SGD(shards, lr=0.5)
    fn(optim, flats, shards, layouts, dist=dist)
    return {"flat buffers": [f[:n] for f, n in zip(flats, numels)], "calls": dict(dist.calls)}


def zero1_harness(fn, rank: int, world_size: int, k: int, numels: list):
    return on_first_ranks(k, _zero1_body, fn, numels)


register_on_sub_worlds(
    "lesson08.zero1_step", A,
    params=("optimizer", "flats", "shards", "layouts"),
    cases=[case(RANK, WORLD_SIZE, k, numels, label=f"{k} ranks, buckets of {numels}")
           for k, numels in ((2, [6]), (3, [10, 4]), (4, [7, 1, 9]))],
    harness=zero1_harness,
    points=2,
    hints=("After the step every rank's buffers must agree, each shard as its owner updated "
           "it; only the owner has that update, and it is already in the owner's buffer.",
           "What a rank sends must be its updated shard, so the order of the two things "
           "matters; and it is one collective per bucket, not an all-reduce of the update."),
)


# --- lesson08.on_grad_ready and lesson08.finish_backward: ZeRO-1/2's gradient path ------------
# Each check trains the library's ZeroRedundancyOptimizer with the learner's function in its
# place, on the first 2, 3 and 4 ranks, against one process; it records every bucket launch:
# which bucket, and how many gradients were ready then (or "after backward").

_IN, _HID, _OUT, _B, _LR = 5, 6, 3, 2, 0.3
_CAP_MB = 200 / 2**20  # three buckets of this float64 model: [mid], [inp], [out (+ spare)]


class ZeroNet(nn.Module):
    """Registered out of forward order, so the last bucket is complete first and must wait for
    buckets 0 and 1; `spare` is absent, or present and used by nobody (no gradient)."""

    def __init__(self, spare: bool):
        super().__init__()
        torch.manual_seed(0)
        if spare:
            self.spare = nn.Linear(2, 2)
        self.out = nn.Linear(_HID, _OUT)
        self.inp = nn.Linear(_IN, _HID)
        self.mid = nn.Linear(_HID, _HID)
        self.double()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.tanh(self.mid(torch.tanh(self.inp(x)))))


def zero_batch(step: int, size: int):
    return seeded_batch(80 + step, size, _IN, _OUT)


def _graded_zero(which: str, fn):
    """The library's ZeroRedundancyOptimizer with the learner's `fn`, logging each launch."""
    from course_lib.zero import ZeroRedundancyOptimizer

    return graded_class(ZeroRedundancyOptimizer, which, fn, count_ready=True)


def _zero_body(dist, rank: int, fn, which: str, stage: int, steps: int, micro: int,
               no_sync: bool, spare: bool) -> dict:
    import contextlib

    k = dist.get_world_size()
    model = ZeroNet(spare)
    opt = _graded_zero(which, fn)(model.parameters(), torch.optim.SGD, stage=stage,
                                  bucket_cap_mb=_CAP_MB, dist=dist, lr=_LR, momentum=0.5)
    launches = []
    for step in range(steps):
        x, y = zero_batch(step, k * _B * micro)
        opt.zero_grad()
        for i in range(micro):
            xs, ys = x[rank::k][i::micro], y[rank::k][i::micro]
            quiet = no_sync and i < micro - 1
            try:
                with opt.no_sync() if quiet else contextlib.nullcontext():
                    (nn.functional.mse_loss(model(xs), ys) / micro).backward()
            except (NotImplementedError, CheckTimeout):
                raise
            except Exception as exc:  # noqa: BLE001 - what went wrong is the check's answer
                return {N_("backward raised"): _error(exc), N_("flat gradient sizes"): [
                    None if b.staging is None else b.staging.numel() for b in opt.buckets]}
            launches.append(list(opt.launches))
            opt.launches.clear()
        kept = {N_("full gradients in p.grad"): sum(p.grad is not None
                                                     for p in model.parameters()),
                N_("buckets still holding a flat gradient or a reduction"): sum(
                    b.staging is not None or b.reduced is not None or b.work is not None
                    for b in opt.buckets)}
        opt.step()
    return {"parameters": torch.cat([p.detach().reshape(-1) for p in model.parameters()]),
            N_("launches in each backward: (bucket, gradients ready then)"): launches,
            N_("after the last backward"): kept}


def zero_harness(which: str):
    """The harness of the ZeRO gradient-path checks with the learner's `fn` as `which`."""
    return harness(_zero_body, which)


def _zero_label(k, stage, steps, micro, no_sync, spare) -> str:
    return f"{k} ranks, ZeRO-{stage}" + (f", {micro} micro-batches" if micro > 1 else "") + (
        ", no_sync" if no_sync else "") + (", a parameter without gradient" if spare else "")


_ZERO_CASES = [
    case(RANK, WORLD_SIZE, 2, 2, 2, 1, False, False, label="2 ranks, ZeRO-2"),
    case(RANK, WORLD_SIZE, 3, 1, 2, 2, True, False,
         label="3 ranks, ZeRO-1, 2 micro-batches, the first in no_sync()"),
    case(RANK, WORLD_SIZE, 4, 2, 2, 2, True, False,
         label="4 ranks, ZeRO-2, 2 micro-batches, the first in no_sync()"),
    case(RANK, WORLD_SIZE, 3, 2, 2, 2, False, False,
         label="3 ranks, ZeRO-2, 2 micro-batches without no_sync()"),
    case(RANK, WORLD_SIZE, 2, 1, 2, 2, False, False,
         label="2 ranks, ZeRO-1, 2 micro-batches without no_sync()"),
    case(RANK, WORLD_SIZE, 4, 1, 2, 1, False, True,
         label="4 ranks, ZeRO-1, a parameter without gradient"),
    case(RANK, WORLD_SIZE, 2, 2, 2, 1, False, True,
         label="2 ranks, ZeRO-2, a parameter without gradient"),
]
assert {c.args[2] for c in _ZERO_CASES} == set(SUB_WORLDS)

_ZERO_HINTS = {
    "on_grad_ready": (
        "Every rank must start the same reduce-scatters in the same order, each as early as "
        "that order allows; stage 2 keeps no full gradient once it is in its bucket; inside "
        "no_sync() nothing is reduced.",
        "A picture: buckets 0, 1 and 2; bucket 2 completes first and waits; when bucket 0 "
        "completes it starts; when bucket 1 completes, 1 and 2 start. Stage 2's flat gradient "
        "is padded like the bucket's parameters, and the micro-batches of no_sync() add up "
        "in it."),
    "finish_backward": (
        "After backward every bucket has been reduced, also those that a parameter without "
        "gradient held back, and each shard's gradient counts every backward since the "
        "gradients were last zeroed exactly once.",
        "Stage 1 reduces autograd's gradients, which already hold every backward since "
        "zero_grad: its result replaces the shard's gradient. Stage 2 reduces one backward's "
        "gradients: its results add up. Nothing of the backward stays behind in the buckets."),
}

for _which, _params in (("on_grad_ready", ("zero", "p")), ("finish_backward", ("zero",))):
    register_on_sub_worlds(
        f"lesson08.{_which}", A,
        params=_params,
        cases=_ZERO_CASES,
        harness=zero_harness(_which),
        points=3,
        time_limit=20.0,  # launches out of order could hang: cut off, named
        rtol=1e-9,
        atol=1e-12,
        reference="lesson08:zero_gradient_path",
        explain="lesson08:explain_gradient_path",
        hints=_ZERO_HINTS[_which],
    )
