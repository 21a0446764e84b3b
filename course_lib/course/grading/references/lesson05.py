"""Lesson 05's expected values and explanations (judge side: see this package's docstring)."""

from __future__ import annotations

import torch
from torch import nn

from course_lib.course.grading.exercises.lesson05 import (LR, batch_for_checks, flat_weights,
                                                   model_for_checks, saving_input, saving_model)
from course_lib.i18n import _

# --- lesson05.accumulation_step ---------------------------------------------------------------


def _run(rank: int, p: int, k: int, b: int, steps: int, plain: bool, *, grad_scale: float = 1.0,
         step_each_micro_batch: bool = False) -> tuple[torch.Tensor, list[float]]:
    """One process doing what `rank` of p ranks does in the check: the weights after `steps`
    steps, and the loss of this rank's k*b samples before each step. The DDP ranks' average
    over the union of their batches is one large batch; a plain module sees its own only.
    `grad_scale` and `step_each_micro_batch` give the runs of two classic mistakes."""
    model = model_for_checks()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    losses = []
    for step in range(steps):
        x, y = batch_for_checks(step, p * k * b)
        with torch.no_grad():
            losses.append(nn.functional.mse_loss(model(x[rank::p]), y[rank::p]).item())
        shares = [x[rank::p]] if plain else [x[r::p] for r in range(p)]
        targets = [y[rank::p]] if plain else [y[r::p] for r in range(p)]
        groups = ([list(range(m * b, (m + 1) * b)) for m in range(k)] if step_each_micro_batch
                  else [list(range(k * b))])
        for rows in groups:
            bx = torch.cat([s[rows] for s in shares])
            by = torch.cat([t[rows] for t in targets])
            scale = grad_scale * len(rows) / (k * b)  # this group's share of the step
            (scale * nn.functional.mse_loss(model(bx), by)).backward()
            opt.step()
            opt.zero_grad()
    return flat_weights(model), losses


def accumulation_step(rank: int, world_size: int, p: int, k: int, b: int, steps: int,
                      plain: bool = False) -> dict | None:
    """What rank `rank` of a world of p must end with: the large batch's weights, one
    all_reduce per step (none on a plain module), and each step's loss of its k*b samples."""
    if rank >= p:
        return None
    weights, losses = _run(rank, p, k, b, steps, plain)
    out = {"weights": weights, "all_reduce calls": 0 if plain else steps,
           "returned losses": losses}
    if plain:
        out["ValueError for no micro-batch"] = True
        out["ValueError for unequal micro-batches"] = True
    return out


def _close(a, b) -> bool:
    return (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.shape == b.shape
            and torch.allclose(a, b, rtol=1e-7, atol=1e-9))


def _same_floats(got: list, want: list) -> bool:
    return (isinstance(got, list) and len(got) == len(want)
            and all(isinstance(g, float) and abs(g - w) <= 1e-7 * abs(w) + 1e-9
                    for g, w in zip(got, want)))


def _micro_losses(rank: int, p: int, k: int, b: int, step: int, weights_run) -> list[float]:
    """Each micro-batch's own (unscaled) loss at step `step`, on the reference's weights."""
    model = model_for_checks()
    x, y = batch_for_checks(step, p * k * b)
    x, y = x[rank::p], y[rank::p]
    with torch.no_grad():
        torch.nn.utils.vector_to_parameters(weights_run, model.parameters())
        return [nn.functional.mse_loss(model(x[m * b:(m + 1) * b]), y[m * b:(m + 1) * b]).item()
                for m in range(k)]


def explain_accumulation_step(case, rank, expected, got) -> str | None:
    """The first broken promise, in the order that hides the others least: the communication,
    then the weights (unscaled losses; a step per micro-batch), then the returned losses (not a
    float; the last micro-batch's; k times too large), then the refusals."""
    if expected is None or not isinstance(got, dict) or set(got) != set(expected):
        return None
    p, k, b, steps = case.args[2:6]
    plain = bool(case.args[6]) if len(case.args) > 6 else False
    calls, want_calls = got["all_reduce calls"], expected["all_reduce calls"]
    if calls != want_calls:
        if not plain and calls == k * steps:
            return _("{calls} all_reduce calls in {steps} steps: one per micro-batch; a step "
                     "of k micro-batches communicates once, on the last", calls=calls,
                     steps=steps)
        return _("{calls} all_reduce calls in {steps} steps, {want} expected", calls=calls,
                 steps=steps, want=want_calls)
    if not _close(got["weights"], expected["weights"]):
        if k > 1 and _close(got["weights"], _run(rank, p, k, b, steps, plain, grad_scale=k)[0]):
            return _("the weights of steps {k} times too large: each of the {k} micro-batch "
                     "losses already averages over its samples, so their gradients add up to "
                     "{k} times the large batch's", k=k)
        if k > 1 and _close(got["weights"],
                            _run(rank, p, k, b, steps, plain, step_each_micro_batch=True)[0]):
            return _("the weights of an optimizer step after every micro-batch: the large "
                     "batch takes one step, after the last of its {k} micro-batches", k=k)
        return None
    returned, want = got["returned losses"], expected["returned losses"]
    if not _same_floats(returned, want):
        if isinstance(returned, list) and any(not isinstance(r, float) for r in returned):
            kind = next(r for r in returned if not isinstance(r, float))
            return _("returns {kind}: the exercise asks for the loss of the whole batch, as a "
                     "Python float", kind=kind)
        micro = [_micro_losses(rank, p, k, b, s, _weights_before(rank, p, k, b, s, plain))
                 for s in range(steps)]
        if _same_floats(returned, [m[-1] for m in micro]) or \
                _same_floats(returned, [m[-1] / k for m in micro]):
            return _("returns the loss of the last micro-batch; the step's loss is that of all "
                     "{k} micro-batches together, this rank's {n} samples", k=k, n=k * b)
        if _same_floats(returned, [k * w for w in want]):
            return _("returns {k} times the whole batch's loss: the micro-batch losses each "
                     "average over their own samples", k=k)
        return _("returns losses that are not those of this rank's whole batch ({n} samples) "
                 "before each step", n=k * b)
    for key, what in (("ValueError for no micro-batch", _("an empty list of micro-batches")),
                      ("ValueError for unequal micro-batches",
                       _("micro-batches of unequal sizes"))):
        if got[key] is not True:
            return _("accepts {what} instead of raising ValueError", what=what)
    return None


def _weights_before(rank: int, p: int, k: int, b: int, step: int, plain: bool) -> torch.Tensor:
    """The reference's weights at the start of step `step`."""
    return _run(rank, p, k, b, step, plain)[0]


# --- lesson05.no_sync ----------------------------------------------------------------------------


def no_sync(rank: int, world_size: int, k: int, m: int, b: int, steps: int, scenario: str):
    """Every scenario accumulates exactly as the large batch does: its weights, one all_reduce
    per step, and syncing back on after the blocks."""
    if rank >= k:
        return None
    weights, _losses = _run(rank, k, m, b, steps, False)
    return {"weights": weights, "all_reduce calls per step": [1] * steps,
            "require_backward_grad_sync after": True}


def explain_no_sync(case, rank, expected, got) -> str | None:
    """Whether syncing came back on, and how many all_reduces a step made, in the scenario's
    terms (nested blocks, a block that raised)."""
    if expected is None or not isinstance(got, dict) or set(got) != set(expected):
        return None
    m, scenario = case.args[3], case.args[6]
    calls = got["all_reduce calls per step"]
    if got["require_backward_grad_sync after"] is not True:
        if scenario == "a block raised":
            return _("syncing stays off for good after a block that raised: the way out of "
                     "the block must restore it, however the block ends")
        return _("syncing is still off after the blocks closed: the way out must put back "
                 "what the block found")
    if isinstance(calls, list) and calls and max(calls) > 1:
        if scenario == "nested":
            return _("{calls} all_reduce calls per step, one expected: leaving the inner block "
                     "turned syncing back on while the outer block was still open",
                     calls=max(calls))
        if max(calls) == m:
            return _("{calls} all_reduce calls per step, one per micro-batch: the blocks did "
                     "not stop the wrapper's forward from arming the hooks (it reads "
                     "require_backward_grad_sync)", calls=m)
        return _("{calls} all_reduce calls per step, one expected", calls=max(calls))
    if isinstance(calls, list) and calls and min(calls) == 0:
        return _("no all_reduce in a step: the last micro-batch, outside every block, must sync")
    return None


# --- lesson05.saved_activation_bytes --------------------------------------------------------------


def _saved(kind: str, batch: int, *, parameters: bool = False, once: bool = True) -> int:
    """Bytes autograd saves in one forward: parameters left out (or not), a tensor saved twice
    counted once (or twice)."""
    model, x = saving_model(kind), saving_input(kind, batch)
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: set[tuple] = set()
    total = 0

    def pack(t: torch.Tensor) -> torch.Tensor:
        nonlocal total
        ptr = t.untyped_storage().data_ptr()
        key = (ptr, t.storage_offset(), tuple(t.shape), tuple(t.stride()))
        if (parameters or ptr not in params) and not (once and key in seen):
            seen.add(key)
            total += t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(x)
    return total


def saved_activation_bytes(kind: str, batch: int) -> int:
    return _saved(kind, batch)


def explain_saved_activation_bytes(case, rank, expected, got) -> str | None:
    """Which of the two things that are not activations the count included, or whether it
    counted the output instead of what autograd keeps."""
    if not isinstance(got, int) or isinstance(got, bool):
        return None
    kind, batch = case.args
    params = got in (_saved(kind, batch, parameters=True, once=False),
                     _saved(kind, batch, parameters=True))
    twice = got == _saved(kind, batch, once=False)
    if params and twice:  # the same bytes either way on this model
        return _("counts the parameters, or a tensor that two operations save, twice: here "
                 "both add the same bytes, and neither is an activation of this batch")
    if params:
        return _("counts the parameters too: autograd keeps a reference to them, not a copy, "
                 "and they cost the same at any batch size")
    if twice:
        return _("counts a tensor that two operations save twice; autograd stores it once")
    model, x = saving_model(kind), saving_input(kind, batch)
    out = model(x)
    if got == out.numel() * out.element_size():
        return _("the bytes of the model's output; the activations are what autograd keeps "
                 "for backward during forward")
    return None
