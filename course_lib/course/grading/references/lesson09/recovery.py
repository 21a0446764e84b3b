"""Lesson 09b's expected values and explanations (recovery): `standing`, `run_state`,
`accumulation_steps` and `checkpoints`.

Components (course_lib.training_state, ...) are imported inside the functions that use them, on
purpose: the learner's overlay decides at each call which version runs (theirs or the
reference), and a name bound at import time would keep the first one.
"""

from __future__ import annotations

from course_lib.course.grading.exercises.lesson09 import recovery as ex
from course_lib.i18n import _


# --- standing ---------------------------------------------------------------------------------


def _same(a: dict, b: dict) -> bool:
    return all(a[key] == b[key] for key in ("seq", "op", "dtype", "shape"))


def _standing(call: dict, record: list | None) -> dict:
    if record is None:
        return {"verdict": "no answer"}
    here = [e for e in record if e["seq"] == call["seq"]]
    if here and _same(here[-1], call):
        return {"verdict": "same call", "state": here[-1]["state"]}
    done = [e["seq"] for e in record if e["state"] == "completed" and e["seq"] < call["seq"]]
    inside = [e for e in record if e["state"] == "started"]
    return {"verdict": "other call" if here else "behind",
            "last completed": max(done) if done else None,
            "in": inside[-1] if inside else None, "called": here[-1] if here else None}


def standing(scenario: str) -> list:
    call, records = ex.SCENARIOS[scenario]
    return [None] + [_standing(call, records[r]) for r in range(1, 1 + max(records))]


def _call(entry: dict | None) -> str:
    if not entry:
        return _("nothing")
    return f"{entry['op']} #{entry['seq']}"


def explain_standing(case, rank, expected, got) -> str | None:
    if not isinstance(got, list) or len(got) != len(expected):
        return None
    call = ex.SCENARIOS[case.args[0]][0]
    for r, (want, have) in enumerate(zip(expected, got)):
        if want == have or want is None:
            continue
        if not isinstance(have, dict):
            return _("rank {r}: not a verdict (a dict)", r=r)
        verdict, wanted = have.get("verdict"), want["verdict"]
        if wanted == "same call" and verdict != "same call":
            if want["state"] == "started":
                return _("rank {r} is inside {call} too: it waits like the asking rank, it is "
                         "not the one to blame", r=r, call=_call(call))
            return _("rank {r} made the same call, {call} ({state}): it is not behind", r=r,
                     call=_call(call), state=want["state"])
        if wanted == "other call" and verdict == "same call":
            return _("rank {r}'s #{seq} is {theirs}, not the asking rank's call: the same "
                     "sequence number with another op, dtype or shape is another call",
                     r=r, seq=call["seq"], theirs=_call(want["called"]) + (
                         f" {want['called']['dtype']}{want['called']['shape']}"
                         if want["called"].get("dtype") else ""))
        if wanted == "behind" and verdict == "same call":
            return _("rank {r} has not called #{seq} at all: it is the one behind", r=r,
                     seq=call["seq"])
        if verdict != wanted:
            return _("rank {r}: verdict {got}, expected {want}", r=r, got=verdict, want=wanted)
        if "state" in want and have.get("state") != want["state"]:
            return _("rank {r} is in the same call, its state there is {state}", r=r,
                     state=want["state"])
        if have.get("last completed") != want.get("last completed"):
            return _("rank {r} last completed #{want} (the highest completed below #{seq}), not "
                     "{got}", r=r, want=want["last completed"], seq=call["seq"],
                     got=have.get("last completed"))
        if have.get("in") != want.get("in"):
            return _("rank {r} is now in {want}, not {got}", r=r, want=_call(want.get("in")),
                     got=_call(have.get("in")) if isinstance(have.get("in"), dict)
                     else have.get("in"))
        if have.get("called") != want.get("called"):
            return _("rank {r} called {want} at #{seq}, not {got}", r=r,
                     want=_call(want.get("called")), seq=call["seq"],
                     got=_call(have.get("called")) if isinstance(have.get("called"), dict)
                     else have.get("called"))
        return None
    return None


# --- run_state --------------------------------------------------------------------------------


def run_state(rank: int, world_size: int, k: int) -> dict | None:
    if rank >= k:
        return None
    from course_lib.training_state import ResumableSampler

    sampler = ResumableSampler(range(ex.RESUME_SAMPLES), num_replicas=k, rank=rank,
                               shuffle=True, seed=5)
    for _step in range(ex.RESUME_STEPS // 2 + 1):
        if sampler.position >= ex.RESUME_SAMPLES:
            sampler.set_epoch(sampler.epoch + 1)
        if _step < ex.RESUME_STEPS // 2:
            sampler.position += ex.RESUME_PER_RANK * k
    half = ex.RESUME_STEPS // 2
    return {"resumes at step": half, "next samples": list(sampler)[:ex.RESUME_PER_RANK],
            "learning rate": 0.05 * 0.5 ** (half // 2),
            "next random draw": "as in the uninterrupted run",
            "parameters": "bitwise equal to the uninterrupted run's"}


def explain_run_state(case, rank, expected, got) -> str | None:
    if not isinstance(got, dict) or not isinstance(expected, dict):
        return None
    step = got.get("resumes at step")
    if isinstance(step, str) and step.startswith("load failed"):
        if "optim" in step:
            return _("the state to load into has no optimizer state ({detail}): a fresh "
                     "optimizer has none until it is created for the load", detail=step)
        return _("the resumed run could not load its checkpoint ({detail})", detail=step)
    if isinstance(step, str) and step.startswith("restore failed"):
        missing = step.rsplit(" ", 1)[-1].strip("'\"")
        if missing == "rng":
            return _("the checkpoint holds no RNG state: the resumed run would draw other random "
                     "numbers (dropout masks) than the uninterrupted one")
        if missing.startswith("rank"):
            return _("the restore finds no RNG state for rank {rank}: a rank's own RNG state "
                     "goes under a key that names the rank, or the checkpoint keeps only one "
                     "rank's", rank=rank)
        if missing == "sampler":
            return _("the checkpoint holds no sampler state: the resumed run would read the "
                     "epoch again from its start")
        if missing == "sched":
            return _("the checkpoint holds no scheduler state: the resumed run would step at "
                     "the first learning rate again")
        return _("the restore cannot find what it expects ({detail})", detail=step)
    if step != expected["resumes at step"]:
        return _("the resumed run goes on from step {got}, not {want}", got=step,
                 want=expected["resumes at step"])
    if got.get("next samples") != expected["next samples"]:
        return _("the resumed run reads samples {got} next, the uninterrupted one {want}: the "
                 "sampler's place in the epoch was not saved", got=got.get("next samples"),
                 want=expected["next samples"])
    if got.get("learning rate") != expected["learning rate"]:
        return _("the resumed run steps at learning rate {got}, the uninterrupted one at {want}: "
                 "the scheduler's state was not saved", got=got.get("learning rate"),
                 want=expected["learning rate"])
    if got.get("next random draw") != expected["next random draw"]:
        return _("rank {rank} draws other random numbers (dropout masks) after resuming: its own "
                 "RNG state was not saved, or another rank's came back in its place", rank=rank)
    if got.get("parameters") != expected["parameters"]:
        return _("the parameters after resuming {got}, though the samples, the learning rate "
                 "and the random numbers agree: the optimizer's state (Adam's moments) did not "
                 "come back", got=got.get("parameters"))
    return None


# --- accumulation_steps -------------------------------------------------------------------------


def accumulation_steps(global_batch: int, micro_batch: int, world_size: int):
    per_round = micro_batch * world_size
    return "raises ValueError" if global_batch % per_round else global_batch // per_round


def explain_accumulation_steps(case, rank, expected, got) -> str | None:
    g, m, w = case.args
    if expected == "raises ValueError":
        if isinstance(got, int):
            return _("{got} rounds of {w} x {m} samples is {n}, not the global batch of {g}: a "
                     "step that cannot take exactly {g} samples must be refused",
                     got=got, w=w, m=m, n=got * w * m, g=g)
        return None
    if isinstance(got, int) and not isinstance(got, bool):
        return _("{got} rounds of {w} ranks x {m} samples take {n} samples per step, not {g}",
                 got=got, w=w, m=m, n=got * w * m, g=g)
    if got == "raises ValueError":
        return _("{w} ranks x {m} samples divide {g} exactly: no error here", w=w, m=m, g=g)
    return None


# --- checkpoints -------------------------------------------------------------------------------

_CHECKPOINTS = {"plain": [15, 10, 5], "damaged": [300, 200, 100], "wide": [100, 99, 11, 10, 9, 8]}


def checkpoints(layout: str) -> list:
    return [(s, f"step-{s:09d}") for s in _CHECKPOINTS[layout]]


def explain_checkpoints(case, rank, expected, got) -> str | None:
    if not isinstance(got, list):
        return None
    names = [n for _, n in got if isinstance(n, str)]
    if "step-000000900" in names:
        return _("step-000000900 has no manifest: its save never finished, it is not a "
                 "checkpoint")
    if "step-000000400" in names:
        return _("step-000000400's shard is shorter than its manifest says: it is not whole")
    strays = [n for n in names if n not in {x for _, x in expected}]
    if strays:
        return _("{name} is not a complete checkpoint", name=strays[0])
    if sorted(got) == sorted(expected) and got != expected:
        if got == list(reversed(expected)):
            return _("oldest first: the newest (highest step) must come first")
        return _("not ordered by step as a number, newest first")
    missing = [n for _, n in expected if n not in names]
    if missing:
        return _("{name} is complete but missing from the list", name=missing[0])
    return None
