"""Lesson 09a's expected values and explanations for the reading checks: `read_plan` and
`load`."""

from __future__ import annotations

import re

from course_lib.course.grading.exercises.lesson09 import fixtures as ex
from course_lib.i18n import _


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
