"""Lesson 07d's expected values and explanations (judge side). The interleaved order's gold
lists are `interleaved_order.json` (v = 2); the first conflicts of the matching cases are
below; the backward split's expected values come from one process on the whole batch.

Components are imported inside the functions that use them, on purpose: the learner's overlay
decides at each call which version runs, and the judge must never run the learner's.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from course_lib.i18n import _

GOLD = {f"{g['n_microbatches']},{g['num_stages']},{g['stage_index']}": g["actions"]
        for g in json.loads((Path(__file__).with_name("interleaved_order.json")).read_text())}


def interleaved_order(n_microbatches: int, num_stages: int, stage_index: int,
                      chunks_per_stage: int = 2) -> list:
    return [tuple(a) for a in GOLD[f"{n_microbatches},{num_stages},{stage_index}"]]


def explain_interleaved(case: Any, rank: Any, expected: Any, got: Any) -> str | None:
    """The checker's verdict on the schedule with this stage's list as got and the others'
    gold: a deadlock names its pair; a schedule that runs is compared with the formula."""
    from course_lib import pipeline_actions as acts
    from course_lib import pipeline_check as chk

    m, p, s = case.args[:3]
    try:
        stages = [tuple(acts.as_action(a) for a in (got if t == s else
                                                    interleaved_order(m, p, t)))
                  for t in range(p)]
        schedule = acts.Schedule("yours", m, acts.looped_placement(p, 2), tuple(stages))
        timeline = chk.simulate(schedule)
    except chk.ScheduleError as err:
        return str(err)
    except (TypeError, ValueError, IndexError):
        return None
    idle = max(chk.idle_times(timeline, p))
    want = chk.idle_time("interleaved", p, m, chk.Costs())
    return _("runs, but the stages idle {idle} units of a step (F = B = W = 1 per stage) where "
             "interleaving with v = 2 idles {want}; its busiest stage stores {peak} micro-batches",
             idle=f"{idle:g}", want=f"{want:g}", peak=f"{max(chk.peak_activations(schedule)):g}")


def split_step(rank: int, world_size: int, k: int, name: str, m: int, seed: int) -> dict | None:
    """One process on the whole batch: the gradients of this rank's chunks; no weight gradient
    inside B, no forward inside W."""
    from course_lib import pipeline_actions as acts
    from course_lib import pipeline_multi as ex

    if rank >= k:
        return None
    placement = acts.v_placement(k) if name == "zbv" else acts.looped_placement(k)
    x, y = ex.make_batch(seed, 2 * m)
    grads = ex.reference_grads(ex.build_model(seed, blocks=8), x, y, len(placement))
    mine = [c for c, at in enumerate(placement) if at == rank]
    return {"stage gradients": [g for c in mine for g in grads[c]],
            "weight gradients inside B": 0, "layer forwards inside W": 0}


def explain_split(case: Any, rank: Any, expected: Any, got: Any) -> str | None:
    if not isinstance(got, dict) or not isinstance(expected, dict):
        return None
    if got.get("weight gradients inside B"):
        return _("{n} weight gradients were accumulated inside B, before its input gradient "
                 "left: the stage before waits for this stage's W too",
                 n=got["weight gradients inside B"])
    if got.get("layer forwards inside W"):
        return _("W ran {n} layer forwards again: W needs no forward, the graph F built is "
                 "still there", n=got["layer forwards inside W"])
    return None


CONFLICTS = {"prefetch-1f1b": 3, "plain-1f1b": 1, "07c-gpipe": None, "07c-fixed": None,
             "ordered-zb-h1": None, "swapped": 0, "missing": 7, "zbv-plain": 1}


def first_conflict(scenario: str) -> int | None:
    return CONFLICTS[scenario]


def _side(ops: list, k: int) -> str:
    return str(ops[k]) if k < len(ops) else _("nothing (its list has ended)")


def explain_conflict(case: Any, rank: Any, expected: Any, got: Any) -> str | None:
    from course_lib.course.grading.exercises.lesson07 import pair_of

    if not (got is None or isinstance(got, int)):
        return None
    mine, theirs = pair_of(case.args[0])
    if expected is None:
        return _("every operation here meets its partner at the same position on the other "
                 "side: nothing conflicts")
    at = _("at operation #{k} the first rank issues {a} and the second {b}: not the two ends "
           "of one message, so NCCL pairs the wrong operations there", k=expected + 1,
           a=_side(mine, expected), b=_side(theirs, expected))
    if got is not None and got > expected:
        return _("a conflict at an earlier position was missed: {at}", at=at)
    if got is not None:
        return _("operation #{k} on both sides is the two ends of one message ({a})", k=got + 1,
                 a=_side(mine, got))
    return at
