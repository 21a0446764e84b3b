"""Lesson 08b's expected values and explanations (FSDP): the unit's gather and reduction,
`settle`, the prefetch order, and the hooks, whose expected values come from the packaged
`fully_shard` itself, run in a world of one rank (`_Solo`: no communication), since which units
hold their parameters when a layer computes does not depend on the world's size.
"""

from __future__ import annotations

import math
from collections import Counter
from typing import Any

import torch

from course_lib.course.grading.exercises.lesson08 import fsdp as ex
from course_lib.course.grading.references.lesson08.common import _calls_reason, _close, _ranks, _t
from course_lib.i18n import _


# --- unshard, reduce_unit_grad, settle ---------------------------------------------------------


def _gathered(k: int, numels: list) -> torch.Tensor:
    total = sum(numels)
    size = math.ceil(total / k)
    flat = torch.cat([torch.arange(n, dtype=torch.float64) + 10 * i for i, n in enumerate(numels)]
                     + [torch.zeros(size * k - total, dtype=torch.float64)])
    for r in range(k):
        flat[r * size:(r + 1) * size] += 1000 * r
    return flat[:total]


_VERSION = "full's version unchanged (autograd's saved views stay valid)"


def unshard(rank: int, world_size: int, k: int, numels: list):
    if rank >= k:
        return None
    return {"gathered": _gathered(k, numels), "storage regrown": True, _VERSION: True,
            "calls": {"all_gather": 1}}


def explain_unshard(case, rank, expected, got) -> str | None:
    k, numels = case.args[2], case.args[3]
    if not got["storage regrown"]:
        return _("the buffer's storage was not given back its size: it still holds 0 bytes")
    if not got[_VERSION]:
        return _("full's version counter moved: the gather wrote through full itself, and "
                 "backward would refuse the views forward saved of it")
    if "all_gather" not in got["calls"]:
        return _("no all_gather: the other ranks' shards never arrived")
    why = _calls_reason(got["calls"], expected["calls"], "all_gather")
    if why:
        return why
    full = _t(got["gathered"])
    want = expected["gathered"]
    if full is None or full.shape != want.shape:
        return None
    size = math.ceil(sum(numels) / k)
    wrong = [r for r in range(k) if r * size < want.numel() and not _close(
        full[r * size:(r + 1) * size], want[r * size:(r + 1) * size])]
    if wrong:
        return _("the chunk(s) of rank(s) {ranks} do not hold those ranks' shards",
                 ranks=_ranks(wrong))
    return None


def reduce_unit_grad(rank: int, world_size: int, k: int, numels: list):
    if rank >= k:
        return None
    size = math.ceil(sum(numels) / k)
    avg = torch.arange(size * k, dtype=torch.float64) * sum(r + 1 for r in range(k)) / k
    return {"reduced shard": avg[rank * size:(rank + 1) * size], "gathered parameters freed": True,
            "full gradient dropped": True, "calls": {"reduce_scatter": 1}}


def explain_reduce_unit_grad(case, rank, expected, got) -> str | None:
    k = case.args[2]
    if not got["gathered parameters freed"]:
        return _("the gathered parameters were not freed: after backward every unit would "
                 "stay gathered, the whole model on every rank")
    if not got["full gradient dropped"]:
        return _("the unit's full gradient is still attached to its buffer: one full gradient "
                 "per unit stays alive after backward")
    why = _calls_reason(got["calls"], expected["calls"], "reduce_scatter")
    if why:
        return why
    shard, want = _t(got["reduced shard"]), expected["reduced shard"]
    if shard is not None and _close(shard, want * k):
        return _("the reduced shard holds the sum over {k} ranks, not their average", k=k)
    return None


def settle(rank: int, world_size: int, k: int, shapes: list, keep: int, earlier: bool):
    if rank >= k:
        return None
    n_done = max(0, len(shapes) - keep)
    grads = []
    for i, numels in enumerate(shapes):
        size = math.ceil(sum(numels) / k)
        if i >= n_done:
            grads.append(torch.full((size,), 0.25 * (i + 1), dtype=torch.float64)
                         if earlier else None)
            continue
        total = sum(torch.arange(size * k, dtype=torch.float64) * (r + 1) + i for r in range(k))
        mine = total[rank * size:(rank + 1) * size]
        grads.append(mine + 0.25 * (i + 1) if earlier else mine)
    return {"shard gradients": grads,
            "still in flight (oldest first)": list(range(n_done, len(shapes)))}


def explain_settle(case, rank, expected, got) -> str | None:
    k, shapes, keep, earlier = case.args[2:]
    left, want_left = list(got["still in flight (oldest first)"]), \
        list(expected["still in flight (oldest first)"])
    if len(left) != len(want_left):
        return _("{n} reduction(s) left in flight, expected {m}: all but the newest {keep} "
                 "finish", n=len(left), m=len(want_left), keep=keep)
    if left != want_left:
        return _("reductions {got} left in flight, expected {want}: the oldest finish first",
                 got=_ranks(left), want=_ranks(want_left))
    for i, (g, w) in enumerate(zip(got["shard gradients"], expected["shard gradients"])):
        g = _t(g)
        if w is None:
            continue
        if g is None:
            return _("reduction {i} finished but its shard has no gradient", i=i)
        if g.isnan().any():
            return _("reduction {i}'s result was read before its work was waited for", i=i)
        if earlier and _close(g, w - 0.25 * (i + 1)):
            return _("reduction {i} replaced the gradient its shard already held (an earlier "
                     "backward's) instead of adding to it", i=i)
    return None


# --- next_unit ---------------------------------------------------------------------------------


def _backward_order(order: list) -> list:
    return order[:1] + order[:0:-1]


def next_unit(order: list, unit: Any, backward: bool) -> Any:
    seq = _backward_order(list(order)) if backward else list(order)
    if unit not in seq:
        return None
    i = seq.index(unit)
    return seq[i + 1] if i + 1 < len(seq) else None


def explain_next_unit(case, rank, expected, got) -> str | None:
    order, unit, backward = case.args
    if not backward:
        return _("the forward order is {order}: after {unit} comes {want}",
                 order=" ".join(map(str, order)), unit=unit, want=expected)
    forward_next = next_unit(order, unit, False)
    if got == forward_next and got != expected:
        return _("that is the forward order; backward runs {order}: after {unit} comes {want}",
                 order=" ".join(map(str, _backward_order(list(order)))), unit=unit,
                 want=expected)
    if order and unit == order[0]:
        return _("the root's backward starts first, then the units in the reverse of their "
                 "forward order: {order}", order=" ".join(map(str, _backward_order(list(order)))))
    return _("backward runs {order}: after {unit} comes {want}",
             order=" ".join(map(str, _backward_order(list(order)))), unit=unit, want=expected)


# --- the FSDP hooks: the packaged fully_shard run in a world of one ----------------------------


class _Done:
    def wait(self, timeout: Any = None) -> bool:
        return True


class _Solo:
    """A `dist` of one rank (no communication), counting collectives as CountingDist does."""

    def __init__(self):
        self.calls: Counter = Counter()

    def reset(self) -> None:
        self.calls.clear()

    def get_rank(self, group: Any = None) -> int:
        return 0

    def get_world_size(self, group: Any = None) -> int:
        return 1

    def get_global_rank(self, group: Any, group_rank: int) -> int:
        return group_rank

    def _done(self, name: str, async_op: bool) -> Any:
        self.calls[name] += 1
        return _Done() if async_op else None

    def broadcast(self, tensor, src, group=None, async_op=False):
        return self._done("broadcast", async_op)

    def all_reduce(self, tensor, op=None, group=None, async_op=False):
        return self._done("all_reduce", async_op)

    def all_gather(self, tensor_list, tensor, group=None, async_op=False):
        tensor_list[0].copy_(tensor)
        return self._done("all_gather", async_op)

    def reduce_scatter(self, output, input_list, op=None, group=None, async_op=False):
        output.copy_(input_list[0])
        return self._done("reduce_scatter", async_op)


def fsdp_hooks(rank: int, world_size: int, k: int, reshard: bool):
    if rank >= k:
        return None
    return ex.hooks_body(_Solo(), 0, None, "none", k, reshard)  # the whole batch: rank 0 of 1


_AT_FORWARD = "at each forward: (unit, units gathered, gathers in flight)"
_AT_BACKWARD = "at each backward: (unit, units gathered, gathers in flight)"
_AFTER_FORWARD = "after forward: (units gathered, gathers in flight)"
_AFTER_BACKWARD = "after backward: (units gathered, gathers in flight)"


def _names(xs) -> str:
    return ", ".join(xs) if xs else _("none")


def _unit(name: str) -> str:
    return _("the root") if name == "root" else _("unit {name}", name=name)


def _event_reason(phase: str, step: int, g, w) -> str | None:
    who, held, flying = _unit(g[0]), set(g[1]), set(g[2])
    name = g[0]
    w_held, w_flying = set(w[1]), set(w[2])
    if name in w_held and name not in held:
        if phase == "backward":
            return _("step {step}: {who}'s backward ran on parameters that were not gathered "
                     "again (they were freed after its forward)", step=step, who=who)
        return _("step {step}: {who}'s forward ran on parameters that were not gathered",
                 step=step, who=who)
    if w_flying - flying and not (w_flying - flying) <= held:
        nxt = _unit(sorted(w_flying - flying)[0])
        if flying - w_flying:
            return _("step {step}: at {who}'s {phase}, the gather in flight was that of "
                     "{got}, but {nxt} computes next", step=step, who=who, phase=phase,
                     got=_unit(sorted(flying - w_flying)[0]), nxt=nxt)
        return _("step {step}: at {who}'s {phase}, the gather of {nxt} had not started: the "
                 "unit that computes next is prefetched while this one computes",
                 step=step, who=who, phase=phase, nxt=nxt)
    if flying - w_flying:
        return _("step {step}: at {who}'s {phase}, the parameters of {got} were being "
                 "gathered, though it does not compute next", step=step, who=who, phase=phase,
                 got=_unit(sorted(flying - w_flying)[0]))
    if held - w_held - w_flying:
        return _("step {step}: at {who}'s {phase}, {extra} still held their parameters",
                 step=step, who=who, phase=phase,
                 extra=_names([_unit(n) for n in sorted(held - w_held - w_flying)]))
    if w_held - held - flying:
        return _("step {step}: at {who}'s {phase}, {gone} had freed parameters still needed",
                 step=step, who=who, phase=phase,
                 gone=_names([_unit(n) for n in sorted(w_held - held - flying)]))
    return None


def explain_hooks(case, rank, expected, got) -> str | None:
    k, reshard = case.args[2], case.args[3]
    if "raised" in got:
        return _("training raised {error}", error=got["raised"])
    for step, (g_after, w_after) in enumerate(zip(got[_AFTER_FORWARD], expected[_AFTER_FORWARD])):
        held, want = set(g_after[0]), set(w_after[0])
        if "root" in want and "root" not in held:
            return _("step {step}: the root freed its parameters after forward, though its "
                     "backward comes next: they must be gathered again at once", step=step)
        if want - held:
            return _("step {step}: after forward, {gone} had freed their parameters: with "
                     "reshard_after_forward=False they stay until backward", step=step,
                     gone=_names([_unit(n) for n in sorted(want - held)]))
        if held - want:
            return _("step {step}: after forward, {kept} still held their parameters: every "
                     "unit but the root frees them after its forward", step=step,
                     kept=_names([_unit(n) for n in sorted(held - want)]))
    for phase, key in (("forward", _AT_FORWARD), ("backward", _AT_BACKWARD)):
        for step, (gs, ws) in enumerate(zip(got[key], expected[key])):
            for g, w in zip(gs, ws):
                if tuple(g) != tuple(w) and g[0] == w[0]:
                    why = _event_reason(phase, step, g, w)
                    if why:
                        return why
            if [e[0] for e in gs] != [e[0] for e in ws]:
                return _("step {step}: the units' {phase} ran in the order {got}, expected "
                         "{want}", step=step, phase=phase, got=_names([_unit(e[0]) for e in gs]),
                         want=_names([_unit(e[0]) for e in ws]))
    for step, (g, w) in enumerate(zip(got[_AFTER_BACKWARD], expected[_AFTER_BACKWARD])):
        if tuple(map(tuple, g)) != tuple(map(tuple, w)):
            return _("step {step}: after backward, {kept} still held parameters or gathers",
                     step=step, kept=_names([_unit(n) for n in sorted(set(g[0]) | set(g[1]))]))
    for step, (g, w) in enumerate(zip(got["collectives per step"],
                                      expected["collectives per step"])):
        if g != w:
            return _("step {step}: {ag} all_gathers and {rs} reduce_scatters, expected {wag} "
                     "and {wrs}: every gather more is a unit's parameters sent again",
                     step=step, ag=g.get("all_gather", 0), rs=g.get("reduce_scatter", 0),
                     wag=w.get("all_gather", 0), wrs=w.get("reduce_scatter", 0))
    if not _close(got["parameters after 2 steps"], expected["parameters after 2 steps"]):
        return _("the parameters after 2 steps differ from one process's on the whole batch")
    return None
