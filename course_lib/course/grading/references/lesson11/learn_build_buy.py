"""Lesson 11c's expected values and explanations (learn, build or buy): a step's memory,
communication and time from the lesson's formulas written out here, and the plan that tries
every layout in order and keeps the fastest that fits.
"""

from __future__ import annotations

import math

from course_lib.course.grading.references.lesson11.common import _close
from course_lib.i18n import _


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
