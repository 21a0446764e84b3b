"""Lesson 08's expected values and explanations (judge side: see this package's docstring).

The expected values of the two training checks come from one process: the gradient path's from
plain PyTorch on the whole batch and the launch order its buckets allow; the FSDP hooks' from
the packaged `fully_shard` itself, run in a world of one rank (`_Solo`: no communication), since
which units hold their parameters when a layer computes does not depend on the world's size.

Components (course_lib.ddp, ...) are imported inside the functions that use them, on
purpose: the learner's overlay decides at each call which version runs (theirs or the
reference), and a name bound at import time would keep the first one.
"""

from __future__ import annotations

import math
from collections import Counter
from typing import Any

import torch
from torch import nn

from course_lib.course.grading.exercises import lesson08 as ex
from course_lib.i18n import N_, _


def _t(x: Any) -> torch.Tensor | None:
    return x if isinstance(x, torch.Tensor) else None


def _close(a: Any, b: Any) -> bool:
    a, b = _t(a), _t(b)
    return (a is not None and b is not None and a.shape == b.shape
            and bool(torch.allclose(a.double(), b.double(), rtol=1e-9, atol=1e-12)))


def _ranks(ranks) -> str:
    return ", ".join(str(r) for r in ranks)


# --- shard_range -------------------------------------------------------------------------------


def _shard(numel: int, world_size: int, rank: int) -> tuple[int, int]:
    size = math.ceil(numel / world_size)
    return rank * size, (rank + 1) * size


def shard_range(numel: int, world_size: int) -> dict:
    return {"ranges": [_shard(numel, world_size, r) for r in range(world_size)]}


def explain_shard_range(case, rank, expected, got) -> str | None:
    numel, world = case.args
    ranges = [tuple(r) for r in got["ranges"]]
    sizes = [b - a for a, b in ranges]
    if len(set(sizes)) > 1:
        big, small = sizes.index(max(sizes)), sizes.index(min(sizes))
        return _("rank {big} owns {n} elements and rank {small} {m}: every rank must own as many "
                 "(a reduce-scatter cuts equal chunks)", big=big, n=max(sizes), small=small,
                 m=min(sizes))
    for r in range(world - 1):
        if ranges[r][1] < ranges[r + 1][0]:
            return _("rank {r}'s range stops at {stop} and rank {s}'s starts at {start}: the "
                     "elements between belong to nobody", r=r, stop=ranges[r][1], s=r + 1,
                     start=ranges[r + 1][0])
        if ranges[r][1] > ranges[r + 1][0]:
            return _("rank {r}'s range stops at {stop} but rank {s}'s starts at {start}: two "
                     "ranks own the same elements", r=r, stop=ranges[r][1], s=r + 1,
                     start=ranges[r + 1][0])
    if ranges and ranges[0][0] != 0:
        return _("rank 0's range starts at {start}: the buffer starts at 0", start=ranges[0][0])
    covered = sizes[0] * world if sizes else 0
    if covered < numel:
        return _("the ranges cover {covered} of the {numel} elements: the last {n} belong to "
                 "nobody (the padding must make up the difference, at the end)",
                 covered=covered, numel=numel, n=numel - covered)
    if sizes and sizes[0] > math.ceil(numel / world):
        return _("every rank owns {size} elements, more than the {need} that cover the buffer "
                 "together: padding wasted", size=sizes[0], need=math.ceil(numel / world))
    return None


# --- reduce_scatter_grads ----------------------------------------------------------------------


def reduce_scatter_grads(rank: int, world_size: int, k: int, n_per_rank: int, async_op: bool):
    if rank >= k:
        return None
    total = sum(ex._values(r, n_per_rank * k) for r in range(k)) / k
    return {"shard": total[rank * n_per_rank:(rank + 1) * n_per_rank],
            "calls": {"reduce_scatter": 1}, "returned a work": True}


def _calls_reason(got: dict, want: dict, name: str) -> str | None:
    if got == want:
        return None
    if "all_reduce" in got:
        return _("an all_reduce where one {name} does: the right numbers, but the whole buffer "
                 "travels to every rank, twice the bytes", name=name)
    return _("collectives {got}, expected {want}", got=got, want=want)


def explain_reduce_scatter_grads(case, rank, expected, got) -> str | None:
    k, n, async_op = case.args[2:]
    why = _calls_reason(got["calls"], expected["calls"], "reduce_scatter")
    if why:
        return why
    if not got["returned a work"]:
        return _("with async_op=True nothing was returned to wait for")
    shard, want = _t(got["shard"]), expected["shard"]
    if shard is None or shard.shape != want.shape:
        return None
    if shard.isnan().any():
        return _("rank {rank}'s shard was never written", rank=rank)
    if _close(shard, want * k):
        if async_op:
            return _("rank {rank}'s shard holds the sum over {k} ranks, not the average: the "
                     "division ran before the reduce-scatter landed, at wait()", rank=rank, k=k)
        return _("rank {rank}'s shard holds the sum over {k} ranks, not their average",
                 rank=rank, k=k)
    total = sum(ex._values(r, n * k) for r in range(k)) / k
    for j in range(k):
        if j != rank and _close(shard, total[j * n:(j + 1) * n]):
            return _("rank {rank} holds the average of chunk {j}, which is rank {j}'s: the "
                     "chunks must be listed in rank order", rank=rank, j=j)
    return None


# --- all_gather_params -------------------------------------------------------------------------


def _ag_expected(k: int, numels: list) -> torch.Tensor:
    size = math.ceil(sum(numels) / k)
    return torch.cat([torch.arange(size, dtype=torch.float64) + 1000 * (r + 1) for r in range(k)])


def all_gather_params(rank, world_size, k, numels, async_op, own):
    if rank >= k:
        return None
    out = {"flat buffer": _ag_expected(k, numels), "calls": {"all_gather": 1}}
    if async_op:
        out["returned a work"] = True
    return out


def explain_all_gather_params(case, rank, expected, got) -> str | None:
    k, numels = case.args[2], case.args[3]
    why = _calls_reason(got["calls"], expected["calls"], "all_gather")
    if why:
        return why
    if got.get("returned a work") is False:
        return _("with async_op=True the all_gather's work must be returned")
    flat, want = _t(got["flat buffer"]), expected["flat buffer"]
    if flat is None or flat.shape != want.shape:
        return None
    size = want.numel() // k
    chunks = [flat[r * size:(r + 1) * size] for r in range(k)]
    unwritten = [r for r in range(k) if chunks[r].isnan().any()]
    if unwritten:
        return _("the chunks of rank(s) {ranks} of the flat buffer were never written: the "
                 "all-gather must write into the buffer itself", ranks=_ranks(unwritten))
    for r in range(k):
        for j in range(k):
            if j != r and _close(chunks[r], want[j * size:(j + 1) * size]):
                return _("rank {j}'s shard landed in rank {r}'s chunk: the outputs must be in "
                         "rank order", j=j, r=r)
    return None


# --- zero1_step --------------------------------------------------------------------------------


def zero1_step(rank: int, world_size: int, k: int, numels: list):
    if rank >= k:
        return None
    out = []
    for i, n in enumerate(numels):
        size = math.ceil(n / k)
        flat = torch.arange(size * k, dtype=torch.float64) + 100 * i
        for r in range(k):  # every rank stepped its own shard with gradient r + 1
            flat[r * size:(r + 1) * size] -= 0.5 * (r + 1)
        out.append(flat[:n])
    return {"flat buffers": out, "calls": {"all_gather": len(numels)}}


def explain_zero1_step(case, rank, expected, got) -> str | None:
    k, numels = case.args[2], case.args[3]
    calls, want = got["calls"], expected["calls"]
    if "all_reduce" in calls:
        return _("an all_reduce of the update: the right numbers for twice the traffic of one "
                 "all_gather per bucket")
    if calls.get("all_gather", 0) < want["all_gather"]:
        return _("{n} all_gather(s) for {m} buckets: every bucket must be gathered",
                 n=calls.get("all_gather", 0), m=want["all_gather"])
    for i, (flat, n) in enumerate(zip(got["flat buffers"], numels)):
        flat, good = _t(flat), expected["flat buffers"][i]
        if flat is None or flat.shape != good.shape:
            return None
        size = math.ceil(n / k)
        old = torch.arange(size * k, dtype=torch.float64)[:n] + 100 * i
        stale = [r for r in range(k) if r != rank and r * size < n and _close(
            flat[r * size:min((r + 1) * size, n)], old[r * size:min((r + 1) * size, n)])]
        if stale:
            return _("bucket {i}: the shards of rank(s) {ranks} hold their values from before "
                     "the step: what was gathered was not yet updated, or nothing was "
                     "gathered", i=i, ranks=_ranks(stale))
    return None


# --- the gradient path: on_grad_ready and finish_backward --------------------------------------

_LAYER_DONE = {"out": 2, "mid": 4, "inp": 6}  # gradients ready once each layer's are


def _buckets(spare: bool) -> list[list[str]]:
    from course_lib.data_parallel import make_buckets

    model = ex.ZeroNet(spare)
    names = {id(p): n for n, p in model.named_parameters()}
    return [[names[id(p)] for p in b] for b in make_buckets(list(model.parameters()),
                                                            ex._CAP_MB, None)]


def _launches(spare: bool) -> list[tuple[int, Any]]:
    """Each bucket launched once every bucket up to it is complete, from the hook that
    completes the last of them; a bucket holding a parameter without gradient (and every later
    one) after backward."""
    done = [max((_LAYER_DONE.get(n.split(".")[0]) or math.inf) for n in b)
            for b in _buckets(spare)]
    out, ready = [], 0
    for i, d in enumerate(done):
        ready = max(ready, d)
        out.append((i, "after backward" if ready == math.inf else ready))
    return out


def _trained(k: int, steps: int, micro: int, spare: bool, weights: list) -> torch.Tensor:
    """One process's parameters, micro-batch i's gradient counted weights[i] times."""
    model = ex.ZeroNet(spare)
    opt = torch.optim.SGD(model.parameters(), lr=ex._LR, momentum=0.5)
    for step in range(steps):
        x, y = ex.zero_batch(step, k * ex._B * micro)
        opt.zero_grad()
        for i in range(micro):
            loss = sum(nn.functional.mse_loss(model(x[r::k][i::micro]), y[r::k][i::micro])
                       for r in range(k)) / (k * micro)
            (loss * weights[i]).backward()
        opt.step()
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def zero_gradient_path(rank: int, world_size: int, k: int, stage: int, steps: int, micro: int,
                       no_sync: bool, spare: bool):
    if rank >= k:
        return None
    model = ex.ZeroNet(spare)
    opt = torch.optim.SGD(model.parameters(), lr=ex._LR, momentum=0.5)
    launches = []
    for step in range(steps):
        x, y = ex.zero_batch(step, k * ex._B * micro)
        opt.zero_grad()
        for i in range(micro):
            loss = sum(nn.functional.mse_loss(model(x[r::k][i::micro]), y[r::k][i::micro])
                       for r in range(k)) / (k * micro)
            loss.backward()
            launches.append([] if no_sync and i < micro - 1 else _launches(spare))
        with_grad = sum(p.grad is not None for p in model.parameters())
        opt.step()
    return {"parameters": torch.cat([p.detach().reshape(-1) for p in model.parameters()]),
            "launches in each backward: (bucket, gradients ready then)": launches,
            "after the last backward": {
                "full gradients in p.grad": 0 if stage == 2 else with_grad,
                "buckets still holding a flat gradient or a reduction": 0}}


def explain_gradient_path(case, rank, expected, got) -> str | None:
    k, stage, steps, micro, no_sync, spare = case.args[2:]
    if "backward raised" in got:
        for i, n in enumerate(got.get("flat gradient sizes") or []):
            if n is not None and n % k:
                return _("bucket {i}'s flat gradient holds {n} elements, not a multiple of {k} "
                         "ranks: without the padding's share it cannot be cut into {k} equal "
                         "chunks", i=i, n=n, k=k)
        error = got["backward raised"]
        if "NoneType" in error and "wait" in error:
            return _("a bucket was waited for that was never launched (a bucket held back by a "
                     "parameter without gradient is launched when backward ends): {error}",
                     error=error)
        return _("backward raised {error}", error=error)
    key = "launches in each backward: (bucket, gradients ready then)"
    got_l, want_l = got[key], expected[key]
    for j, (g, w) in enumerate(zip(got_l, want_l)):
        g, w = [tuple(x) for x in g], [tuple(x) for x in w]
        if g == w:
            continue
        step, micro_i = divmod(j, micro)
        where = _("step {step}, micro-batch {i}", step=step, i=micro_i)
        if not w and g:
            return _("{where}: {n} reduce-scatter(s) launched inside no_sync(): a micro-batch "
                     "before the last must only accumulate (one reduce-scatter per step, not "
                     "one per micro-batch)", where=where, n=len(g))
        order = [b for b, _w in g]
        if len(order) != len(set(order)):
            twice = sorted({b for b in order if order.count(b) > 1})
            return _("{where}: bucket(s) {b} launched more than once in one backward",
                     where=where, b=_ranks(twice))
        if sorted(order) != order:
            return _("{where}: buckets launched in the order {got}: every rank must launch them "
                     "in bucket order, or ranks pair different buckets", where=where,
                     got=_ranks(order))
        missing = [b for b, _w in w if b not in order]
        if missing:
            return _("{where}: bucket(s) {b} never launched", where=where, b=_ranks(missing))
        late = [b for (b, gw), (_b, ww) in zip(g, w) if gw == "after backward" != ww]
        if late:
            return _("{where}: bucket {b} was launched only after backward, though it was "
                     "complete after {n} gradients: a complete bucket starts from the hook, "
                     "overlapping the rest of backward", where=where, b=late[0],
                     n=dict(w)[late[0]])
        early = [b for (b, gw), (_b, ww) in zip(g, w) if gw != ww]
        if early:
            return _("{where}: bucket {b} was launched when {n} gradients were ready, expected "
                     "{m}", where=where, b=early[0], n=dict(g)[early[0]], m=dict(w)[early[0]])
        return None
    kept, want_kept = got["after the last backward"], expected["after the last backward"]
    n = kept["full gradients in p.grad"]
    if n != want_kept["full gradients in p.grad"]:
        if stage == 2:
            return _("after backward {n} parameters still hold a full gradient in p.grad: "
                     "stage 2 keeps only the reduced shard, 4/N bytes per parameter instead "
                     "of 4", n=n)
        return _("after backward {n} parameters hold a gradient in p.grad, expected {m}: "
                 "stage 1 leaves autograd's gradients where they are", n=n,
                 m=want_kept["full gradients in p.grad"])
    n = kept["buckets still holding a flat gradient or a reduction"]
    if n:
        return _("after backward {n} bucket(s) still hold their flat gradient or their "
                 "reduction: the next backward would start from them", n=n)
    if not _close(got["parameters"], expected["parameters"]):
        if micro > 1 and _close(got["parameters"],
                                _trained(k, steps, micro, spare, [0] * (micro - 1) + [1])):
            return _("the parameters are those of training on the last micro-batch of each "
                     "step alone: the earlier micro-batches' gradients were lost (stage {s}: "
                     "{why})", s=stage, why=_(_STAGE_WHY[stage]))
        if micro > 1 and _close(got["parameters"],
                                _trained(k, steps, micro, spare, [2] * (micro - 1) + [1])):
            return _("the parameters are those of training with the earlier micro-batches "
                     "counted twice (stage {s}: {why})", s=stage, why=_(_STAGE_WHY[stage]))
        return _("after {steps} steps the parameters differ from one process's on the whole "
                 "batch", steps=steps)
    return None


_STAGE_WHY = {
    1: N_("its reduced shard comes from autograd's gradients, which already hold every "
         "backward since zero_grad: it replaces the shard's gradient"),
    2: N_("each reduced shard holds one backward's gradients and they add up; inside "
         "no_sync() the micro-batches add up in the bucket's flat gradient"),
}


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
