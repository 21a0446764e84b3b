"""Lesson 08b's checks (FSDP): the unit's gather, its post-backward reduction, `settle`, the
prefetch order and the unit's hooks (`pre_forward`, `post_forward`, `pre_backward`), the hooks
checked by training the library's `fully_shard` with the learner's hook in its place. Expected
values and explanations: `course_lib/course/grading/references/lesson08/fsdp.py`.

Components (course_lib.fsdp, ...) are imported inside the functions that use them, on purpose:
the learner's overlay decides at each call which version runs (theirs or the reference), and a
name bound at import time would keep the first one.
"""

from __future__ import annotations

from types import SimpleNamespace

import torch
from torch import nn

from course_lib.course.grading import RANK, WORLD_SIZE, Exercise, case, register
from course_lib.course.catalogue import CheckTimeout
from course_lib.course.grading.exercises.lesson08.common import B, _error, register_on_sub_worlds
from course_lib.course.grading.sub_worlds import on_first_ranks
from course_lib.i18n import N_


# --- lesson08.unshard and lesson08.reduce_unit_grad --------------------------------------------


def _unit(dist, rank: int, numels: list):
    """A _FlatParam over parameters of `numels` elements whose shard values name the rank."""
    from course_lib.fsdp import _FlatParam

    k = dist.get_world_size()
    params = [torch.nn.Parameter(torch.arange(n, dtype=torch.float64) + 10 * i)
              for i, n in enumerate(numels)]
    mod = torch.nn.Module()
    entries = [(mod, f"p{i}", i) for i in range(len(params))]
    flat = _FlatParam(entries, params, k, rank)
    with torch.no_grad():
        flat.shard.add_(1000 * rank)  # each rank's shard now differs: the gather must use it
    return flat, mod


def _unshard_body(dist, rank: int, fn, numels: list) -> dict:
    flat, _ = _unit(dist, rank, numels)
    version = flat.full._version
    work = fn(flat, dist=dist, async_op=True)
    if work is not None:
        work.wait()
    ok = flat.full.untyped_storage().nbytes() == flat.nbytes
    full = flat.full.detach().clone() if ok else torch.empty(0)
    return {"gathered": full[:flat.layout.numel], "storage regrown": ok,
            "full's version unchanged (autograd's saved views stay valid)":
                flat.full._version == version, "calls": dict(dist.calls)}


def unshard_harness(fn, rank: int, world_size: int, k: int, numels: list):
    return on_first_ranks(k, _unshard_body, fn, numels)


register_on_sub_worlds(
    "lesson08.unshard", B,
    params=("flat",),
    cases=[case(RANK, WORLD_SIZE, k, numels, label=f"{k} ranks, parameters of {numels}")
           for k, numels in ((2, [3, 4]), (3, [5, 2, 7]), (4, [6]))],
    harness=unshard_harness,
    points=2,
    hints=("The buffer must be whole again, every rank's shard in rank order, without autograd "
           "noticing that it was refilled.",
           "Its storage was resized to nothing: give it its size back first. Then write "
           "through the second tensor on that storage, so that the version counter of the one "
           "autograd saved views of stays where it was."),
)


def _reduce_body(dist, rank: int, fn, numels: list) -> dict:
    flat, _ = _unit(dist, rank, numels)
    flat.full.untyped_storage().resize_(flat.nbytes)  # gathered, as after a forward
    flat.gathered = True
    grad = torch.arange(flat.layout.padded_numel, dtype=torch.float64) * (rank + 1)
    flat.full.grad = grad
    work, reduced, _kept = fn(flat, dist=dist)
    freed = flat.full.untyped_storage().nbytes() == 0
    work.wait()
    return {"reduced shard": reduced, "gathered parameters freed": freed,
            "full gradient dropped": flat.full.grad is None, "calls": dict(dist.calls)}


def reduce_harness(fn, rank: int, world_size: int, k: int, numels: list):
    return on_first_ranks(k, _reduce_body, fn, numels)


register_on_sub_worlds(
    "lesson08.reduce_unit_grad", B,
    params=("flat",),
    cases=[case(RANK, WORLD_SIZE, k, numels, label=f"{k} ranks, parameters of {numels}")
           for k, numels in ((2, [3, 4]), (3, [5, 2, 7]), (4, [9]))],
    harness=reduce_harness,
    points=2,
    hints=("After a unit's backward nothing of the unit stays whole on this rank: the gradient "
           "leaves, averaged, with only this rank's shard of it kept, and the gathered "
           "parameters go too.",
           "The communication still reads the full gradient when the function returns: hand "
           "it back to the caller rather than letting it go."),
)


# --- lesson08.settle ---------------------------------------------------------------------------


def _settle_body(dist, rank: int, fn, shapes: list, keep: int, earlier: bool) -> dict:
    k = dist.get_world_size()
    pending, flats = [], []
    for i, numels in enumerate(shapes):
        flat, _ = _unit(dist, rank, numels)
        if earlier:  # the gradient of an earlier backward, to accumulate onto
            flat.shard.grad = torch.full_like(flat.shard, 0.25 * (i + 1))
        grad = torch.arange(flat.layout.padded_numel, dtype=torch.float64) * (rank + 1) + i
        reduced = torch.full((flat.layout.shard_numel,), float("nan"), dtype=torch.float64)
        work = dist.reduce_scatter(reduced, list(grad.view(k, -1)), async_op=True)
        pending.append((flat, work, reduced, grad))
        flats.append(flat)
    schedule = SimpleNamespace(pending=list(pending))
    fn(schedule, keep)
    left = [next(i for i, p in enumerate(pending) if p[0] is entry[0])
            for entry in schedule.pending]
    return {"shard gradients": [f.shard.grad for f in flats],
            "still in flight (oldest first)": left}


def settle_harness(fn, rank: int, world_size: int, k: int, shapes: list, keep: int,
                   earlier: bool):
    return on_first_ranks(k, _settle_body, fn, shapes, keep, earlier)


register_on_sub_worlds(
    "lesson08.settle", B,
    params=("schedule", "keep"),
    cases=[case(RANK, WORLD_SIZE, k, shapes, keep, earlier, label=label)
           for k, shapes, keep, earlier, label in (
               (2, [[3, 4], [5]], 0, False, N_("2 ranks, 2 in flight, keep 0")),
               (3, [[5, 2], [7], [4]], 1, True,
                N_("3 ranks, 3 in flight, keep 1, gradients of an earlier backward")),
               (4, [[9], [6]], 1, False, N_("4 ranks, 2 in flight, keep 1")),
               (3, [[4]], 1, False, N_("3 ranks, 1 in flight, keep 1: nothing to do")),
               (4, [[6], [3], [5]], 0, True,
                N_("4 ranks, 3 in flight, keep 0, gradients of an earlier backward")))],
    harness=settle_harness,
    points=2,
    hints=("Reductions finish oldest first, and a reduction's result exists only once its work "
           "has been waited for; a shard's gradient accumulates, as autograd's does.",
           "Treat the list as a queue: take from its front until only the newest entries, as "
           "many as asked, are left."),
)


# --- lesson08.next_unit (local: a function of the recorded order) ------------------------------

_ORDER = ["root", "b0", "b1", "b2"]

register(Exercise(
    name="lesson08.next_unit",
    notebook=B,
    params=("order", "unit", "backward"),
    cases=[
        case(_ORDER, "b0", False, label="forward, after b0"),
        case(_ORDER, "root", False, label="forward, after the root"),
        case(_ORDER, "b2", False, label="forward, after the last unit"),
        case(_ORDER, "root", True, label="backward, after the root"),
        case(_ORDER, "b2", True, label="backward, after b2"),
        case(_ORDER, "b1", True, label="backward, after b1"),
        case(_ORDER, "b0", True, label="backward, after b0"),
        case([], "b0", False, label="first iteration: no order yet"),
        case(["root"], "root", True, label="a root alone, backward"),
        case(["root", "b0"], "root", True, label="a root and one unit, backward"),
    ],
    reference="lesson08:next_unit",
    explain="lesson08:explain_next_unit",
    points=1,
    hints=("Backward visits the units in the reverse of their forward order, except the root, "
           "whose backward starts before every other unit's.",
           "Write the backward order of a root and three blocks down, then find the unit that "
           "follows the given one in it."),
))


# --- lesson08.pre_forward, post_forward, pre_backward: the unit's hooks ------------------------
# Each check trains the library's fully_shard with the learner's hook in its place on a root
# (owning a head layer) over three units, on the first 2, 3 and 4 ranks; every layer records,
# when it computes forward or backward, which units hold their gathered parameters and which
# gathers are in flight. A layer whose parameters are not gathered computes zeros instead of
# reading freed memory.

_W, _HB = 5, 2


def _holding(units: dict) -> tuple:
    gathered = tuple(n for n, u in units.items() if u.flats and all(f.gathered for f in u.flats))
    flying = tuple(n for n, u in units.items() if any(f.gathering is not None for f in u.flats))
    return gathered, flying


class _Watched(torch.autograd.Function):
    """tanh(h @ w.T + b), recording who holds parameters when it runs, either way."""

    @staticmethod
    def forward(ctx, h, w, b, who, log):
        ok = who in _holding(log.units)[0]
        log.events.append(("forward", who, *_holding(log.units)))
        out = (torch.tanh(h @ w.T + b) if ok
               else torch.zeros(h.shape[0], w.shape[0], dtype=h.dtype))
        ctx.save_for_backward(h, w, out)
        ctx.who, ctx.log = who, log
        return out

    @staticmethod
    def backward(ctx, g):
        h, w, out = ctx.saved_tensors
        log, who = ctx.log, ctx.who
        log.events.append(("backward", who, *_holding(log.units)))
        if who not in _holding(log.units)[0]:
            zeros = torch.zeros(w.shape[0], dtype=h.dtype)
            return torch.zeros_like(h), torch.zeros_like(w), zeros, None, None
        gz = g * (1 - out * out)
        return gz @ w, gz.T @ h, gz.sum(0), None, None


class _Layer(nn.Module):
    def __init__(self, who: str, n_in: int, n_out: int, log):
        super().__init__()
        self.fc = nn.Linear(n_in, n_out)
        self.who, self.log = who, log

    def forward(self, h):
        return _Watched.apply(h, self.fc.weight, self.fc.bias, self.who, self.log)


class UnitNet(nn.Module):
    """A root that owns a head layer, over three blocks; float64."""

    def __init__(self, log):
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.ModuleList([_Layer(f"b{i}", _W, _W, log) for i in range(3)])
        self.head = _Layer("root", _W, _HB, log)
        self.double()

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def hooks_body(dist, rank: int, fn, which: str, k: int, reshard: bool, steps: int = 2) -> dict:
    """Train `UnitNet` with the library's units, `fn` as hook `which`; what each step shows.
    `k` sets the global batch (k ranks' worth), whatever the size of `dist`'s world."""
    from course_lib.fsdp import FSDPUnit
    from course_lib.zero_machinery import full_state_dict

    class Graded(FSDPUnit):
        if which == "pre_forward":
            def forward_starts(self):
                fn(self)
        elif which == "post_forward":
            def forward_ends(self, output):
                fn(self, output)
        elif which == "pre_backward":
            def backward_starts(self):
                fn(self)

    world = dist.get_world_size()
    log = SimpleNamespace(units={}, events=[])
    model = UnitNet(log)
    for block in model.blocks:
        block._zero_unit = Graded(block, reshard, dist, None)
    model._zero_unit = Graded(model, reshard, dist, None)
    log.units = {"root": model._zero_unit, **{b.who: b._zero_unit for b in model.blocks}}
    opt = torch.optim.SGD(model.parameters(), lr=0.2)
    out = {"forward": [], "backward": [], "held after forward": [], "held after backward": [],
           "collectives": []}
    for step in range(steps):
        g = torch.Generator().manual_seed(90 + step)
        x = torch.randn(k * 2, _W, generator=g, dtype=torch.float64)
        y = torch.randn(k * 2, _HB, generator=g, dtype=torch.float64)
        dist.reset()
        log.events.clear()
        opt.zero_grad()
        try:
            loss = nn.functional.mse_loss(model(x[rank::world]), y[rank::world])
            out["held after forward"].append(_holding(log.units))
            loss.backward()
        except (NotImplementedError, CheckTimeout):
            raise
        except Exception as exc:  # noqa: BLE001 - what went wrong is the check's answer
            return {"raised": _error(exc)}
        out["held after backward"].append(_holding(log.units))
        out["forward"].append([e[1:] for e in log.events if e[0] == "forward"])
        out["backward"].append([e[1:] for e in log.events if e[0] == "backward"])
        out["collectives"].append({n: dist.calls[n] for n in ("all_gather", "reduce_scatter")})
        opt.step()
    full = full_state_dict(model, rank0_only=False)
    out["parameters"] = torch.cat([full[n].reshape(-1) for n in sorted(full)])
    return {
        "parameters after 2 steps": out["parameters"],
        "at each forward: (unit, units gathered, gathers in flight)": out["forward"],
        "at each backward: (unit, units gathered, gathers in flight)": out["backward"],
        "after forward: (units gathered, gathers in flight)": out["held after forward"],
        "after backward: (units gathered, gathers in flight)": out["held after backward"],
        "collectives per step": out["collectives"],
    }


def hooks_harness(which: str):
    def harness(fn, rank: int, world_size: int, k: int, reshard: bool):
        return on_first_ranks(k, hooks_body, fn, which, k, reshard)
    return harness


_HOOK_CASES = [
    case(RANK, WORLD_SIZE, 2, True, label="2 ranks, reshard_after_forward=True"),
    case(RANK, WORLD_SIZE, 3, True, label="3 ranks, reshard_after_forward=True"),
    case(RANK, WORLD_SIZE, 4, True, label="4 ranks, reshard_after_forward=True"),
    case(RANK, WORLD_SIZE, 3, False, label="3 ranks, reshard_after_forward=False"),
]

_HOOK_HINTS = {
    "pre_forward": (
        "Before a unit computes, its parameters must be whole and in its modules; the next "
        "unit's gather takes time, so it should start now, while this one computes. The next "
        "iteration can prefetch only if this one leaves the forward order behind.",
        "Four things, in this order: note the unit in this iteration's order, wait for its "
        "gathers (a prefetch may have started them), point its modules at the gathered "
        "values, start the gather of the unit that comes next."),
    "post_forward": (
        "Free what nobody needs until backward, and keep what backward needs at once: the "
        "root's backward runs first.",
        "Two things decide it: whether the unit is the root, and whether it was asked to "
        "reshard after forward."),
    "pre_backward": (
        "A unit freed after its forward must be whole again before its backward reads the "
        "views autograd saved; the gather of the unit whose backward comes next should "
        "already be on its way.",
        "Much as before forward, without recording the order and without installing again "
        "(the saved views are what backward reads): wait for the gathers, then prefetch in "
        "the direction of backward."),
}

for _which in ("pre_forward", "post_forward", "pre_backward"):
    register_on_sub_worlds(
        f"lesson08.{_which}", B,
        params=("unit", "output") if _which == "post_forward" else ("unit",),
        cases=_HOOK_CASES,
        harness=hooks_harness(_which),
        points=3,
        time_limit=20.0,
        rtol=1e-9,
        atol=1e-12,
        reference="lesson08:fsdp_hooks",
        explain="lesson08:explain_hooks",
        hints=_HOOK_HINTS[_which],
    )
