"""Lesson 11b's expected values and explanations (the training step): the gradients each axis's
reduction leaves, the loss scaler's unscale and skip, and the whole step, whose expected losses
come from one process training the case's GPT with plain PyTorch on the global batch (and, to
name a wrong step, the same with the mistake made on purpose).

Components (course_lib.gpt, course_lib.run, ...) are imported inside the functions that use
them, on purpose: the learner's overlay decides at each call which version runs (theirs or the
reference), and a name bound at import time would keep the first one.
"""

from __future__ import annotations

import functools
import math

import torch
import torch.nn.functional as F

from course_lib.course.grading.exercises.lesson11 import step as ex
from course_lib.course.grading.references.lesson11.common import DTYPES, _close
from course_lib.i18n import _


# --- lesson11.reduce_grads ---------------------------------------------------------------------

def _dp_mean(name: str, coords: dict, dp: int, pp: int) -> torch.Tensor:
    return sum(ex.grad_value(name, {**coords, "dp": i}, pp) for i in range(dp)) / dp


def _tied_sum(coords: dict, dp: int, pp: int) -> torch.Tensor:
    return (_dp_mean("embedding", {**coords, "pp": 0}, dp, pp)
            + _dp_mean("head", {**coords, "pp": pp - 1}, dp, pp))


def _reduce_comm(dp: int, pp: int, wrapped: bool, coords: dict) -> str:
    used = []
    if pp > 1 and coords["pp"] in (0, pp - 1):
        used.append("tied")
    if dp > 1 and not wrapped:
        used.append("dp")
    return ", ".join(sorted(used)) or "none"


def reduce_grads(rank: int, world_size: int, k: int, dp: int, tp: int, pp: int,
                 wrapped: bool = False):
    if rank >= k:
        return None
    coords = ex.coordinates(rank, dp, tp)
    grads = {}
    for name in ex.rank_params(coords, pp):
        tied = pp > 1 and name in ("embedding", "head")
        grads[name] = _tied_sum(coords, dp, pp) if tied else _dp_mean(name, coords, dp, pp)
    return {"comm": _reduce_comm(dp, pp, wrapped, coords), "grads": grads}


def explain_reduce_grads(case, rank, expected, got) -> str | None:
    if expected is None or not isinstance(got, dict) or not isinstance(got.get("grads"), dict):
        return None
    k, dp, tp, pp, wrapped = case.args[2:7]
    coords = ex.coordinates(rank, dp, tp)
    comm = [c.strip() for c in str(got.get("comm", "")).split(",")]
    if "tp" in comm:
        return _("rank {rank} ran a collective over its tp group: after backward a parameter "
                 "every tp rank holds whole has the same gradient on each already (f and g "
                 "summed what was partial), and a shard is a different parameter on each rank; "
                 "tp needs no reduction", rank=rank)
    if "world" in comm:
        return _("rank {rank} reduced over the whole world: each axis's reduction runs over its "
                 "own group only", rank=rank)
    if "another group" in comm or "pp" in comm:
        return _("rank {rank} ran a collective over a group other than its dp group and its "
                 "tied embedding's group (the first and last stage)", rank=rank)
    if wrapped and "dp" in comm:
        return _("DDP already averaged the gradients over dp during backward "
                 "(dp_reduced_in_backward); rank {rank} reduced them over dp again", rank=rank)
    grads = got["grads"]
    for name in ("embedding", "head"):
        if pp == 1 or name not in grads or name not in expected["grads"]:
            continue
        have, total = grads[name], _tied_sum(coords, dp, pp)
        own = _dp_mean(name, coords, dp, pp)
        if _close(have, total / 2):
            return _("rank {rank}'s copy of the tied embedding holds the average of the two "
                     "copies' gradients: each copy has the gradient of one use, and one process's "
                     "gradient holds both uses whole", rank=rank)
        if _close(have, own) or _close(have, ex.grad_value(name, coords, pp)):
            return _("rank {rank}'s copy of the tied embedding ({name}) has only its own use's "
                     "gradient; one process's also holds the other use's, whose copy is on ranks "
                     "{ends}", rank=rank,
                     name=name, ends=[(coords["dp"] * tp + coords["tp"]),
                                      ((pp - 1) * dp + coords["dp"]) * tp + coords["tp"]])
        if dp > 1 and _close(have, total * dp):
            return _("the tied embedding's gradient is summed over the {dp} dp replicas, not "
                     "averaged", dp=dp)
    for name in ("norm", "fc"):
        have = grads.get(name)
        if not isinstance(have, torch.Tensor) or _close(have, expected["grads"][name]):
            continue
        if dp > 1 and _close(have, ex.grad_value(name, coords, pp)):
            return _("rank {rank}'s gradients are its own replica's: average them over its dp "
                     "group {group}", rank=rank,
                     group=[((coords["pp"] * dp + d) * tp + coords["tp"]) for d in range(dp)])
        if dp > 1 and _close(have, expected["grads"][name] * dp):
            return _("the gradients are summed over the {dp} dp replicas, not averaged", dp=dp)
    return None


# --- lesson11.unscale_grads --------------------------------------------------------------------

def unscale_grads(rank: int, world_size: int, k: int, scale: float, bad_rank: int = -1,
                  bad: str = "inf"):
    if rank >= k:
        return None
    grads = [torch.arange(3.0) + rank, torch.full((2, 2), 0.5 * (rank + 1)), None]
    if rank == bad_rank:
        grads[1][0, 1] = -2.0 if bad == "inf" else -1.0  # the harness's marks for inf and NaN
    return {"comm": "all_reduce x1", "found": 0 <= bad_rank < k, "grads": grads}


def explain_unscale_grads(case, rank, expected, got) -> str | None:
    if expected is None or not isinstance(got, dict):
        return None
    k, scale, bad_rank = case.args[2], case.args[3], case.args[4] if len(case.args) > 4 else -1
    grads, want = got.get("grads"), expected["grads"]
    if isinstance(grads, list) and len(grads) == len(want):
        for have, right in zip(grads, want):
            if isinstance(have, torch.Tensor) and isinstance(right, torch.Tensor):
                if _close(have, right * scale):
                    return _("the gradients are still scaled: each is {scale:g} times the "
                             "one-process gradient", scale=scale)
                if _close(have, right / scale):
                    return _("the gradients are divided by the scale twice: {scale:g} times "
                             "too small", scale=scale)
    comm = got.get("comm")
    if got.get("found") != expected["found"]:
        if comm == "none":
            return _("rank {rank} answered from its own gradients only: rank {bad} overflowed, "
                     "and every rank must skip the step (one collective shares the answer)",
                     rank=rank, bad=bad_rank) if expected["found"] else None
        return _("rank {rank} says found_inf={got}; with an overflow on rank {bad} of {k} "
                 "every rank must say {want}", rank=rank, got=got.get("found"), bad=bad_rank,
                 k=k, want=expected["found"])
    if comm != expected["comm"]:
        return _("the flag took {comm}; one all_reduce of it is enough for every rank to know",
                 comm=comm)
    return None


# --- lesson11.train_step -----------------------------------------------------------------------

VARIANTS = ("right", "unscale twice", "tied averaged", "dp summed", "no zero_grad",
            "steps on overflow")


@functools.lru_cache(maxsize=256)
def _one_process(dp: int, tp: int, pp: int, precision: str, bad_step: int,
                 variant: str = "right") -> tuple:
    """(losses, skipped, scale) of one process training the case's model on the global
    batches with plain PyTorch, the way `variant` does it."""
    from course_lib.gpt import GPT, CharTokenizer, load_text
    from course_lib.run import TextWindows, batches, split_text

    cfg = ex.step_config(dp, tp, pp, precision)
    with torch.random.fork_rng(devices=[]):
        text = load_text(cfg.text)
        tok = CharTokenizer(text)
        data = batches(TextWindows(split_text(tok.encode(text), cfg.val_fraction)[0],
                                   cfg.block_size), cfg.batch_size, 1, 0, cfg.seed)
        torch.manual_seed(cfg.seed)
        model = GPT(cfg.model_config(tok.vocab_size))
        opt = torch.optim.SGD(model.parameters(), lr=cfg.lr)
        dtype = DTYPES[precision]
        scale = cfg.init_scale if precision == "fp16" else 1.0
        tracker, losses, skipped = 0, [], []
        for step in range(cfg.steps):
            x, y = next(data)
            if dtype is None:
                logits = model(x)
            else:
                with torch.autocast("cpu", dtype=dtype):
                    logits = model(x).float()
            loss = F.cross_entropy(logits.reshape(-1, tok.vocab_size), y.reshape(-1)) * scale
            loss.backward()
            if step == bad_step:
                next(model.parameters()).grad.view(-1)[0] = float("inf")
            params = list(model.parameters())
            if variant == "tied averaged" and pp > 1:
                model[0].wte.weight.grad /= 2
            if variant == "dp summed" and dp > 1 and pp > 1:
                for p in params:
                    p.grad *= dp
            found = False
            if precision == "fp16":
                for p in params:
                    p.grad /= scale * (scale if variant == "unscale twice" else 1)
                found = any(not torch.isfinite(p.grad).all() for p in params)
                used = scale
                if found:
                    scale, tracker = scale / 2, 0
                else:
                    tracker += 1
                    if tracker == cfg.growth_interval:
                        scale, tracker = scale * 2, 0
            else:
                used = 1.0
            if not found or variant == "steps on overflow":
                opt.step()
            if variant != "no zero_grad":
                opt.zero_grad(set_to_none=True)
            losses.append((loss.detach().float() / used).item())
            skipped.append(found)
    return tuple(losses), tuple(skipped), scale if precision == "fp16" else None


def _step_comm(dp: int, pp: int, coords: dict) -> str:
    """The groups a rank's step uses after backward: the tied embedding's (a stage that holds
    a copy), dp's (no wrapper when pp > 1), the world's (the loss, fp16's flag)."""
    used = (["tied"] if pp > 1 and coords["pp"] in (0, pp - 1) else []) + (
        ["dp"] if dp > 1 and pp > 1 else []) + ["world"]
    return ", ".join(sorted(used))


def train_step(rank: int, world_size: int, k: int, dp: int, tp: int, pp: int,
               precision: str = "fp32", bad_step: int = -1, bad_rank: int = -1):
    if rank >= k:
        return None
    comm = _step_comm(dp, pp, ex.coordinates(rank, dp, tp))
    losses, skipped, scale = _one_process(dp, tp, pp, precision, bad_step)
    return {"comm": comm, "losses": list(losses), "skipped": list(skipped), "scale": scale}


def explain_train_step(case, rank, expected, got) -> str | None:
    if expected is None or not isinstance(got, dict) or not isinstance(got.get("losses"), list):
        return None
    k, dp, tp, pp, precision, bad_step, bad_rank = case.args[2:9]
    comm = [c.strip() for c in str(got.get("comm", "")).split(",")]
    want_comm = [c.strip() for c in expected["comm"].split(",")]
    if "tp" in comm:
        return _("a collective over the tp group after backward: tp needs no reduction of the "
                 "gradients (f and g did it), and counts the loss once")
    for kind, why in (("tied", _("the tied embedding's two copies were not summed: each keeps "
                                 "the gradient of one use")),
                      ("dp", _("after the pipeline the replicas' gradients were not averaged "
                               "over dp: no wrapper does it when pp > 1")),
                      ("world", _("nothing was shared over the world: the loss (and with fp16 "
                                  "the overflow flag) must reach every rank"))):
        if kind in want_comm and kind not in comm:
            return why
    if "dp" in comm and "dp" not in want_comm:
        return _("an all-reduce over dp after backward: with pp = 1 DDP already averaged the "
                 "gradients during backward (dp_reduced_in_backward)")
    losses, want = got["losses"], expected["losses"]
    if any(isinstance(x, float) and math.isnan(x) for x in losses):
        return _("the loss became NaN: a step ran with gradients that overflowed; skip it on "
                 "every rank")
    if got.get("skipped") != expected["skipped"]:
        steps = [i for i, s in enumerate(expected["skipped"]) if s]
        return _("skipped steps {got}, expected {want}: the step whose gradients overflowed (on "
                 "any rank) is skipped, and only that one", got=[i for i, s in enumerate(
                     got.get("skipped") or []) if s], want=steps)
    if not _close(got.get("scale"), expected["scale"], 1e-9):
        return _("the scale after the run is {got}, expected {want}: the scaler's update runs "
                 "once per step, with whether this step overflowed", got=got.get("scale"),
                 want=expected["scale"])
    if tp > 1 and _close(losses, [x * tp for x in want], 1e-4):
        return _("the loss is {tp} times one process's: each tp rank of the last stage added "
                 "its copy; count it once per replica", tp=tp)
    if any(x == 0.0 for x in losses):
        return _("rank {rank} reports a loss of 0: only the last stage has the loss; one "
                 "all-reduce gives it to every rank", rank=rank)
    for i, skip in enumerate(expected["skipped"]):
        if skip and _close(losses[i], want[i] * 2, 1e-4) and _close(losses[:i], want[:i], 1e-4):
            return _("the loss of step {i} is twice one process's: it was divided by the scale "
                     "after its update, not the scale the step used", i=i)
    for variant, why in (
            ("unscale twice", _("the gradients were divided by the scale twice: the steps "
                                "are the scale times too small")),
            ("tied averaged", _("the tied embedding's copies were averaged, not summed: its "
                                "step is half one process's")),
            ("dp summed", _("the replicas' gradients were summed over dp, not averaged: "
                            "the steps are dp times one process's")),
            ("no zero_grad", _("the gradients are never freed: each step adds the previous "
                               "steps' gradients to its own"))):
        alternative = list(_one_process(dp, tp, pp, precision, bad_step, variant)[0])
        if alternative != want and _close(losses, alternative, 1e-4):
            return why
    if not _close(losses[:1], want[:1], 1e-4):
        return _("the first step's loss is {got:.6f}, one process's {want:.6f}: the mean over "
                 "the global batch, divided by the scale with fp16 and by dp", got=losses[0],
                 want=want[0])
    return None
