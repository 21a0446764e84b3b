"""Lesson 04b's checks (the DDP core): the bucket launch, the hook and the end of backward, each
trained on 2, 3 and 4 ranks in the library's DDP in place of its own, with a weight used twice
in the forward and a gradient that arrives twice in one backward. Expected values and the
reasons for wrong ones: course_lib.course.grading.references.lesson04.

Components (course_lib.ddp, ...) are imported inside the functions that use them, on
purpose: the learner's overlay decides at each call which version runs (theirs or the
reference), and a name bound at import time would keep the first one.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from course_lib.course.grading import RANK, WORLD_SIZE, case
from course_lib.course.grading.harnesses import graded_class, seeded_batch
from course_lib.course.grading.sub_worlds import SUB_WORLDS, on_first_ranks, register_on_sub_worlds
from course_lib.i18n import N_

PART_B = "04b_ddp_overlap"


# --- the DDP core: launch_bucket, on_grad_ready, finish_backward -------------------------------
# Each check trains a DDP that is the library's except for the learner's function, on the first
# 2, 3 and 4 ranks, against one process; it also records which buckets were launched, in which
# order and from where (a hook, or after backward), and the collectives they made.

_IN, _HID, _OUT, _B, _LR = 5, 6, 3, 2, 0.3
CAP_MB = 200 / 2**20  # three buckets of this float64 model: [mid], [inp], [out (+ spare)]
# The buckets when a checkpointed `mid` is used twice: [mid, inp], [out], so that a gradient of
# mid's that arrives twice could make the first bucket look complete before inp's arrives.
TWICE_CAP_MB = 600 / 2**20


class Net(nn.Module):
    """Registered out of forward order, so the last bucket is complete first and must wait for
    buckets 0 and 1; `spare` is absent, used on no rank, or used on rank 0 only. `twice`: "" (mid
    used once), "tied" (mid applied twice: autograd sums both uses before its hook runs once) or
    "reentrant" (each use of mid in its own reentrant checkpoint: its gradient arrives twice)."""

    def __init__(self, spare: str, twice: str = ""):
        super().__init__()
        torch.manual_seed(0)
        if spare != "absent":
            self.spare = nn.Linear(2, 2)
        self.out = nn.Linear(_HID, _OUT)
        self.inp = nn.Linear(_IN, _HID)
        self.mid = nn.Linear(_HID, _HID)
        self.double()
        self.spare_mode, self.twice = spare, twice

    def _mid(self, h: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.mid(h))

    def forward(self, x: torch.Tensor, rank: int) -> torch.Tensor:
        h = torch.tanh(self.inp(x))
        if self.twice == "reentrant":
            h = checkpoint(self._mid, checkpoint(self._mid, h, use_reentrant=True),
                           use_reentrant=True)
        else:
            h = self._mid(h) if self.twice != "tied" else self._mid(self._mid(h))
        y = self.out(h)
        if self.spare_mode == "rank 0" and rank == 0:
            y = y + 0.1 * self.spare(x[:, :2]).sum()
        return y


def batch(step: int, size: int):
    return seeded_batch(50 + step, size, _IN, _OUT)


def _graded(which: str, fn):
    """The library's DDP with the learner's `fn` as `which`, logging every bucket launch."""
    from course_lib.ddp import DistributedDataParallel

    return graded_class(DistributedDataParallel, which, fn)


FIRST_GRAD = "out.weight.grad after the first backward"
SPARE_GRADS = "spare.weight.grad after each backward"


def _ddp_body(dist, rank: int, fn, which: str, steps: int, spare: str, set_to_none: bool,
              twice: str = ""):
    k = dist.get_world_size()
    model = Net(spare, twice)
    ddp = _graded(which, fn)(model, bucket_cap_mb=CAP_MB, first_bucket_cap_mb=None,
                             find_unused_parameters=spare != "absent", dist=dist)
    opt = torch.optim.SGD(model.parameters(), lr=_LR)
    launches, collectives, spare_grads = [], [], []
    for step in range(steps):
        dist.reset()
        x, y = batch(step, k * _B)
        nn.functional.mse_loss(ddp(x[rank::k], rank), y[rank::k]).backward()
        launches.append(list(ddp.launches))
        collectives.append(list(dist.log))
        ddp.launches.clear()
        if spare != "absent":
            grad = model.spare.weight.grad
            spare_grads.append(None if grad is None else grad.clone())
        if step == 0:
            first = model.out.weight.grad.clone()
        opt.step()
        opt.zero_grad(set_to_none=set_to_none)
    out = {FIRST_GRAD: first,
           "weights": torch.cat([p.detach().reshape(-1) for p in model.parameters()]),
           "bucket launches per step": launches, "collectives per step": collectives}
    if spare != "absent":
        out[SPARE_GRADS] = spare_grads
    return out


def _error_body(dist, rank: int, fn, which: str):
    """`spare` gets no gradient and find_unused_parameters is off: backward must say which."""
    ddp = _graded(which, fn)(Net("nowhere"), bucket_cap_mb=CAP_MB, first_bucket_cap_mb=None,
                             dist=dist)
    x, y = batch(0, dist.get_world_size() * _B)
    try:
        nn.functional.mse_loss(ddp(x[:_B], rank), y[:_B]).backward()
    except RuntimeError as e:
        return {"backward raised, naming spare.weight": "spare.weight" in str(e)}
    return {"backward raised, naming spare.weight": False}


TWICE_RAISED = "backward raised, naming a parameter of mid"
TWICE_EARLY = "gradients not there yet when their bucket was launched"


def _twice_body(dist, rank: int, fn, which: str):
    """mid runs in two reentrant checkpoints: each replays its part of backward, so mid's
    gradient reaches the hook twice. Its bucket, [mid, inp], must not count mid's first part as
    complete (no launch before the error), and backward must stop, naming the parameter."""
    k = dist.get_world_size()
    model, arrived = Net("absent", "reentrant"), set()
    for name, q in model.named_parameters():  # before DDP's hooks, so they run first
        q.register_post_accumulate_grad_hook(lambda q, name=name: arrived.add(name))
    ddp = _graded(which, fn)(model, bucket_cap_mb=TWICE_CAP_MB, first_bucket_cap_mb=None,
                             dist=dist)
    early: list[str] = []
    launch = ddp.launch

    def launch_noting_missing(bucket):
        early.extend(ddp.names[id(q)] for q in bucket.params if ddp.names[id(q)] not in arrived)
        launch(bucket)

    ddp.launch = launch_noting_missing
    x, y = batch(0, k * _B)
    raised = False
    try:
        nn.functional.mse_loss(ddp(x[rank::k], rank), y[rank::k]).backward()
    except RuntimeError as e:
        raised = "mid." in str(e)
    return {TWICE_RAISED: raised, "bucket launches": list(ddp.launches), TWICE_EARLY: early}


def ddp_harness(which: str):
    def harness(fn, rank: int, world_size: int, k: int, *args):
        if args == ("error",):
            return on_first_ranks(k, _error_body, fn, which)
        if args == ("arrives twice",):
            return on_first_ranks(k, _twice_body, fn, which)
        return on_first_ranks(k, _ddp_body, fn, which, *args)
    return harness


_DDP_CASES = [
    case(RANK, WORLD_SIZE, 2, 3, "absent", True, label="2 ranks, 3 steps"),
    case(RANK, WORLD_SIZE, 3, 3, "absent", False, label="3 ranks, zero_grad(set_to_none=False)"),
    case(RANK, WORLD_SIZE, 4, 2, "nowhere", True,
         label="4 ranks, find_unused_parameters, spare used on no rank"),
    case(RANK, WORLD_SIZE, 3, 3, "rank 0", True,
         label="3 ranks, find_unused_parameters, spare used on rank 0 only"),
    case(RANK, WORLD_SIZE, 2, "error", label="2 ranks, spare unused without find_unused_parameters"),
]
# The hook's own cases: a parameter used twice in the forward, on 2, 3 and 4 ranks.
_TWICE_CASES = [
    case(RANK, WORLD_SIZE, 3, 2, "absent", True, "tied",
         label="3 ranks, mid used twice in the forward (one hook call, after both uses)"),
    case(RANK, WORLD_SIZE, 2, "arrives twice",
         label="2 ranks, mid in two reentrant checkpoints: its gradient arrives twice"),
    case(RANK, WORLD_SIZE, 4, "arrives twice",
         label="4 ranks, mid in two reentrant checkpoints: its gradient arrives twice"),
]
assert {c.args[2] for c in _DDP_CASES} == {c.args[2] for c in _TWICE_CASES} == set(SUB_WORLDS)

_DDP_HINTS = {
    "launch_bucket": (
        N_("One asynchronous all_reduce of the bucket's whole flat buffer, returned as its Work: "
           "the hook that calls it must not wait. With find_unused_parameters, the flags that say who "
           "used each parameter travel in the same message."),
        N_("Before launching: every parameter that is not in the ready set gets its slice staged "
           "now (it may have no gradient at all); with find_unused_parameters, write one flag per "
           "parameter after the gradient elements, 1 where this rank used it, else 0. Then launch "
           "and hand back the work.")),
    "on_grad_ready": (
        N_("The hook does three things for its parameter: note, once per backward, that backward "
           "has begun (and have the end of backward called later); put the gradient into its "
           "bucket slice; start every bucket that is now complete and next in line."),
        N_("In the first hook, set the flag and queue the wrapper's end of backward with the "
           "autograd engine. Then refuse a parameter that is already ready (name it), mark it "
           "ready, stage its gradient into its view with the wrapper's divisor, make the view its "
           "gradient, and launch what your launch-order function allows, moving the launch "
           "position past each bucket.")),
    "finish_backward": (
        N_("When backward ends, every bucket must have been launched exactly once, in bucket "
           "order, and every gradient must be an averaged slice; a parameter that never got a "
           "gradient is an error, unless find_unused_parameters says it may happen."),
        N_("Look at the buckets not launched yet: gather the names of their parameters that are "
           "not ready, and raise with them and the rank unless unused parameters are allowed; "
           "launch those buckets; then wait for each bucket's work and point each parameter's "
           "gradient at its view, skipping, with find_unused_parameters, a parameter whose flag "
           "slot counted no rank.")),
}

for _which, _params in (("launch_bucket", ("ddp", "bucket")), ("on_grad_ready", ("ddp", "p")),
                        ("finish_backward", ("ddp",))):
    register_on_sub_worlds(
        f"lesson04.{_which}", PART_B,
        params=_params,
        cases=_DDP_CASES + (_TWICE_CASES if _which == "on_grad_ready" else []),
        reference="lesson04:ddp",
        explain="lesson04:explain_ddp",
        harness=ddp_harness(_which),
        points=3,
        time_limit=15.0,  # a case takes under a second idle, seconds on a loaded laptop;
        # launches out of order hang
        rtol=1e-9,
        atol=1e-12,
        hints=_DDP_HINTS[_which],
    )
