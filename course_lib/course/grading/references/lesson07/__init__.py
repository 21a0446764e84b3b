"""Lesson 07's expected values and explanations (judge side: see this package's docstring).
Parts a to c are here; part d's (the interleaved order's gold lists, the backward split, the
matching rule) are in `beyond`, re-exported at the end.

Components (course_lib.ddp, ...) are imported inside the functions that use them, on
purpose: the learner's overlay decides at each call which version runs (theirs or the
reference), and a name bound at import time would keep the first one.
"""

from __future__ import annotations

from typing import Any

from course_lib.course.grading.exercises.lesson07 import (MICROBATCH, VALID, bubble_harness, describe,
                                                   link_value, model_and_batch, order_harness,
                                                   partition_harness)
from course_lib.i18n import _

# --- 07a ---------------------------------------------------------------------------------------


def bubble_fractions(spans: list) -> dict | str:
    from course_lib.pipeline_split import bubble_fractions as reference

    return bubble_harness(reference, spans)


def _fractions(spans: list, own_span: bool) -> dict:
    """Idle shares measured against the step's span, or (the mistake) each stage's own."""
    busy: dict = {}
    for rank, _action, start, end in spans:
        busy.setdefault(rank, []).append((start, end))
    step = max(e for _r, _a, _s, e in spans) - min(s for _r, _a, s, _e in spans)
    out = {}
    for rank, times in sorted(busy.items()):
        span = max(e for _s, e in times) - min(s for s, _e in times) if own_span else step
        out[rank] = round(1 - sum(e - s for s, e in times) / span, 9)
    return out


def explain_bubble(case: Any, rank: Any, expected: Any, got: Any) -> str | None:
    spans = case.args[0]
    if expected == "raises ValueError":
        return _("no events: nothing was recorded, so there is no step to measure (a "
                 "ValueError)")
    if not isinstance(got, dict):
        return None
    if sorted(got) != sorted(expected):
        return _("a fraction for each stage that has events: stages {expected}, got {got}",
                 expected=sorted(expected), got=sorted(got))
    if got == _fractions(spans, own_span=True) != expected:
        late = next(s for s in sorted(got) if abs(got[s] - expected[s]) > 1e-9)
        return _("stage {stage} idles {want:.3f} of the step, got {got:.3f}: each stage measured "
                 "against its own first start and last end; the step runs from the first start "
                 "to the last end over all stages", stage=late, want=expected[late],
                 got=got[late])
    if all(abs(got[s] - (1 - expected[s])) < 1e-6 for s in got):
        return _("these are the busy shares; the bubble is the idle share of the step")
    if len(set(got.values())) == 1 and len(set(expected.values())) > 1:
        return _("one number for every stage; the stages idle for different shares: {want}",
                 want=expected)
    wrong = next(s for s in sorted(got) if abs(got[s] - expected[s]) > 1e-6)
    return _("stage {stage} idles {want:.3f} of the step, got {got:.3f}", stage=wrong,
             want=expected[wrong], got=got[wrong])


def partition(costs: list, n_stages: int) -> dict | str:
    from course_lib.pipeline_split import partition as reference

    return partition_harness(reference, costs, n_stages)


def explain_partition(case: Any, rank: Any, expected: Any, got: Any) -> str | None:
    costs, n_stages = case.args
    if expected == "raises ValueError":
        return _("{n} layers cannot fill {k} non-empty stages: that is a ValueError",
                 n=len(costs), k=n_stages)
    if got == "raises ValueError":
        return _("{n} layers do split into {k} non-empty stages; no error here", n=len(costs),
                 k=n_stages)
    if not isinstance(got, dict):
        return None
    if got.get(VALID) is not True:
        return _("the ranges are not a split of the layers: {problem}",
                 problem=_(str(got.get(VALID))))
    if got["largest stage cost"] > expected["largest stage cost"]:
        return _("the largest stage costs {got}; a split of {costs} into {k} stages whose "
                 "largest stage costs {want} exists", got=got["largest stage cost"],
                 costs=costs, k=n_stages, want=expected["largest stage cost"])
    return None


def _stage_sizes(seed: int, n_stages: int) -> list[int]:
    from course_lib.pipeline_split import split_sequential

    model, _x, _y = model_and_batch(seed)
    return [len(list(s.parameters())) for s in split_sequential(model, n_stages)]


def full_batch_grads(seed: int, n_stages: int, n_microbatches: int) -> dict:
    """One backward of the whole batch, each stage's gradients."""
    from torch.nn import functional as F

    from course_lib.pipeline_split import split_sequential

    model, x, y = model_and_batch(seed)
    F.mse_loss(model(x), y).backward()
    return {f"stage {s} gradients": [p.grad for p in stage.parameters()]
            for s, stage in enumerate(split_sequential(model, n_stages))}


def _ratio(got: list, want: list) -> float | None:
    """The one factor by which `got` is `want` scaled, or None."""
    import torch

    if any(g is None for g in got) or len(got) != len(want):
        return None
    flat_g = torch.cat([g.flatten() for g in got])
    flat_w = torch.cat([w.flatten() for w in want])
    ratio = float(flat_g.dot(flat_w) / flat_w.dot(flat_w))
    return ratio if torch.allclose(flat_g, ratio * flat_w, rtol=1e-6, atol=1e-9) else None


def _grads_reason(stage: int, want: list, got: list, m: int, later_agree: bool = False) -> str:
    """Why one stage's gradients differ from one process's, in the lesson's terms."""
    if got is None or any(g is None for g in got):
        return _("stage {stage}'s parameters got no gradient: the backward never reached that "
                 "stage", stage=stage)
    ratio = _ratio(got, want)
    if ratio is not None and abs(ratio - m) < 1e-6 * m and m > 1:
        return _("stage {stage}'s gradients are {m} times the batch's: the loss of each of the "
                 "{m} micro-batches counts once, not 1/{m} of the batch", stage=stage, m=m)
    if ratio is not None:
        return _("stage {stage}'s gradients are {ratio:.3g} times the batch's", stage=stage,
                 ratio=ratio)
    if later_agree:
        return _("stage {stage}'s gradients differ from one process's on the whole batch, and "
                 "the stages after it agree: each micro-batch's gradient must go back through "
                 "that micro-batch's own activations", stage=stage)
    return _("stage {stage}'s gradients differ from one process's on the whole batch: each "
             "micro-batch's gradient must go back through that micro-batch's own activations",
             stage=stage)


def explain_stage_grads(case: Any, rank: Any, expected: Any, got: Any) -> str | None:
    import torch

    _seed, n_stages, m = case.args
    if not isinstance(got, dict):
        return None
    for s in reversed(range(n_stages)):  # the first wrong stage going backward
        key = f"stage {s} gradients"
        want, mine = expected[key], got.get(key)
        same = mine is not None and len(mine) == len(want) and all(
            g is not None and g.shape == w.shape and torch.allclose(g, w, 1e-9, 1e-12)
            for g, w in zip(mine, want))
        if not same:
            return _grads_reason(s, want, mine, m, later_agree=s < n_stages - 1)
    return None


# --- 07b ---------------------------------------------------------------------------------------

HEADER_BYTES = 11 * 8  # dtype code, micro-batch, ndim and 8 dims, int64


def _links(rank: int, k: int, dtype: str, m: int, skew: int, headers: bool) -> dict | None:
    """What each stage of the exercise's exchange receives and sends (see exercises/lesson07):
    the check of stage_send also sees each header; that of stage_recv, the error out of step."""
    import torch

    from course_lib.pipeline_stage import make_header

    if rank >= k:
        return None
    kind = getattr(torch, dtype)
    came = [(rank - 1, j, 1) for j in range(m)] if rank else []
    came += [(rank + 1, j, 2) for j in range(m)] if rank < k - 1 else []
    sent = [link_value(rank, j, 1, kind) for j in range(m)] if rank < k - 1 else []
    sent += [link_value(rank, j, 2, kind) for j in range(m)] if rank > 0 else []
    result: dict = {"received": [describe(link_value(s, j, tag, kind)) for s, j, tag in came]}
    if headers and came:
        result["headers"] = [make_header(link_value(s, j, tag, kind),
                                         j + skew if s == 0 and tag == 1 else j).tolist()
                             for s, j, tag in came]
    if not headers and skew and rank == 1:
        result = {"received": [], "raised": "RuntimeError"}
    result["messages sent"] = 2 * len(sent)
    result["bytes sent"] = sum(HEADER_BYTES + t.numel() * t.element_size() for t in sent)
    return result


def links_send(rank: int, world_size: int, k: int, dtype: str, m: int, post: bool,
               skew: int = 0) -> dict | None:
    return _links(rank, k, dtype, m, skew, headers=True)


def links_recv(rank: int, world_size: int, k: int, dtype: str, m: int, post: bool,
               skew: int = 0) -> dict | None:
    return _links(rank, k, dtype, m, skew, headers=False)


def explain_links(case: Any, rank: Any, expected: Any, got: Any) -> str | None:
    if expected is None or not isinstance(got, dict):
        return None
    if "raised" in expected and "raised" not in got:
        return _("stage {rank} returned a tensor although its header named micro-batch {got} "
                 "where micro-batch 0 was expected: a micro-batch out of step must be an error",
                 rank=rank, got=case.args[-1])
    if "raised" in expected and got["raised"] != expected["raised"]:
        return _("a micro-batch out of step is a RuntimeError, got {error}", error=got["raised"])
    if "raised" in got and "raised" not in expected:
        return _("stage {rank} raised {error}", rank=rank, error=got["raised"])
    for j, (g, w) in enumerate(zip(got.get("headers", []), expected.get("headers", []))):
        if g != w:
            fields = [_("dtype code"), _("micro-batch"), _("number of dimensions")]
            field = next((fields[i] if i < 3 else _("dimension {d}", d=i - 3))
                         for i, (a, b) in enumerate(zip(g, w)) if a != b) if len(g) == len(w) \
                else _("length")
            return _("header {j} received: its {field} differs ({got}, expected {want})",
                     j=j, field=field, got=g, want=w)
    mine, want = got.get("received", []), expected["received"]
    for j, (g, w) in enumerate(zip(mine, want)):
        which = _("tensor {j} received", j=j)
        if len(g) != len(w):
            return _("{which} is not a tensor", which=which)
        if g[0] != w[0]:
            return _("{which} is {got}, sent as {want}: a tensor keeps its dtype on the way",
                     which=which, got=g[0], want=w[0])
        if g[1] != w[1]:
            return _("{which} has shape {got}, sent as {want}", which=which, got=g[1], want=w[1])
        if g[2] != w[2]:
            return _("{which} holds other values than were sent", which=which)
    if len(mine) != len(want):
        return _("stage {rank}: tensors received {got}, expected {want}", rank=rank,
                 got=len(mine), want=len(want))
    if got["messages sent"] != expected["messages sent"]:
        return _("stage {rank} sent {got} messages, expected {want}: a header and a tensor per "
                 "micro-batch and neighbour", rank=rank, got=got["messages sent"],
                 want=expected["messages sent"])
    if got["bytes sent"] != expected["bytes sent"]:
        return _("stage {rank} sent {got} bytes, expected {want}: each header is {header} bytes "
                 "and each tensor its own size", rank=rank, got=got["bytes sent"],
                 want=expected["bytes sent"], header=HEADER_BYTES)
    return None


# --- 07c ---------------------------------------------------------------------------------------

def executor(rank: int, world_size: int, k: int, kind: str, m: int, seed: int) -> dict | None:
    """One process on the whole batch: each stage's gradients, the output and the losses, and
    what each stage sends (a header and a tensor per micro-batch and link, each way)."""
    from torch.nn import functional as F

    from course_lib.pipeline_split import split_sequential

    if rank >= k:
        return None
    model, x, y = model_and_batch(seed, batch=MICROBATCH * m)
    out = model(x)
    F.mse_loss(out, y).backward()
    stages = split_sequential(model, k)
    crossing, h = [], x[:MICROBATCH]  # the bytes of one micro-batch's activation at each cut
    for s in stages[:-1]:
        h = s(h)
        crossing.append(h.numel() * h.element_size())
    links = ([crossing[rank]] if rank < k - 1 else []) + ([crossing[rank - 1]] if rank else [])
    result = {"stage gradients": [p.grad for p in stages[rank].parameters()],
              "messages sent": 2 * m * len(links),
              "bytes sent": m * sum(HEADER_BYTES + n for n in links)}
    if rank == k - 1:
        result["output"] = out.detach()
        result["losses"] = [F.mse_loss(model(xc), yc).detach()
                            for xc, yc in zip(x.chunk(m), y.chunk(m))]
    return result


def explain_executor(case: Any, rank: Any, expected: Any, got: Any) -> str | None:
    import torch

    if expected is None or not isinstance(got, dict):
        return None
    m = case.args[4]
    mine, want = got.get("stage gradients"), expected["stage gradients"]
    same = isinstance(mine, list) and len(mine) == len(want) and all(
        isinstance(g, torch.Tensor) and g.shape == w.shape and torch.allclose(g, w, 1e-9, 1e-12)
        for g, w in zip(mine, want))
    if not same:
        return _grads_reason(rank, want, mine, m)
    if "losses" in expected:
        losses = got.get("losses")
        if not isinstance(losses, list) or len(losses) != m:
            return _("the last stage recorded {got} losses for {m} micro-batches",
                     got=len(losses) if isinstance(losses, list) else 0, m=m)
        if not all(torch.allclose(a, b) for a, b in zip(losses, expected["losses"])):
            return _("the recorded losses are not each micro-batch's loss (undivided)")
        if not isinstance(got.get("output"), torch.Tensor) or \
                got["output"].shape != expected["output"].shape:
            return _("the last stage's output is not the whole batch's, micro-batch after "
                     "micro-batch")
    if got.get("messages sent") != expected["messages sent"]:
        return _("stage {rank} sent {got} messages, expected {want}: each micro-batch crosses "
                 "each of this stage's links once each way, a header and a tensor",
                 rank=rank, got=got.get("messages sent"), want=expected["messages sent"])
    return None


def gpipe_order(n_microbatches: int, num_stages: int, stage_index: int) -> list:
    from course_lib.pipeline import gpipe_order as reference

    return order_harness(reference, n_microbatches, num_stages, stage_index)


def one_f_one_b_order(n_microbatches: int, num_stages: int, stage_index: int) -> list:
    from course_lib.pipeline import one_f_one_b_order as reference

    return order_harness(reference, n_microbatches, num_stages, stage_index)


def _name(action: Any) -> str:
    return f"{action[0]}{action[1]}" if isinstance(action, (list, tuple)) and \
        len(action) == 2 else repr(action)


def _peak_stored(actions: list) -> int:
    """The most micro-batches whose forward ran and whose backward has not, at any point."""
    live = peak = 0
    for kind, _mb in actions:
        live += 1 if kind == "F" else -1
        peak = max(peak, live)
    return peak


def explain_gpipe_order(case: Any, rank: Any, expected: Any, got: Any) -> str | None:
    return _explain_order("GPipe", case, expected, got)


def explain_1f1b_order(case: Any, rank: Any, expected: Any, got: Any) -> str | None:
    return _explain_order("1F1B", case, expected, got)


def _explain_order(schedule: str, case: Any, expected: Any, got: Any) -> str | None:
    m, p, s = case.args
    if not isinstance(got, list) or not all(isinstance(a, (list, tuple)) and len(a) == 2
                                            for a in got):
        return None
    got, expected = [tuple(a) for a in got], [tuple(a) for a in expected]
    want_set = {(a, j) for a in "FB" for j in range(m)}
    for action in got:
        if got.count(action) > 1:
            return _("stage {s} runs {action} twice: every micro-batch goes forward once and "
                     "backward once", s=s, action=_name(action))
    if set(got) != want_set:
        missing = sorted(want_set - set(got))
        if missing:
            return _("stage {s} never runs {action} ({m} micro-batches: F and B of each)", s=s,
                     action=_name(missing[0]), m=m)
        return _("stage {s} runs actions that are not F or B of micro-batches 0 to {last}",
                 s=s, last=m - 1)
    for i, (kind, j) in enumerate(got):
        if kind == "B" and ("F", j) not in got[:i]:
            return _("stage {s} runs B of micro-batch {j} before its F", s=s, j=j)
    backwards = [j for kind, j in got if kind == "B"]
    if backwards != sorted(backwards):
        return _("stage {s} runs the backwards in the order {order}: every stage handles the "
                 "micro-batches in the same order, forward and backward, or a gradient meets "
                 "another micro-batch's activations", s=s,
                 order=" ".join(f"B{j}" for j in backwards))
    peak, allowed = _peak_stored(got), _peak_stored(expected)
    if peak != allowed:
        return _("micro-batches of activations stored on stage {s} at once, at most: {peak} "
                 "with this order, {allowed} with {schedule} (p = {p}, m = {m})", s=s,
                 peak=peak, allowed=allowed, schedule=schedule, p=p, m=m)
    first = next(i for i, (a, b) in enumerate(zip(got, expected)) if a != b)
    return _("stage {s}'s action {i} is {got}; {schedule} runs {want} there", s=s, i=first,
             got=_name(got[first]), schedule=schedule, want=_name(expected[first]))


from course_lib.course.grading.references.lesson07.beyond import (  # noqa: E402 - 07d's part
    explain_conflict, explain_interleaved, explain_split, first_conflict, interleaved_order,
    split_step)
