"""Lesson 08a's expected values and explanations (ZeRO): shard bounds, the reduce-scatter, the
all-gather, the ZeRO-1 step, and the gradient path, whose expected values come from plain
PyTorch on the whole batch in one process and the launch order its buckets allow.

Components (course_lib.data_parallel, ...) are imported inside the functions that use them, on
purpose: the learner's overlay decides at each call which version runs (theirs or the
reference), and a name bound at import time would keep the first one.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from course_lib.course.grading.exercises.lesson08 import zero as ex
from course_lib.course.grading.references.lesson08.common import _calls_reason, _close, _ranks, _t
from course_lib.i18n import N_, _


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
            N_("launches in each backward: (bucket, gradients ready then)"): launches,
            N_("after the last backward"): {
                N_("full gradients in p.grad"): 0 if stage == 2 else with_grad,
                N_("buckets still holding a flat gradient or a reduction"): 0}}


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
