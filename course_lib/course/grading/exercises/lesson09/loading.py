"""Lesson 09a's reading checks: `read_plan` (which saved pieces fill a rank's range) and `load`
on the first 2, 3 and 4 ranks of the grader's cluster (a checkpoint saved on another number of
ranks, a flipped byte, a missing piece).

Components (course_lib.checkpoint_files, ...) are imported inside the functions that use them,
on purpose: the learner's overlay decides at each call which version runs (theirs or the
reference), and a name bound at import time would keep the first one.
"""

from __future__ import annotations

import math

from course_lib.course.grading import RANK, WORLD_SIZE, Exercise, case, register
from course_lib.course.catalogue import CheckTimeout
from course_lib.course.grading.exercises.lesson09.fixtures import (W_NUMEL, _cleanup, _raised,
                                                                  _shared_folder, padded_pieces,
                                                                  write_fixture)
from course_lib.course.grading.exercises.lesson09.saving import PART_A
from course_lib.course.grading.sub_worlds import on_first_ranks, register_on_sub_worlds


# --- lesson09.read_plan -----------------------------------------------------------------------


def plan_harness(fn, saved: list, start: int, stop: int) -> list:
    """Fill [start, stop) through the learner's plan from pieces holding 100 + element index;
    -1 where nothing was read, "twice" where two reads overlap."""
    out: list = [-1] * (stop - start)
    for i, src, dst, n in fn([tuple(p) for p in saved], start, stop):
        offset, numel = saved[i]
        if n > 0 and 0 <= src and src + n > numel:
            return [f"read ({i}, {src}, {dst}, {n}) runs past the end of piece {i} "
                    f"({numel} elements)"]
        if n <= 0 or src < 0 or dst < 0 or dst + n > stop - start:
            return [f"read ({i}, {src}, {dst}, {n}) falls outside piece {i} or the range"]
        for k in range(n):
            out[dst + k] = "twice" if out[dst + k] != -1 else 100 + offset + src + k
    return out


def _want(numel: int, world: int, rank: int) -> tuple[int, int]:
    """The elements [start, stop) `rank` of `world` owns: equal padded shards, cut at the end."""
    offset, n = padded_pieces(numel, world)[rank]
    return offset, offset + n


def flat_buffer_pieces(shapes: list[int], world: int, which: int) -> list[tuple[int, int]]:
    """The pieces of tensor `which` when tensors of `shapes` numels share one flat buffer
    sharded over `world` ranks (ZeRO's layout): in the tensor's own element numbers."""
    size = math.ceil(sum(shapes) / world)
    start = sum(shapes[:which])
    out = []
    for r in range(world):
        lo, hi = max(r * size, start), min((r + 1) * size, start + shapes[which])
        if lo < hi:
            out.append((lo - start, hi - lo))
    return out



# A 3 x 5 weight after a 3-element bias in one flat buffer: saved by ZeRO on 4 ranks, its
# pieces are (0, 2), (2, 5), (7, 5), (12, 3); 3 ranks of the same layout want 3 of 15 each.
_FLAT = flat_buffer_pieces([3, 15], 4, 1)

register(Exercise(
    name="lesson09.read_plan",
    notebook=PART_A,
    params=("saved", "start", "stop"),
    cases=[case(padded_pieces(13, 4), *_want(13, 2, 0),
                label="13 elements saved on 4 ranks, rank 0 of 2 loads"),
           case(padded_pieces(13, 4), *_want(13, 2, 1),
                label="13 elements saved on 4 ranks, rank 1 of 2 loads"),
           case(padded_pieces(10, 2), *_want(10, 3, 1),
                label="10 elements saved on 2 ranks, rank 1 of 3 loads"),
           case(padded_pieces(10, 2), *_want(10, 3, 2),
                label="10 elements saved on 2 ranks, rank 2 of 3 loads"),
           case(padded_pieces(17, 3), *_want(17, 4, 3),
                label="17 elements saved on 3 ranks, rank 3 of 4 loads"),
           case(padded_pieces(17, 3), *_want(17, 4, 0),
                label="17 elements saved on 3 ranks, rank 0 of 4 loads"),
           case(padded_pieces(5, 4), *_want(5, 3, 1),
                label="5 elements saved on 4 ranks, rank 1 of 3 loads"),
           case(_FLAT, 3, 9,
                label="a weight in a shared flat buffer, saved on 4: rank 1 of 3 loads"),
           case(_FLAT, 9, 15,
                label="a weight in a shared flat buffer, saved on 4: rank 2 of 3 loads"),
           case([(0, 12)], 3, 9, label="one whole saved tensor, a middle slice"),
           case([(0, 4), (4, 4), (8, 4)], 0, 12, label="every piece, exactly"),
           case([(0, 4), (4, 4), (8, 4)], 4, 8, label="exactly the second piece"),
           case([(0, 4), (4, 4), (8, 4)], 6, 6, label="an empty range")],
    reference="lesson09:read_plan",
    explain="lesson09:explain_read_plan",
    harness=plan_harness,
    points=2,
    hints=("A saved piece and the wanted range are two intervals of the same flattened tensor, "
           "both in its global element numbers; a piece contributes exactly where the two "
           "intervals overlap, and pieces that do not overlap contribute nothing.",
           "Draw both intervals on one number line. The overlap's first element, counted from "
           "the piece's own first element, is where to read; counted from the range's first "
           "element, where to write; its length is how many. The pieces need not be of equal "
           "length."),
))


# --- lesson09.load ----------------------------------------------------------------------------


def load_target(rank: int, k: int) -> dict:
    """Rank `rank` of `k`'s state to load into: its new piece of `w` (-1 everywhere), a zero
    `bias`, step 0."""
    import torch

    from course_lib.zero import Piece

    offset, n = padded_pieces(W_NUMEL, k)[rank]
    return {"w": Piece(torch.full((n,), -1.0, dtype=torch.float64), offset,
                       torch.Size([W_NUMEL])), "bias": torch.zeros(4), "step": 0}


def _load_body(dist, rank: int, fn, saved_on: int, scenario: str) -> dict:
    from course_lib import checkpoint_files as cf

    k = dist.get_world_size()
    folder = _shared_folder(dist, rank, "load")
    try:
        if rank == 0:
            write_fixture(folder, saved_on, drop_last_piece=scenario == "a piece missing")
            if scenario == "a flipped byte":  # in the last old rank's shard: w's last piece
                shard = folder / cf.shard_name(saved_on - 1, saved_on, "f1x7")
                data = bytearray(shard.read_bytes())
                data[-3] ^= 0x40
                shard.write_bytes(bytes(data))
        dist.barrier()
        state = load_target(rank, k)
        raised = None
        try:
            fn(state, folder, dist=dist)
        except (NotImplementedError, CheckTimeout):
            raise
        except Exception as exc:  # noqa: BLE001 - what the learner's load raised
            text = str(exc)
            raised = ("CheckpointError: checksum mismatch" if "checksum" in text else
                      "CheckpointError: elements missing" if "not all" in text else
                      _raised(exc)) if isinstance(exc, cf.CheckpointError) else _raised(exc)
        return {"raised": raised, "w": [round(float(v), 6) for v in state["w"].tensor],
                "bias": [float(v) for v in state["bias"]], "step": state["step"]}
    finally:
        _cleanup(dist, rank, folder)


def load_harness(fn, rank: int, world_size: int, k: int, saved_on: int, scenario: str):
    return on_first_ranks(k, _load_body, fn, saved_on, scenario)


register_on_sub_worlds(
    "lesson09.load", PART_A,
    params=("state_dict", "checkpoint_id"),
    cases=[case(RANK, WORLD_SIZE, 2, 4, "whole", label="saved on 4 ranks, loaded on 2"),
           case(RANK, WORLD_SIZE, 3, 4, "whole", label="saved on 4 ranks, loaded on 3"),
           case(RANK, WORLD_SIZE, 4, 3, "whole", label="saved on 3 ranks, loaded on 4"),
           case(RANK, WORLD_SIZE, 3, 2, "a flipped byte",
                label="saved on 2 ranks, one byte of a shard flipped, loaded on 3"),
           case(RANK, WORLD_SIZE, 4, 4, "a flipped byte",
                label="saved on 4 ranks, one byte of a shard flipped, loaded on 4"),
           case(RANK, WORLD_SIZE, 2, 3, "a piece missing",
                label="saved on 3 ranks, the manifest lacks a piece, loaded on 2"),
           case(RANK, WORLD_SIZE, 4, 2, "a piece missing",
                label="saved on 2 ranks, the manifest lacks a piece, loaded on 4")],
    reference="lesson09:load",
    explain="lesson09:explain_load",
    harness=load_harness,
    points=3,
    time_limit=20.0,
    hints=("Nothing may change before everything is known to be right: every piece this rank "
           "needs is in the checkpoint, every file it reads matches the manifest's checksum, "
           "and every other rank found the same. A rank's new piece sits at its own global "
           "offset in the tensor, which is not where any old rank's piece sat.",
           "Two passes. First, for each tensor, the reads that fill it (your read_plan, in "
           "global offsets), a check that they cover all of it, and each needed file mapped and "
           "checksummed; every rank then hears every rank's verdict. Only if all is well, "
           "second pass: the copies."),
)
