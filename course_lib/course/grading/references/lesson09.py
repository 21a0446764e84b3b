"""Lesson 09's expected values and explanations (judge side: see this package's docstring).

Components (course_lib.ddp, ...) are imported inside the functions that use them, on
purpose: the learner's overlay decides at each call which version runs (theirs or the
reference), and a name bound at import time would keep the first one.
"""

from __future__ import annotations

import re

from course_lib.course.grading.exercises import lesson09 as ex
from course_lib.i18n import _

DURABLE = "fsynced, then renamed into place"


# --- write_atomic -----------------------------------------------------------------------------


def write_atomic(scenario: str) -> dict:
    if scenario == "killed":
        return {"file holds": "the old bytes"}
    return {"file holds": "all the new bytes", "error": None,
            "new bytes fsynced before the rename": True, "folder fsynced after the rename": True,
            "other files left in the folder": 0}


def explain_write_atomic(case, rank, expected, got) -> str | None:
    if not isinstance(got, dict):
        return None
    holds = str(got.get("file holds", ""))
    if holds.startswith("a mix"):
        return _("killed half-way, the file holds part of the new bytes over the old: the write "
                 "went to the file's own name, so a crash tears it")
    if holds == "nothing (gone)":
        return _("the old file was gone before the new one was whole: a crash at that moment "
                 "leaves no checkpoint at all")
    if "finished" in got:
        return _("the write did not finish within 10 s")
    if got.get("error"):
        return _("the write raised {error}", error=got["error"])
    if got.get("new bytes fsynced before the rename") is False:
        return _("the new bytes took the name before they were fsynced (or never took it by a "
                 "rename): after a power cut the name can point at a file whose bytes never "
                 "reached the disk")
    if got.get("folder fsynced after the rename") is False:
        return _("the folder was not fsynced after the rename: after a power cut the rename "
                 "itself can be lost and the old bytes come back")
    if got.get("other files left in the folder"):
        return _("{n} file(s) left beside the result: the temporary file must not outlive the "
                 "write", n=got["other files left in the folder"])
    return None


# --- save -------------------------------------------------------------------------------------


def save(rank: int, world_size: int, k: int, scenario: str) -> dict | None:
    if rank >= k:
        return None
    if scenario == "disk full":
        out = {"raised": f"CheckpointError naming rank {k - 1}",
               "own shard": "none" if rank == k - 1 else DURABLE}
        if rank == 0:
            out.update({"manifest": "the previous one, untouched",
                        "loads as": "the previous state"})
        return out
    out = {"raised": None, "own shard": DURABLE, "on return": "the new manifest is on disk"}
    if rank == 0:
        out.update({"manifest": "fsynced, renamed into place after every shard it names",
                    "loads as": "the new state"})
        if scenario == "over an old one":
            out["earlier files left"] = 0
    return out


def explain_save(case, rank, expected, got) -> str | None:
    if not isinstance(got, dict) or not isinstance(expected, dict):
        return None
    k = case.args[2]
    raised, want_raised = got.get("raised"), expected.get("raised")
    if want_raised and raised is None:
        return _("rank {rank} returned normally although rank {failed} could not write its "
                 "shard: every rank must hear of a failure and raise", rank=rank, failed=k - 1)
    if want_raised and raised != want_raised:
        if str(raised).startswith("CheckpointError"):
            return _("rank {rank} raised, but its error does not name rank {failed}, the rank "
                     "whose shard failed", rank=rank, failed=k - 1)
        return _("rank {rank} let {error} escape: the other ranks never hear of it and wait "
                 "for a rank that gave up", rank=rank, error=raised)
    if raised and not want_raised:
        return _("rank {rank} raised {error} on a save that should succeed", rank=rank,
                 error=raised)
    manifest = str(got.get("manifest", ""))
    if "manifest" in expected and manifest != expected["manifest"]:
        if "before rank" in manifest:
            return _("the manifest was renamed into place {when}: it went down before every "
                     "shard was known to be whole", when=manifest.split("place ", 1)[-1])
        if manifest == "written in place (no rename)":
            return _("the manifest was written under its own name, not renamed into place: a "
                     "crash mid-write leaves a torn manifest")
        if manifest == "renamed into place without an fsync first":
            return _("the manifest was renamed into place without an fsync first")
        if manifest.startswith("renamed into place, the folder"):
            return _("the folder was not fsynced after the manifest's rename")
        if expected["manifest"] == "the previous one, untouched":
            return _("a new manifest went down although rank {failed} failed: it names a shard "
                     "that is not on disk, and the previous checkpoint is lost",
                     failed=k - 1)
        if manifest == "none":
            return _("no manifest was written: the save never becomes a checkpoint")
    shard = got.get("own shard")
    if shard != expected.get("own shard"):
        if shard == "renamed into place without an fsync first":
            return _("rank {rank}'s shard was renamed into place before it was fsynced",
                     rank=rank)
        if shard == "written under its final name (no rename)":
            return _("rank {rank}'s shard was written under its final name, not renamed into "
                     "place", rank=rank)
        if shard == "none":
            return _("rank {rank} wrote no shard", rank=rank)
    if got.get("on return") == "no new manifest yet":
        return _("rank {rank} returned before the manifest was on disk: a crash right after "
                 "leaves its caller believing in a checkpoint that does not exist", rank=rank)
    if got.get("earlier files left"):
        return _("{n} file(s) of the earlier checkpoint were left in the folder",
                 n=got["earlier files left"])
    loads = str(got.get("loads as", ""))
    if "loads as" in expected and loads != expected["loads as"]:
        return _("the folder does not load as {want}: {got}", want=expected["loads as"],
                 got=loads)
    return None


# --- read_plan --------------------------------------------------------------------------------


def read_plan(saved: list, start: int, stop: int) -> list:
    return [100 + e for e in range(start, stop)]


def explain_read_plan(case, rank, expected, got) -> str | None:
    if not isinstance(got, list):
        return None
    if len(got) == 1 and isinstance(got[0], str) and "runs past the end" in got[0]:
        piece, numel = re.search(r"of piece (\d+) \((\d+) elements", got[0]).groups()
        return _("a read runs past the end of piece {i}, which holds {n} elements: a piece is "
                 "as long as its own numel, not as the longest one", i=piece, n=numel)
    if len(got) == 1 and isinstance(got[0], str) and "falls outside" in got[0]:
        return _("a read falls outside its piece or the wanted range")
    start = case.args[1]
    for i, (want, have) in enumerate(zip(expected, got)):
        if have == want:
            continue
        element = start + i
        if have == "twice":
            return _("element {e} is read twice: two reads overlap (a piece holds only its own "
                     "numel elements)", e=element)
        if have == -1:
            return _("element {e} is read from no piece", e=element)
        if isinstance(have, int):
            return _("element {e} of the range got element {other} of the tensor: the offset "
                     "is off by {off}", e=element, other=have - 100, off=have - 100 - element)
    if len(got) != len(expected):
        return _("{n} elements filled, the range has {m}", n=len(got), m=len(expected))
    return None


# --- load -------------------------------------------------------------------------------------


def load(rank: int, world_size: int, k: int, saved_on: int, scenario: str) -> dict | None:
    if rank >= k:
        return None
    offset, n = ex.padded_pieces(ex.W_NUMEL, k)[rank]
    if scenario == "whole":
        values = ex.saved_values(100)
        return {"raised": None, "w": values["w"][offset:offset + n], "bias": values["bias"],
                "step": 100}
    return {"raised": "CheckpointError: checksum mismatch" if scenario == "a flipped byte"
            else "CheckpointError: elements missing",
            "w": [-1.0] * n, "bias": [0.0] * 4, "step": 0}


def _reads_the_damage(rank: int, k: int, saved_on: int, scenario: str) -> bool:
    """Whether rank `rank` of `k` reads the last piece of w saved on `saved_on` ranks (the one
    the check damages or leaves out of the manifest)."""
    offset, n = ex.padded_pieces(ex.W_NUMEL, k)[rank]
    last = [p for p in ex.padded_pieces(ex.W_NUMEL, saved_on) if p[1]][-1]
    return offset < last[0] + last[1] and last[0] < offset + n


def explain_load(case, rank, expected, got) -> str | None:
    if not isinstance(got, dict) or not isinstance(expected, dict):
        return None
    k, saved_on, scenario = case.args[2], case.args[3], case.args[4]
    offset, n = ex.padded_pieces(ex.W_NUMEL, k)[rank]
    w = got.get("w")
    changed = (w != expected["w"] or got.get("bias") != expected["bias"]
               or got.get("step") != expected["step"])
    if scenario == "whole":
        if got.get("raised"):
            return _("rank {rank} raised {error} on a whole checkpoint", rank=rank,
                     error=got["raised"])
        if isinstance(w, list) and len(w) == n and w != expected["w"]:
            firsts = [v - ex.W_BASE for v in w if v != -1.0]
            if firsts and firsts[0] != offset:
                return _("rank {rank} holds elements [{a}, {b}) of w but got elements from {got} "
                         "on: a piece's place is its global offset in the tensor",
                         rank=rank, a=offset, b=offset + n, got=int(firsts[0]))
            return _("rank {rank}'s piece of w is not elements [{a}, {b}) of the saved tensor",
                     rank=rank, a=offset, b=offset + n)
        return None
    if not got.get("raised"):
        if not _reads_the_damage(rank, k, saved_on, scenario):
            return _("rank {rank} loaded its part although another rank refused it: no rank may "
                     "copy before every rank's verdict is known", rank=rank)
        if scenario == "a flipped byte":
            return _("rank {rank} loaded a checkpoint with a flipped byte: the shard it reads no "
                     "longer matches its CRC-32 in the manifest", rank=rank)
        return _("rank {rank} loaded a checkpoint whose manifest lacks a piece of w: the "
                 "elements it holds were never filled", rank=rank)
    if changed:
        return _("rank {rank} refused the checkpoint but had already changed its tensors: no "
                 "copy may start before every rank has checked everything", rank=rank)
    if got["raised"] != expected["raised"]:
        return _("rank {rank} raised {got}, not the error the other ranks found ({want}): "
                 "every rank must hear every rank's verdict", rank=rank, got=got["raised"],
                 want=expected["raised"])
    return None


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
