"""Lesson 11's expected values and explanations (judge side: see this package's docstring).

The expected values come from brute force over the rank grid, from one process training the
capstone's GPT with plain PyTorch (`torch.autocast`, `torch.optim.SGD`), and from the lesson's
formulas written out here, never from `course_lib.layout`, `course_lib.precision`,
`course_lib.train` or `course_lib.planning`, the modules being built.
"""

from __future__ import annotations

import functools
import itertools
import math
from typing import Any

import torch
import torch.nn.functional as F

from course_lib.grading.exercises import lesson11 as ex
from course_lib.i18n import _

AXES = ("pp", "dp", "tp")


def _keeps_rng(fn):
    """Seeding to rebuild a case's model must leave the caller's random state alone (the
    judge runs in the learner's kernel for a check cell)."""
    @functools.wraps(fn)
    def wrapped(*args, **kwargs):
        with torch.random.fork_rng(devices=[]):
            return fn(*args, **kwargs)
    return wrapped


def _close(a: Any, b: Any, rtol: float = 1e-6) -> bool:
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        return a.shape == b.shape and torch.allclose(a.double(), b.double(), rtol=rtol,
                                                     atol=1e-9)
    if isinstance(a, (int, float)) and isinstance(b, (int, float)):
        return math.isclose(a, b, rel_tol=rtol, abs_tol=1e-12)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_close(x, y, rtol) for x, y in zip(a, b))
    return a == b


# --- lesson11.layout_groups --------------------------------------------------------------------

def _coords(dp: int, tp: int, pp: int) -> dict[int, dict[str, int]]:
    return {(p * dp + d) * tp + t: {"pp": p, "dp": d, "tp": t}
            for p, d, t in itertools.product(range(pp), range(dp), range(tp))}


def layout_groups(dp: int, tp: int, pp: int) -> dict:
    """Brute force over the rank grid: two ranks share an axis's group when every other
    coordinate is equal."""
    coords = _coords(dp, tp, pp)
    out = {}
    for axis in AXES:
        groups: dict[tuple, list[int]] = {}
        for rank in sorted(coords):
            key = tuple(coords[rank][a] for a in AXES if a != axis)
            groups.setdefault(key, []).append(rank)
        out[axis] = sorted((sorted(g, key=lambda r: coords[r][axis]) for g in groups.values()),
                           key=lambda g: g[0])
    return {"groups": out}


def explain_layout_groups(case, rank, expected, got) -> str | None:
    dp, tp, pp = case.args
    want, have = expected["groups"], got.get("groups") if isinstance(got, dict) else None
    if not isinstance(have, dict):
        return None
    coords = _coords(dp, tp, pp)
    degree = {"dp": dp, "tp": tp, "pp": pp}
    for axis in ("tp", "dp", "pp"):
        mine, right = have.get(axis), want[axis]
        if mine == right:
            continue
        if not isinstance(mine, list) or not all(isinstance(g, list) for g in mine):
            return None
        if sorted(map(sorted, mine)) == sorted(map(sorted, right)):
            if sorted(mine) == sorted(right):
                return _("the {axis} groups are right but not in order: order the groups by "
                         "their first rank", axis=axis)
            return _("each {axis} group holds the right ranks, but not in the order of their "
                     "{axis} coordinate", axis=axis)
        for g in mine:
            if len(g) != degree[axis]:
                return _("a {axis} group of {n} ranks ({group}): each holds {degree}, one per "
                         "{axis} coordinate", axis=axis, n=len(g), group=g, degree=degree[axis])
            if any(r not in coords for r in g):
                return _("group {group} names a rank that is not in a world of {n}", group=g,
                         n=dp * tp * pp)
            others = [a for a in AXES if a != axis]
            for a in others:
                values = sorted({coords[r][a] for r in g})
                if len(values) > 1:
                    return _("the {axis} group {group} mixes {other} coordinates {values}: its "
                             "ranks may differ only in their {axis} coordinate (ranks are "
                             "counted tp fastest, then dp, then pp)", axis=axis, group=g,
                             other=a, values=values)
        return _("the {axis} groups are not the ones the rank order gives: {got} for "
                 "{expected}", axis=axis, got=mine, expected=right)
    return None


# --- lesson11.stage_layers ---------------------------------------------------------------------

def stage_layers(n_blocks: int, pp: int, pp_rank: int) -> dict:
    per = n_blocks // pp
    layers = [f"block {i}" for i in range(pp_rank * per, (pp_rank + 1) * per)]
    if pp_rank == 0:
        layers.insert(0, "embedding")
    if pp_rank == pp - 1:
        layers.append("head")
    return {"layers": layers, "the model's own modules": True}


def explain_stage_layers(case, rank, expected, got) -> str | None:
    n_blocks, pp, pp_rank = case.args
    layers = got.get("layers") if isinstance(got, dict) else None
    if not isinstance(layers, list):
        return None
    want = expected["layers"]
    blocks = [x for x in layers if str(x).startswith("block")]
    right_blocks = [x for x in want if x.startswith("block")]
    if ("embedding" in layers) != (pp_rank == 0):
        return (_("stage {stage} of {pp} holds the embedding: only the first stage does",
                  stage=pp_rank, pp=pp) if pp_rank else
                _("the first stage must begin with the embedding"))
    if ("head" in layers) != (pp_rank == pp - 1):
        return (_("stage {stage} of {pp} holds the head: only the last stage does",
                  stage=pp_rank, pp=pp) if pp_rank != pp - 1 else
                _("the last stage must end with the head"))
    if blocks != right_blocks:
        if len(blocks) != len(right_blocks):
            return _("{n} blocks on this stage: {blocks} blocks over {pp} stages make {per} "
                     "each", n=len(blocks), blocks=n_blocks, pp=pp, per=n_blocks // pp)
        return _("blocks {got} on stage {stage}: its share is {want}, in the model's order",
                 got=", ".join(blocks), stage=pp_rank, want=", ".join(right_blocks))
    if layers != want:
        return _("the layers are out of order: the embedding first, the blocks, the head last")
    if got.get("the model's own modules") is False:
        return _("the stage holds copies: it must hold the model's own modules, whose "
                 "parameters the run trains (and, on the last stage, the tied head's)")
    return None


# --- lesson11.precision_forward ----------------------------------------------------------------

DTYPES = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}


@_keeps_rng
def precision_forward(precision: str) -> dict:
    model, x = ex.precision_model(), ex.precision_input()
    dtype = DTYPES[precision]
    if dtype is None:
        return ex.precision_report(model, model(x))
    with torch.autocast("cpu", dtype=dtype):
        out = model(x)
    return ex.precision_report(model, out.float())


def explain_precision_forward(case, rank, expected, got) -> str | None:
    if not isinstance(got, dict) or "parameter dtypes" not in got:
        return None
    precision = case.args[0]
    if got["parameter dtypes"] != ["torch.float32"]:
        return _("the module's parameters are now {dtypes}: its fp32 weights are the masters "
                 "the optimizer updates; cast each op's inputs as it runs, never the module",
                 dtypes=", ".join(got["parameter dtypes"]))
    if got["output dtype"] != "torch.float32":
        return _("the output is {dtype}: the loss and the next stage must get float32",
                 dtype=got["output dtype"])
    with torch.random.fork_rng(devices=[]):
        plain = ex.precision_model()(ex.precision_input()).detach()
    out = got.get("output")
    if precision == "fp32" and isinstance(out, torch.Tensor) and not torch.equal(out, plain):
        return _("'fp32' must run the module as it is: its output was rounded to a lower "
                 "precision on the way")
    if precision != "fp32" and isinstance(out, torch.Tensor) and torch.equal(out, plain):
        return _("the output is exactly the fp32 computation: the matmuls did not run in "
                 "{precision}", precision=precision)
    if precision != "fp32" and isinstance(out, torch.Tensor):
        other = "bf16" if precision == "fp16" else "fp16"
        if _close(out, precision_forward(other)["output"], 1e-6):
            return _("the output is {other}'s, not {precision}'s", other=other,
                     precision=precision)
    return None


# --- lesson11.update_scale ---------------------------------------------------------------------

def update_scale(overflows: str, growth_interval: int) -> dict:
    scale, tracker, seen = 1024.0, 0, []
    for flag in overflows:
        if flag == "x":
            scale, tracker = scale / 2, 0
        elif tracker + 1 == growth_interval:
            scale, tracker = scale * 2, 0
        else:
            tracker += 1
        seen.append((scale, tracker))
    return {"after each step": seen}


def explain_update_scale(case, rank, expected, got) -> str | None:
    overflows, interval = case.args
    steps = got.get("after each step") if isinstance(got, dict) else None
    if not isinstance(steps, list) or len(steps) != len(overflows):
        return None
    prev = (1024.0, 0)
    for i, (flag, want, have) in enumerate(zip(overflows, expected["after each step"], steps)):
        if tuple(have) == tuple(want):
            prev = want
            continue
        scale, tracker = have
        if flag == "x":
            if scale != prev[0] / 2:
                return _("step {i} overflowed: the scale times backoff_factor, {want:g}, got "
                         "{got:g}", i=i, want=prev[0] / 2, got=scale)
            return _("step {i} overflowed: the count of clean steps restarts at 0, got {got}",
                     i=i, got=tracker)
        if scale > prev[0]:
            return _("the scale grew at step {i} after {n} clean steps in a row; it grows "
                     "after {interval} of them", i=i, n=prev[1] + 1, interval=interval)
        if want[0] > prev[0]:
            return _("step {i} makes {interval} clean steps in a row: the scale grows (times "
                     "growth_factor) and the count restarts at 0", i=i, interval=interval)
        return _("after step {i} (clean) the count of clean steps in a row is {want}, got "
                 "{got}", i=i, want=want[1], got=tracker)
    return None


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
                     "copies' gradients: each copy has the gradient of one use, and one process "
                     "adds the two uses; sum them", rank=rank)
        if _close(have, own) or _close(have, ex.grad_value(name, coords, pp)):
            return _("rank {rank}'s copy of the tied embedding ({name}) has only its own use's "
                     "gradient: sum it with the other end's copy, on ranks {ends}", rank=rank,
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
                    return _("the gradients are still scaled: divide each by the scale "
                             "({scale:g})", scale=scale)
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


# --- lesson11.step_cost and lesson11.plan ------------------------------------------------------

G = 1e9
STACKS = {"ours": {"dp", "zero1", "zero2", "zero3", "tp", "pp"},
          "PyTorch": {"dp", "zero1", "zero2", "zero3", "tp", "pp"},
          "DeepSpeed": {"dp", "zero1", "zero2", "zero3", "tp", "pp"},
          "Megatron-Core": {"dp", "zero1", "zero3", "tp", "pp"},
          "tf.distribute": {"dp"}}
BYTES_PER_PARAM = {0: lambda d: 16, 1: lambda d: 4 + 12 / d, 2: lambda d: 2 + 14 / d,
                   3: lambda d: 16 / d}


def _activations(s: dict, tp: int) -> float:
    sbh = s["seq"] * s["micro_batch"] * s["hidden"]
    return s["layers"] * sbh * 2 + sbh * (10 + 24 / tp)


def _cost(s: dict, dp: int, tp: int, pp: int, zero: int, *, ddp_zero3: bool = False,
          tp_collectives: int = 4, bubble: bool = True, zero_memory: dict | None = None,
          split_states: bool = True) -> tuple[float, float, float]:
    local = s["params"] / ((tp * pp) if split_states else 1)
    per = (zero_memory or BYTES_PER_PARAM)[zero](dp)
    memory = per * local + _activations(s, tp)
    m = s["batch"] // (dp * s["micro_batch"])
    act = 2 * s["micro_batch"] * s["seq"] * s["hidden"]
    dp_bytes = (3 if zero == 3 and not ddp_zero3 else 2) * (dp - 1) / dp * 2 * local
    tp_bytes = tp_collectives * 2 * (tp - 1) / tp * act * m * s["layers"] / pp
    pp_bytes = 2 * m * act if pp > 1 else 0.0

    def link(span: int) -> float:
        return s["intra"] if span <= s["per_node"] else s["inter"]

    compute = 8 * s["params"] * s["batch"] * s["seq"] / (s["devices"] * s["flops"])
    time = (compute * ((m + pp - 1) / m if bubble else 1.0) + dp_bytes / link(dp * tp)
            + tp_bytes / link(tp) + pp_bytes / link(s["devices"]))
    return memory, dp_bytes + tp_bytes + pp_bytes, time


def step_cost(s: dict, dp: int, tp: int, pp: int, zero: int) -> dict:
    memory, comm, time = _cost(s, dp, tp, pp, zero)
    return {"memory (GB)": memory / G, "comm (GB)": comm / G, "time (s)": time}


def explain_step_cost(case, rank, expected, got) -> str | None:
    if not isinstance(got, dict) or not isinstance(got.get("memory (GB)"), float):
        return None
    s, dp, tp, pp, zero = case.args
    memory, comm, time = got["memory (GB)"], got["comm (GB)"], got["time (s)"]
    if not _close(memory, expected["memory (GB)"]):
        wrong_zero = {**BYTES_PER_PARAM, 1: lambda d: 16 / d, 2: lambda d: 16 / d}
        if _close(memory * G, _cost(s, dp, tp, pp, zero, zero_memory=wrong_zero)[0]):
            return _("memory: ZeRO-{zero} shards only the optimizer state (and, at stage 2, the "
                     "gradients): the bf16 weights and gradients stay whole on each replica",
                     zero=zero)
        if _close(memory * G, _cost(s, dp, tp, pp, zero, split_states=False)[0]):
            return _("memory: a device keeps the states of its share of the parameters only, "
                     "1/(tp x pp) of them")
        if _close(memory * G, _cost(s, dp, tp, pp, zero)[0] - _activations(s, tp)):
            return _("memory: the activations are missing")
        return _("memory: {got:.3f} GB, expected {want:.3f} GB", got=memory,
                 want=expected["memory (GB)"])
    if not _close(comm, expected["comm (GB)"]):
        if _close(comm * G, _cost(s, dp, tp, pp, zero, tp_collectives=2)[1]):
            return _("communication: a transformer layer all-reduces twice in the forward pass "
                     "and twice in the backward pass (Megatron's count), four per micro-batch")
        if _close(comm * G, _cost(s, dp, tp, pp, zero, ddp_zero3=True)[1]):
            return _("communication: ZeRO-3 gathers the parameters in the forward and again in "
                     "the backward pass and reduce-scatters the gradients, 1.5 times DDP's bytes")
        return _("communication: {got:.3f} GB per step, expected {want:.3f} GB", got=comm,
                 want=expected["comm (GB)"])
    if not _close(time, expected["time (s)"]):
        if pp > 1 and _close(time, _cost(s, dp, tp, pp, zero, bubble=False)[2]):
            return _("time: the pipeline's bubble is missing: while the pipeline fills and "
                     "drains its stages wait (07a), and the step lasts longer than its compute")
        return _("time: {got:.4f} s per step, expected {want:.4f} s (compute with its bubble, "
                 "then each group's bytes over its link)", got=time, want=expected["time (s)"])
    return None


def _possible(s: dict, dp: int, tp: int, pp: int) -> str | None:
    """Why layout (dp, tp, pp) is impossible for `s`, or None."""
    if dp * tp * pp != s["devices"]:
        return _("dp x tp x pp = {n}, but there are {devices} devices", n=dp * tp * pp,
                 devices=s["devices"])
    if tp > s["per_node"]:
        return _("tp={tp} spans more than one node of {per_node}: tensor parallelism stays "
                 "inside a node", tp=tp, per_node=s["per_node"])
    if s["heads"] % tp or s["layers"] % pp:
        return _("tp must divide the {heads} heads and pp the {layers} layers",
                 heads=s["heads"], layers=s["layers"])
    if s["batch"] % (dp * s["micro_batch"]):
        return _("{batch} sequences do not make whole micro-batches of {mb} on {dp} replicas",
                 batch=s["batch"], mb=s["micro_batch"], dp=dp)
    return None


def _features(dp: int, tp: int, pp: int, zero: int) -> set:
    return {"dp"} | ({f"zero{zero}"} if zero else set()) | ({"tp"} if tp > 1 else set()) | (
        {"pp"} if pp > 1 else set())


def _plan(s: dict) -> tuple | None:
    best = None
    for pp in range(1, s["devices"] + 1):
        for tp in range(1, s["per_node"] + 1):
            if s["devices"] % (tp * pp):
                continue
            dp = s["devices"] // (tp * pp)
            if _possible(s, dp, tp, pp):
                continue
            for zero in range(4):
                memory, comm, time = _cost(s, dp, tp, pp, zero)
                if memory <= s["memory"] and (best is None or time < best[-1]):
                    best = (dp, tp, pp, zero, memory, time)
    return best


def _stack(s: dict, dp: int, tp: int, pp: int, zero: int) -> str | None:
    need = _features(dp, tp, pp, zero)
    return next((name for name in s["stacks"] if need <= STACKS[name]), None)


def plan(s: dict) -> dict | None:
    best = _plan(s)
    if best is None:
        return None
    dp, tp, pp, zero, memory, time = best
    return {"layout": [dp, tp, pp, zero], "stack": _stack(s, dp, tp, pp, zero),
            "memory (GB)": memory / G, "time (s)": time}


def _named(layout: list) -> str:
    dp, tp, pp, zero = layout
    return f"dp={dp} tp={tp} pp={pp} ZeRO-{zero}"


def explain_plan(case, rank, expected, got) -> str | None:
    (s,) = case.args
    if expected is None:
        return (_("nothing fits: even the smallest layout needs more than {memory:g} GB per "
                  "device; return None", memory=s["memory"] / G) if got is not None else None)
    if got is None:
        return _("a layout fits: {layout} needs {memory:.1f} GB of {have:g}",
                 layout=_named(expected["layout"]), memory=expected["memory (GB)"],
                 have=s["memory"] / G)
    layout = got.get("layout") if isinstance(got, dict) else None
    if not isinstance(layout, list) or len(layout) != 4:
        return None
    dp, tp, pp, zero = layout
    if layout != expected["layout"]:
        why = _possible(s, dp, tp, pp)
        if why:
            return why
        if zero not in BYTES_PER_PARAM:
            return None
        memory, _comm, time = _cost(s, dp, tp, pp, zero)
        if memory > s["memory"]:
            return _("{layout} needs {memory:.1f} GB per device, more than its {have:g} GB",
                     layout=_named(layout), memory=memory / G, have=s["memory"] / G)
        right = _named(expected["layout"])
        if math.isclose(time, expected["time (s)"], rel_tol=1e-9):
            return _("{layout} is as fast as {right}: on a tie, the smaller pipeline, then the "
                     "smaller tp, then the lower ZeRO stage", layout=_named(layout), right=right)
        return _("{layout} fits, but its step takes {time:.2f} s; {right} takes {best:.2f} s",
                 layout=_named(layout), time=time, right=right, best=expected["time (s)"])
    if got.get("stack") != expected["stack"]:
        need = sorted(_features(dp, tp, pp, zero))
        return _("stack {got}: the first of the team's stacks {stacks} that does all of {need} "
                 "is {want}", got=got.get("stack"), stacks=list(s["stacks"]), need=need,
                 want=expected["stack"])
    return None
