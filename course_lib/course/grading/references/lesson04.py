"""Lesson 04's expected values and the reasons for wrong ones (judge side: see this package's
docstring). Parts 04a (broadcast, averaging, buckets, launch order) and 04b (the DDP core)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from course_lib.course.grading.exercises.lesson04 import (CAP_MB, FIRST_GRAD, SPARE_GRADS,
                                                    TWICE_EARLY, TWICE_RAISED, Net, batch,
                                                    grad_of, state_of)
from course_lib.i18n import _

_LR = 0.3
MiB = 2**20


def _close(a: Any, b: Any) -> bool:
    return (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.shape == b.shape
            and a.dtype == b.dtype and torch.allclose(a.double(), b.double(), rtol=1e-5, atol=1e-8))


# -- 04a: broadcast_coalesced ------------------------------------------------------------------

def broadcast_coalesced(rank: int, world_size: int, k: int, specs: list, src: int):
    if rank >= k:
        return None
    return {"tensors": state_of(src, specs),
            "collectives": {"broadcast": len({dt for _, dt in specs})}}


def explain_broadcast(case, rank, expected, got) -> str | None:
    k, specs, src = case.args[2:]
    sent = got.get("collectives", {}).get("broadcast", 0)
    want = expected["collectives"]["broadcast"]
    tensors = got.get("tensors", [])
    for i, (t, e) in enumerate(zip(tensors, expected["tensors"])):
        if isinstance(t, torch.Tensor) and t.dtype != e.dtype:
            return _("tensor {i} came back as {got}, but it is {dtype}: every tensor must "
                     "keep its own dtype through the broadcast", i=i,
                     got=t.dtype, dtype=e.dtype)
    if not all(_close(t, e) for t, e in zip(tensors, expected["tensors"])):
        for r in range(k):
            if all(_close(t, e) for t, e in zip(tensors, state_of(r, specs))):
                if r == rank:
                    return _("this rank kept its own tensors: rank {src}'s never arrived", src=src)
                return _("this rank holds rank {r}'s tensors; they come from src, rank {src}", r=r, src=src)
        return _("this rank holds values that are no rank's tensors: a piece of the buffer came back "
                 "into the wrong tensor or place, or changed on the way")
    if sent != want:
        return _("this rank made {sent} broadcast(s) for {n} tensors of {want} dtype(s): one message "
                 "per dtype, not per tensor", sent=sent, n=len(specs), want=want)
    return None


# -- 04a: allreduce_grads_per_param, allreduce_grads_flat ----------------------------------------

def _averaged(rank: int, k: int, shapes: list, messages: int) -> dict | None:
    if rank >= k:
        return None
    return {"grads": [sum(grad_of(r, tuple(s), i) for r in range(k)) / k
                      for i, s in enumerate(shapes)],
            "collectives": {"all_reduce": messages}}


def averaged_per_param(rank: int, world_size: int, k: int, shapes: list):
    return _averaged(rank, k, shapes, len(shapes))


def averaged_flat(rank: int, world_size: int, k: int, shapes: list):
    return _averaged(rank, k, shapes, 1)


def explain_averaged(case, rank, expected, got) -> str | None:
    k, shapes = case.args[2:]
    grads, want = got.get("grads", []), expected["grads"]
    calls = got.get("collectives", {}).get("all_reduce", 0)
    if len(grads) == len(want) and not all(_close(g, e) for g, e in zip(grads, want)):
        if all(_close(g, e * k) for g, e in zip(grads, want)):
            return _("each gradient is the sum over the {k} ranks, not their average: "
                     "all_reduce adds", k=k)
        own = [grad_of(rank, tuple(s), i) for i, s in enumerate(shapes)]
        if all(_close(g, o) for g, o in zip(grads, own)):
            return _(".grad still holds this rank's own gradient: the averages never "
                     "reached the parameters")
        total = torch.cat([(e * k).reshape(-1).double() for e in want])
        mine = torch.cat([g.reshape(-1).double() for g in grads if isinstance(g, torch.Tensor)])
        if mine.shape == total.shape and mine.abs().max() > 0:
            ratio = total[mine.abs().argmax()] / mine[mine.abs().argmax()]
            if torch.allclose(mine * ratio, total, rtol=1e-4, atol=1e-6):
                return _("each gradient is the sum over the ranks divided by {d}, not by "
                         "the {k} ranks of the group", d=f"{ratio.item():g}", k=k)
        return None
    if calls != expected["collectives"]["all_reduce"]:
        if expected["collectives"]["all_reduce"] == 1:
            return _("right averages, but {calls} all_reduce calls for {n} parameters: one "
                     "flat buffer goes in one call", calls=calls, n=len(shapes))
        return _("right averages, but {calls} all_reduce call(s) for {n} parameters: this "
                 "step reduces each parameter on its own", calls=calls,
                 n=len(shapes))
    return None


# -- 04a: make_buckets -------------------------------------------------------------------------

def make_buckets(sizes: list, bucket_cap_mb: float, first_bucket_cap_mb) -> list | str:
    """Indices of the parameters of `sizes` (numel, dtype name) in each bucket: backwards, a new
    bucket at a dtype change, a bucket closed once it reaches its cap."""
    if not bucket_cap_mb > 0:
        return "raises ValueError"
    buckets: list[list[int]] = [[]]
    held = 0
    cap = (bucket_cap_mb if first_bucket_cap_mb is None else first_bucket_cap_mb) * MiB
    for i in reversed(range(len(sizes))):
        if buckets[-1] and sizes[i][1] != sizes[buckets[-1][0]][1]:
            buckets.append([])
            held, cap = 0, bucket_cap_mb * MiB
        buckets[-1].append(i)
        held += sizes[i][0] * torch.empty(0, dtype=getattr(torch, sizes[i][1])).element_size()
        if held >= cap:
            buckets.append([])
            held, cap = 0, bucket_cap_mb * MiB
    return [b for b in buckets if b]


def _nbytes(sizes: list, bucket: list) -> int:
    return sum(sizes[i][0] * torch.empty(0, dtype=getattr(torch, sizes[i][1])).element_size()
               for i in bucket)


def explain_buckets(case, rank, expected, got) -> str | None:
    sizes, cap_mb, first_mb = case.args
    if expected == "raises ValueError":
        return _("bucket_cap_mb={cap} cannot hold anything, and a ValueError was expected",
                 cap=cap_mb)
    if got == "raises ValueError":
        return _("raised ValueError for caps that are valid")
    if not isinstance(got, list) or not all(isinstance(b, list) for b in got):
        return None
    for n, bucket in enumerate(got):
        if len({sizes[i][1] for i in bucket if 0 <= i < len(sizes)}) > 1:
            return _("bucket {n} mixes dtypes: one flat buffer holds one dtype", n=n)
    if got and got[0] and 0 in got[0] and len(sizes) > 1:
        return _("the first bucket holds the first parameter registered, whose gradient backward "
                 "produces last: it could start only once backward is over, and the parameters "
                 "are not in reverse order")
    for n, bucket in enumerate(got[:-1]):
        cap = (first_mb if n == 0 and first_mb is not None else cap_mb) * MiB
        if _nbytes(sizes, bucket) < cap and (n + 1 >= len(got) or sizes[got[n + 1][0]][1]
                                             == sizes[bucket[0]][1]):
            return _("bucket {n} closed at {held} bytes, before reaching its cap of {cap} bytes: "
                     "a bucket closes once the parameter that reaches the cap is in it", n=n,
                     held=_nbytes(sizes, bucket), cap=round(cap))
    if got and expected and first_mb is not None and got[0] != expected[0]:
        return _("the first bucket's cap is first_bucket_cap_mb ({first} MiB), the others' "
                 "bucket_cap_mb ({cap} MiB)", first=first_mb, cap=cap_mb)
    return None


# -- 04a: buckets_to_launch --------------------------------------------------------------------

def buckets_to_launch(next_bucket: int, complete: list) -> list:
    found = []
    for i in range(next_bucket, len(complete)):
        if not complete[i]:
            break
        found.append(i)
    return found


def explain_launch_order(case, rank, expected, got) -> str | None:
    next_bucket, complete = case.args
    if not isinstance(got, list):
        return None
    early = [i for i in got if isinstance(i, int) and i < next_bucket]
    if early:
        return _("bucket {i} was launched already: next_bucket is {n}", i=early[0], n=next_bucket)
    gap = next((i for i in range(next_bucket, len(complete)) if not complete[i]), None)
    later = [i for i in got if isinstance(i, int) and gap is not None and i > gap]
    if later:
        return _("bucket {gap} is not complete, yet bucket {i} after it starts: ranks whose "
                 "gradients arrive in other orders would start different all_reduces", gap=gap,
                 i=later[0])
    if expected and not got:
        return _("bucket {n} is complete and next in line: it may start now", n=next_bucket)
    return None


# -- 04b: the DDP core -------------------------------------------------------------------------

def _layout(model: nn.Module, cap_mb: float) -> list[list[str]]:
    """The names in each bucket of `model` (reverse registration order, one dtype, closed once
    a bucket reaches `cap_mb`), as the library's make_buckets lays them out."""
    named = list(model.named_parameters())
    sizes = [(p.numel(), str(p.dtype).removeprefix("torch.")) for _, p in named]
    return [[named[i][0] for i in b] for b in make_buckets(sizes, cap_mb, None)]


def ddp(rank: int, world_size: int, k: int, *args):
    """One process on the mean of every rank's loss; the launches and collectives a correct
    DDP makes: every bucket from the hook that completes it, in bucket order, except those a
    never-ready parameter holds back to the end of backward; one async all_reduce each."""
    if rank >= k:
        return None
    if args == ("error",):
        return {"backward raised, naming spare.weight": True}
    if args == ("arrives twice",):
        return {TWICE_RAISED: True, "bucket launches": [], TWICE_EARLY: []}
    steps, spare, _set_to_none, *twice = args
    model = Net(spare, *twice)
    opt = torch.optim.SGD(model.parameters(), lr=_LR)
    spare_grads = []
    for step in range(steps):
        x, y = batch(step, k * 2)
        loss = sum(nn.functional.mse_loss(model(x[r::k], r), y[r::k]) for r in range(k)) / k
        loss.backward()
        if spare != "absent":
            grad = model.spare.weight.grad
            spare_grads.append(None if spare == "nowhere" else grad.clone())
        if step == 0:
            first = model.out.weight.grad.clone()
        opt.step()
        opt.zero_grad()
    buckets = _layout(model, CAP_MB)
    unused_here = spare == "nowhere" or (spare == "rank 0" and rank != 0)
    held = [unused_here and any(n.startswith("spare") for n in b) for b in buckets]
    launches = [(i, "after backward" if any(held[:i + 1]) else "from a hook")
                for i in range(len(buckets))]
    flags = 0 if spare == "absent" else 1
    params = dict(model.named_parameters())
    numels = [sum(params[n].numel() + flags for n in b) for b in buckets]
    out = {FIRST_GRAD: first,
           "weights": torch.cat([p.detach().reshape(-1) for p in model.parameters()]),
           "bucket launches per step": [launches] * steps,
           "collectives per step": [[("all_reduce", n, True) for n in numels]] * steps}
    if spare != "absent":
        out[SPARE_GRADS] = spare_grads
    return out


def _local_first_grad(rank: int, k: int, spare: str, twice: str) -> torch.Tensor:
    """out.weight's gradient of this rank's own loss at the first step, before any averaging."""
    model = Net(spare, twice)
    x, y = batch(0, k * 2)
    nn.functional.mse_loss(model(x[rank::k], rank), y[rank::k]).backward()
    return model.out.weight.grad


def _explain_first_grad(case, rank: int, expected: dict, got: dict) -> str | None:
    g, want = got.get(FIRST_GRAD), expected[FIRST_GRAD]
    if not isinstance(g, torch.Tensor) or _close(g, want):
        return None
    k, _steps, spare, _set_to_none, *twice = case.args[2:]
    local = _local_first_grad(rank, k, spare, twice[0] if twice else "")
    if _close(g, want * k):
        return _("after backward, out.weight's gradient is the sum over the {k} ranks, not "
                 "their average: all_reduce adds", k=k)
    if _close(g, local / k):
        return _("after backward, out.weight's gradient is this rank's own gradient "
                 "divided by {k}: the all_reduce's sum had not landed (a bucket's result is "
                 "there only once its work is waited for)", k=k)
    if _close(g, local):
        return _("after backward, out.weight's gradient is this rank's own, never "
                 "averaged")
    return _("after backward, out.weight's gradient is not the average over the ranks "
             "(a stale slice, or one staged twice?)")


def _explain_collectives(want: list, got: list) -> str | None:
    for step, (w, g) in enumerate(zip(want, got)):
        if w == g:
            continue
        g = [tuple(c) for c in g]
        if sorted(g) == sorted(tuple(c) for c in w):
            return None  # the same collectives in another order: the launches say why
        if any(not c[2] for c in g if len(c) == 3):
            return _("step {step}: an all_reduce was blocking (not async_op): backward "
                     "waits for it instead of going on", step=step)
        if len(g) > len(w):
            return _("step {step}: {n} all_reduce calls for {b} buckets: one collective "
                     "per bucket, on its whole flat buffer", step=step, n=len(g),
                     b=len(w))
        for (_n, wn, _a), c in zip(w, g):
            if len(c) == 3 and c[1] != wn:
                return _("step {step}: an all_reduce of {got} elements where the bucket's "
                         "flat buffer has {want}: the gradients and the flag slots travel in one "
                         "message", step=step, got=c[1], want=wn)
        return None
    return None


def _explain_launches(want: list, got: list) -> str | None:
    for step, (w, g) in enumerate(zip(want, got)):
        g = [tuple(x) for x in g]
        if [tuple(x) for x in w] == g:
            continue
        order = [i for i, _where in g]
        if order != sorted(order):
            return _("step {step}: buckets launched in the order {order}: every rank must "
                     "start them in bucket order, or each all_reduce meets the wrong partner", step=step, order=order)
        if len(set(order)) != len(order):
            return _("step {step}: a bucket was launched twice", step=step)
        late = [i for (i, where), (_j, should) in zip(g, w)
                if where == "after backward" and should == "from a hook"]
        if late:
            return _("step {step}: bucket {i} was launched only after backward, though a "
                     "hook completed it during backward: no overlap", step=step,
                     i=late[0])
        if len(g) < len(w):
            return _("step {step}: {n} of {b} buckets were launched", step=step,
                     n=len(g), b=len(w))
        return None
    return None


def explain_ddp(case, rank, expected, got) -> str | None:
    if not isinstance(got, dict):
        return None
    if "backward raised, naming spare.weight" in expected:
        return _("spare got no gradient and find_unused_parameters is off: backward must "
                 "stop with an error that names spare.weight")
    if TWICE_RAISED in expected:
        early = got.get(TWICE_EARLY) or []
        if early:
            return _("mid's gradient reached the hook twice and was counted as two ready "
                     "gradients: bucket 0 was launched before {names} arrived",
                     names=", ".join(sorted(set(early))))
        if got.get(TWICE_RAISED) is False and got.get("bucket launches"):
            return _("mid's gradient reached the hook twice in one backward (two "
                     "reentrant checkpoints), and bucket 0 went out with a gradient that is not "
                     "torch's: a gradient that arrives twice must stop backward, naming the "
                     "parameter")
        if got.get(TWICE_RAISED) is False:
            return _("mid's gradient reached the hook twice in one backward and backward "
                     "went on: it must stop, naming the parameter")
        return _("a bucket was launched before the error, while mid's gradient was "
                 "incomplete")
    why = _explain_collectives(expected.get("collectives per step", []),
                               got.get("collectives per step", []))
    why = why or _explain_first_grad(case, rank, expected, got)
    why = why or _explain_launches(expected.get("bucket launches per step", []),
                                   got.get("bucket launches per step", []))
    if why:
        return why
    for step, (w, g) in enumerate(zip(expected.get(SPARE_GRADS, []), got.get(SPARE_GRADS, []))):
        if w is None and g is not None:
            return _("no rank used spare, yet it got a gradient: a parameter no rank used "
                     "keeps its .grad as it was (None)")
        if w is not None and g is None:
            return _("spare was used on rank 0 only, yet it got no gradient here: every "
                     "rank takes the average over the ranks")
        if w is not None and not _close(g, w):
            return _("step {step}: spare's averaged gradient is wrong: a rank that did not use "
                     "it added what its slice held before, where one process counts nothing",
                     step=step)
    if not _close(got.get("weights"), expected["weights"]):
        return _("the weights after training differ from one process on the whole "
                 "batch: after each backward, every .grad must be the gradient averaged over "
                 "the ranks")
    return None
