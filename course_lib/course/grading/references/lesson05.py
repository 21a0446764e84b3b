"""Lesson 05's expected values and explanations (judge side: see this package's docstring)."""

from __future__ import annotations

import torch
from torch import nn

from course_lib.course.grading.exercises.lesson05 import (LR, batch_for_checks, flat_weights,
                                                   model_for_checks, rank_micro_batches,
                                                   saving_input, saving_model, token_loss)
from course_lib.i18n import N_, _

# --- lesson05.accumulation_step ---------------------------------------------------------------


def _run(rank: int, p: int, k: int, b: int, steps: int, plain: bool) -> tuple[torch.Tensor, list]:
    """no_sync's reference: what `rank` of p ranks ends with after `steps` steps of k equal
    micro-batches of b samples, the large batch's weights (a plain module: its own samples)."""
    model = model_for_checks()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    for step in range(steps):
        x, y = batch_for_checks(step, p * k * b)
        if plain:
            x, y = x[rank::p], y[rank::p]
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    return flat_weights(model), []


# How a step weighs the tokens: the right one and the classic mistakes, each as the objective
# one process minimizes over every rank's micro-batches (DDP averages the ranks' gradients).
def _objective(model, ranks: list, mode: str) -> torch.Tensor:
    p = len(ranks)
    n_all = sum(int(m.sum()) for micro in ranks for _, _, m in micro)
    positions = sum(m.numel() for micro in ranks for _, _, m in micro)
    total = torch.zeros((), dtype=torch.float64)
    for micro in ranks:
        n_rank = sum(int(m.sum()) for _, _, m in micro)
        for x, y, m in micro:
            loss = token_loss(model(x), y)
            if mode == "tokens":
                total = total + loss[m].sum() / n_all
            elif mode == "no world":  # the count is global, the wrapper's average is not undone
                total = total + loss[m].sum() / n_all / p
            elif mode == "local count":  # each rank divides by its own count
                total = total + loss[m].sum() / n_rank / p
            elif mode == "mean / k":  # each micro-batch's mean over its real tokens, / k
                total = total + loss[m].mean() / len(micro) / p
            elif mode == "padding":  # padding counted: every position, numerator and count
                total = total + loss.sum() / positions
    return total


def _run_tokens(rank: int, p: int, sizes: tuple, steps: int, plain: bool,
                mode: str = "tokens") -> tuple[torch.Tensor, list[float]]:
    """One process doing what `rank` of p ranks does in the check, weighing tokens as `mode`
    says: the weights after `steps` steps, and this rank's loss per real token before each."""
    model = model_for_checks()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    losses = []
    for step in range(steps):
        everyone = [rank_micro_batches(step, r, p, sizes) for r in range(p)]
        mine = everyone[rank]
        with torch.no_grad():
            summed = sum(token_loss(model(x), y)[m].sum() for x, y, m in mine)
            losses.append(float(summed / sum(int(m.sum()) for _, _, m in mine)))
        _objective(model, [mine] if plain else everyone, mode).backward()
        opt.step()
        opt.zero_grad()
    return flat_weights(model), losses


def accumulation_step(rank: int, world_size: int, p: int, sizes: tuple, steps: int,
                      plain: bool = False) -> dict | None:
    """What rank `rank` of a world of p must end with: the weights of steps on the per-token
    loss of all the step's real tokens, two all_reduces per step (the count, the gradient;
    none on a plain module), and each step's loss per real token of this rank."""
    if rank >= p:
        return None
    weights, losses = _run_tokens(rank, p, tuple(sizes), steps, plain)
    out = {"weights": weights, "all_reduce calls": 0 if plain else 2 * steps,
           "returned losses": losses}
    if plain:
        out["ValueError for no micro-batch"] = True
    return out


def _close(a, b) -> bool:
    return (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.shape == b.shape
            and torch.allclose(a, b, rtol=1e-7, atol=1e-9))


def _same_floats(got: list, want: list) -> bool:
    return (isinstance(got, list) and len(got) == len(want)
            and all(isinstance(g, float) and abs(g - w) <= 1e-7 * abs(w) + 1e-9
                    for g, w in zip(got, want)))


_WEIGHT_MISTAKES = (
    ("mean / k", N_("the weights of per-micro-batch means divided by k: a token of a short "
                    "micro-batch weighs more than one of a long one; the large batch weighs "
                    "every real token the same")),
    ("padding", N_("the weights of a loss that counts the padding: padded positions are not "
                   "tokens, neither in the sum nor in the count")),
    ("local count", N_("the weights of each rank dividing by its own count of real tokens: "
                       "ranks holding fewer tokens weigh each of theirs more; the count is the "
                       "step's, over every rank")),
    ("no world", N_("the weights of steps {p} times too small: the wrapper averages the {p} "
                    "ranks' gradients, and the step's loss is their sum")),
)


def explain_accumulation_step(case, rank, expected, got) -> str | None:
    """The first broken promise, in the order that hides the others least: the weights of a
    classic way of weighing tokens wrongly, the communication, then the returned losses, then
    the refusal."""
    if expected is None or not isinstance(got, dict) or set(got) != set(expected):
        return None
    p, sizes, steps = case.args[2], tuple(case.args[3]), case.args[4]
    plain = bool(case.args[5]) if len(case.args) > 5 else False
    right_weights = _close(got["weights"], expected["weights"])
    if not right_weights:
        for mode, reason in _WEIGHT_MISTAKES:
            if plain and mode in ("no world", "local count"):
                continue
            if _close(got["weights"], _run_tokens(rank, p, sizes, steps, plain, mode)[0]):
                return _(reason, p=p)
    calls, want_calls = got["all_reduce calls"], expected["all_reduce calls"]
    if calls != want_calls:
        k = len(sizes)
        if not plain and calls == (k + 1) * steps:
            return _("{calls} all_reduce calls in {steps} steps: the gradient on every "
                     "micro-batch; a step of k micro-batches exchanges it once, on the last",
                     calls=calls, steps=steps)
        if not plain and calls == steps:
            return _("{calls} all_reduce calls in {steps} steps, one per step: the gradient's, "
                     "but the number of real tokens of the step never crossed the ranks",
                     calls=calls, steps=steps)
        return _("{calls} all_reduce calls in {steps} steps, {want} expected", calls=calls,
                 steps=steps, want=want_calls)
    if not right_weights:
        return None
    returned, want = got["returned losses"], expected["returned losses"]
    if not _same_floats(returned, want):
        if isinstance(returned, list) and any(not isinstance(r, float) for r in returned):
            kind = next(r for r in returned if not isinstance(r, float))
            return _("returns {kind}: the exercise asks for this rank's loss per real token, "
                     "as a Python float", kind=kind)
        return _("returns losses that are not this rank's loss per real token before each "
                 "step")
    if got["ValueError for no micro-batch"] is not True:
        return _("accepts an empty list of micro-batches instead of raising ValueError")
    return None


# --- lesson05.no_sync ----------------------------------------------------------------------------


def no_sync(rank: int, world_size: int, k: int, m: int, b: int, steps: int, scenario: str):
    """Every scenario accumulates exactly as the large batch does: its weights, one all_reduce
    per step, and syncing back on after the blocks."""
    if rank >= k:
        return None
    weights, _unused = _run(rank, k, m, b, steps, False)
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
            return _("syncing stays off for good after a block that raised: it must be as the "
                     "block found it once the block ends, however it ends")
        return _("syncing is still off after the blocks closed: it must be as the block "
                 "found it")
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
