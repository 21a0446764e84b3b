"""Lesson 11's exercises: the solutions (exported into course_lib.layout and course_lib.train)
score full points; realistic wrong versions score less, with a reason that says what is wrong."""

from __future__ import annotations

import contextlib

import torch

from conftest import full, less
from course_lib import layout, train


# lesson11.layout_groups ----------------------------------------------------------------------

def tp_strided(dp, tp, pp):
    """tp groups strided across the stage (the ranks that talk most, far apart)."""
    g = layout.layout_groups(dp, tp, pp)
    per_stage = dp * tp
    g["tp"] = [[p * per_stage + d + t * dp for t in range(tp)] for p in range(pp)
               for d in range(dp)]
    g["dp"] = [[p * per_stage + d + t * dp for d in range(dp)] for p in range(pp)
               for t in range(tp)]
    return g


def dp_across_stages(dp, tp, pp):
    """pp inside dp: rank = (dp_rank * pp + pp_rank) * tp + tp_rank, so a dp group spans stages."""
    def rank(p, d, t):
        return (d * pp + p) * tp + t
    return {"tp": sorted([[rank(p, d, t) for t in range(tp)] for p in range(pp) for d in range(dp)]),
            "dp": sorted([[rank(p, d, t) for d in range(dp)] for p in range(pp) for t in range(tp)]),
            "pp": sorted([[rank(p, d, t) for p in range(pp)] for d in range(dp) for t in range(tp)])}


def powers_of_two_only(dp, tp, pp):
    """Bit tricks on the rank: right only when every degree is a power of two."""
    world = dp * tp * pp
    tb, db = tp.bit_length() - 1, dp.bit_length() - 1
    out = {"tp": {}, "dp": {}, "pp": {}}
    for r in range(world):
        t, d, p = r & (tp - 1), (r >> tb) & (dp - 1), r >> (tb + db)
        out["tp"].setdefault((p, d), []).append(r)
        out["dp"].setdefault((p, t), []).append(r)
        out["pp"].setdefault((d, t), []).append(r)
    return {a: sorted(v.values()) for a, v in out.items()}


def groups_unordered(dp, tp, pp):
    g = layout.layout_groups(dp, tp, pp)
    return {a: list(reversed(v)) for a, v in g.items()}


def test_layout_groups_solution_and_mistakes():
    full("lesson11.layout_groups", layout.layout_groups)
    for wrong in (tp_strided, dp_across_stages, powers_of_two_only, groups_unordered):
        less("lesson11.layout_groups", wrong)


# lesson11.precision_forward ------------------------------------------------------------------

def master_weights_in_bf16(module, args, precision):
    """Casts the model: the optimizer would then update bf16 weights (and lose small steps)."""
    if precision == "fp32":
        return module(*args)
    dtype = train.PRECISIONS[precision]
    module.to(dtype)
    return module(*(a.to(dtype) for a in args)).float()


def loss_in_bf16(module, args, precision):
    """Autocast, but the output stays bf16: the loss (a softmax over the vocabulary) too."""
    dtype = train.PRECISIONS[precision]
    with torch.autocast("cpu", dtype=dtype) if dtype else contextlib.nullcontext():
        return module(*args)


def no_autocast(module, args, precision):
    """Says bf16, computes fp32: right numbers, none of the speed or memory."""
    return module(*args)


def autocast_even_for_fp32(module, args, precision):
    with torch.autocast("cpu", dtype=torch.bfloat16):
        return module(*args).float()


def test_precision_forward_solution_and_mistakes():
    full("lesson11.precision_forward", train.precision_forward)
    for wrong in (master_weights_in_bf16, loss_in_bf16, no_autocast, autocast_even_for_fp32):
        less("lesson11.precision_forward", wrong)


# lesson11.update_scale -----------------------------------------------------------------------

def keeps_count_after_overflow(scale, growth_tracker, found_inf, *, growth_factor=2.0,
                               backoff_factor=0.5, growth_interval=2000):
    if found_inf:
        return scale * backoff_factor, growth_tracker
    growth_tracker += 1
    if growth_tracker == growth_interval:
        return scale * growth_factor, 0
    return scale, growth_tracker


def grows_one_step_late(scale, growth_tracker, found_inf, *, growth_factor=2.0,
                        backoff_factor=0.5, growth_interval=2000):
    if found_inf:
        return scale * backoff_factor, 0
    if growth_tracker == growth_interval:
        return scale * growth_factor, 0
    return scale, growth_tracker + 1


def never_restarts_after_growth(scale, growth_tracker, found_inf, *, growth_factor=2.0,
                                backoff_factor=0.5, growth_interval=2000):
    if found_inf:
        return scale * backoff_factor, 0
    growth_tracker += 1
    if growth_tracker % growth_interval == 0:
        return scale * growth_factor, growth_tracker
    return scale, growth_tracker


def shrinks_to_zero(scale, growth_tracker, found_inf, *, growth_factor=2.0,
                    backoff_factor=0.5, growth_interval=2000):
    if found_inf:
        return 0.0, 0
    return train.update_scale(scale, growth_tracker, False, growth_interval=growth_interval)


def test_update_scale_solution_and_mistakes():
    full("lesson11.update_scale", train.update_scale)
    for wrong in (keeps_count_after_overflow, grows_one_step_late, never_restarts_after_growth,
                  shrinks_to_zero):
        less("lesson11.update_scale", wrong)
