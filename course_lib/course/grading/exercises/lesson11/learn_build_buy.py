"""Lesson 11c's checks (learn, build or buy): a job's memory, communication and time per step
(`step_cost`), and the layout and stack chosen for it (`plan`), on scenarios from one node of
A100s to 64 H100s. Expected values and explanations:
`course_lib/course/grading/references/lesson11/learn_build_buy.py`.

The lesson's `Scenario` (course_lib.planning) is imported inside the function that builds it, on
purpose: the learner's overlay decides at each call which version runs (theirs or the
reference), and a name bound at import time would keep the first one.
"""

from __future__ import annotations

from typing import Any

from course_lib.course.grading import Exercise, case, register
from course_lib.course.grading.exercises.lesson11.common import PART_C
from course_lib.i18n import N_, _


# --- 11c: lesson11.step_cost and lesson11.plan -------------------------------------------------
# Scenarios are plain dicts here (the harness builds the lesson's `Scenario` from them), so this
# module imports nothing of the learner's at import time.

G = 1e9
A100 = dict(memory=80 * G, flops=125e12, intra=150 * G)
H100 = dict(memory=80 * G, flops=400e12, intra=300 * G)
SMALL_GPU = dict(memory=24 * G, flops=80e12, intra=25 * G, inter=12.5 * G)


def scenario(name: str, params: float, layers: int, hidden: int, heads: int, seq: int,
             batch: int, micro_batch: int, devices: int, per_node: int, stacks: tuple,
             **hardware: float) -> dict:
    return dict(name=name, params=params, layers=layers, hidden=hidden, heads=heads, seq=seq,
                batch=batch, micro_batch=micro_batch, devices=devices, per_node=per_node,
                stacks=tuple(stacks), **hardware)


SCENARIOS = {
    "1.3B": scenario(N_("fine-tune 1.3B, one node of 8 A100"), 1.3e9, 24, 2048, 16, 2048, 64,
                     4, 8, 8, ("PyTorch", "DeepSpeed"), inter=12.5 * G, **A100),
    "7B, 2 nodes": scenario(N_("7B, 2 nodes of 8 H100, 100 Gb/s between them"), 7e9, 32, 4096,
                            32, 4096, 256, 1, 16, 8, ("PyTorch", "DeepSpeed", "Megatron-Core"),
                            inter=12.5 * G / 8, **H100),
    "70B": scenario(N_("70B, 8 nodes of 8 H100, 400 Gb/s per GPU"), 70e9, 80, 8192, 64, 4096,
                    512, 1, 64, 8, ("Megatron-Core", "PyTorch"), inter=50 * G, **H100),
    "7B, 24 GB": scenario(N_("7B on 8 GPUs of 24 GB"), 7e9, 32, 4096, 32, 4096, 64, 1, 8, 8,
                          ("PyTorch",), **SMALL_GPU),
    "70B, 24 GB": scenario(N_("70B on 8 GPUs of 24 GB"), 70e9, 80, 8192, 64, 4096, 64, 1, 8, 8,
                           ("PyTorch", "DeepSpeed"), **SMALL_GPU),
    "TF, 350M": scenario(N_("350M, a TensorFlow team, 4 A100"), 350e6, 24, 1024, 16, 1024, 128,
                         8, 4, 4, ("tf.distribute",), inter=12.5 * G, **A100),
    "TF, 7B": scenario(N_("7B, a TensorFlow team, 8 A100 of 40 GB"), 7e9, 32, 4096, 32, 4096,
                       64, 1, 8, 8, ("tf.distribute",), memory=40 * G, flops=125e12,
                       intra=150 * G, inter=12.5 * G),
    "capstone": scenario(N_("the capstone's GPT, 4 CPU ranks of a laptop"), 0.8e6, 4, 128, 4,
                         64, 16, 4, 4, 4, ("ours", "PyTorch"), memory=4 * G, flops=20e9,
                         intra=2 * G, inter=2 * G),
}


def as_scenario(spec: dict) -> Any:
    """`spec` as a `course_lib.planning.Scenario`, its name in the learner's language."""
    from course_lib.planning import Scenario

    return Scenario(**{**spec, "name": _(spec["name"])})


def scenarios() -> list[Any]:
    """Every scenario of the lesson, in order (`as_scenario`)."""
    return [as_scenario(spec) for spec in SCENARIOS.values()]


def cost_harness(fn, spec: dict, dp: int, tp: int, pp: int, zero: int) -> dict:
    got = fn(as_scenario(spec), dp, tp, pp, zero)
    if not isinstance(got, dict) or not {"memory", "comm", "time"} <= set(got):
        return {"memory (GB)": f"a dict with memory, comm and time expected, got {got!r}"[:200]}
    return {"memory (GB)": float(got["memory"]) / G, "comm (GB)": float(got["comm"]) / G,
            "time (s)": float(got["time"])}


def _cost_case(key: str, dp: int, tp: int, pp: int, zero: int, *, label: str):
    return case(SCENARIOS[key], dp, tp, pp, zero, label=label)


register(Exercise(
    name="lesson11.step_cost",
    notebook=PART_C,
    params=("s", "dp", "tp", "pp", "zero"),
    cases=[
        _cost_case("1.3B", 8, 1, 1, 0, label="1.3B on 8 GPUs: DDP"),
        _cost_case("1.3B", 8, 1, 1, 1, label="1.3B on 8 GPUs: ZeRO-1"),
        _cost_case("7B, 24 GB", 8, 1, 1, 3, label="7B on 8 GPUs of 24 GB: ZeRO-3"),
        _cost_case("7B, 2 nodes", 16, 1, 1, 2, label="7B, 2 nodes: dp 16 across them, ZeRO-2"),
        _cost_case("7B, 2 nodes", 2, 8, 1, 0, label="7B, 2 nodes: tp 8 in each, dp 2"),
        _cost_case("7B, 2 nodes", 8, 1, 2, 0, label="7B, 2 nodes: pp 2 across them, dp 8"),
        _cost_case("70B", 16, 2, 2, 2, label="70B on 64 GPUs: dp 16, tp 2, pp 2, ZeRO-2"),
    ],
    reference="lesson11:step_cost",
    explain="lesson11:explain_step_cost",
    harness=cost_harness,
    rtol=1e-6,
    points=2,
    hints=("Three sums, each from a lesson: the bytes of the model states a device keeps (08a "
           "and 08b, on its share of the parameters after tp and pp) plus the activations; the "
           "bytes it sends per step over each of its groups; the compute stretched by the "
           "pipeline's bubble (07a) plus each group's bytes over that group's link.",
           "Work per group. dp: the stage's bf16 gradients, all-reduced (ZeRO-3 also gathers "
           "the parameters twice). tp: 2 all-reduces forward and 2 backward per layer and "
           "micro-batch. pp: one activation forward and its gradient back per micro-batch. A "
           "group's link is the fast one only if all its ranks fit in one node."),
))


def plan_harness(fn, spec: dict) -> dict | None:
    got = fn(as_scenario(spec))
    if got is None:
        return None
    if not isinstance(got, dict):
        return {"layout": f"a dict or None expected, got {got!r}"[:200]}
    try:
        out = {"layout": [int(got["dp"]), int(got["tp"]), int(got["pp"]), int(got["zero"])],
               "stack": got["stack"]}
        out.update({"memory (GB)": float(got["memory"]) / G, "time (s)": float(got["time"])})
    except (KeyError, TypeError, ValueError) as exc:
        return {"layout": f"missing or wrong field: {exc!r}"[:200]}
    return out


register(Exercise(
    name="lesson11.plan",
    notebook=PART_C,
    params=("s",),
    cases=[case(SCENARIOS["1.3B"], label="fine-tune 1.3B, one node of 8 A100"),
           case(SCENARIOS["7B, 2 nodes"], label="7B, 2 nodes of 8 H100, 100 Gb/s"),
           case(SCENARIOS["70B"], label="70B, 8 nodes of 8 H100"),
           case(SCENARIOS["7B, 24 GB"], label="7B on 8 GPUs of 24 GB"),
           case(SCENARIOS["70B, 24 GB"], label="70B on 8 GPUs of 24 GB"),
           case(SCENARIOS["TF, 350M"], label="350M, a TensorFlow team"),
           case(SCENARIOS["TF, 7B"], label="7B, a TensorFlow team"),
           case(SCENARIOS["capstone"], label="the capstone on a laptop")],
    reference="lesson11:plan",
    explain="lesson11:explain_plan",
    harness=plan_harness,
    rtol=1e-6,
    points=2,
    hints=("Among the layouts that are possible at all (every device used, tp inside a node and "
           "dividing the heads, pp dividing the layers, whole micro-batches per replica) and "
           "that fit in a device's memory, the one whose step is shortest; on a tie, the "
           "simplest. Then the first stack the team accepts that does everything the layout "
           "needs.",
           "Try every pp, then every tp, then ZeRO stages 0 to 3, in increasing order, and keep "
           "a layout only if it is strictly faster than the best so far: ties then go to the "
           "smaller pipeline, the smaller tp, the lower ZeRO stage. Nothing fits: None."),
))
