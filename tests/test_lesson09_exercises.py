"""Lesson 09's exercises: the solutions score full points, realistic wrong versions less (the
atomic write is checked in a child process killed half-way)."""

from __future__ import annotations

import os
import re

from conftest import full, less
from course_lib.checkpoint import fsync_dir, read_manifest, read_plan, write_atomic
from course_lib.checkpoint import CheckpointError
from course_lib.recovery import accumulation_steps, checkpoints


# lesson09.write_atomic ------------------------------------------------------------------------

def in_place(path, parts):
    with open(path, "wb") as f:
        for part in parts:
            f.write(part)
        f.flush()
        os.fsync(f.fileno())


def rename_without_fsync(path, parts):
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        for part in parts:
            f.write(part)
    os.replace(tmp, path)


def no_folder_fsync(path, parts):
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        for part in parts:
            f.write(part)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def delete_then_write(path, parts):
    """Removes the old file first, then writes the new one under the final name."""
    path.unlink()
    with open(path, "xb") as f:
        for part in parts:
            f.write(part)
        f.flush()
        os.fsync(f.fileno())
    fsync_dir(path.parent)


def test_write_atomic_solution_and_mistakes():
    full("lesson09.write_atomic", write_atomic)
    for wrong in (in_place, rename_without_fsync, no_folder_fsync, delete_then_write):
        less("lesson09.write_atomic", wrong)


# lesson09.read_plan ---------------------------------------------------------------------------

def inclusive_end(saved, start, stop):
    out = []
    for i, (offset, numel) in enumerate(saved):
        lo, hi = max(start, offset), min(stop, offset + numel - 1)
        if lo < hi:
            out.append((i, lo - offset, lo - start, hi - lo))
    return out


def offset_from_zero(saved, start, stop):
    return [(i, src, dst + start, n) for i, src, dst, n in read_plan(saved, start, stop)]


def only_pieces_starting_inside(saved, start, stop):
    return [(i, src, dst, n) for i, src, dst, n in read_plan(saved, start, stop)
            if saved[i][0] >= start]


def same_index_as_rank(saved, start, stop):
    """Reads 'its own' old piece only, as if the world size had not changed."""
    return read_plan(saved, start, stop)[:1]


def test_read_plan_solution_and_mistakes():
    full("lesson09.read_plan", read_plan)
    for wrong in (inclusive_end, offset_from_zero, only_pieces_starting_inside,
                  same_index_as_rank):
        less("lesson09.read_plan", wrong)


# lesson09.checkpoints -------------------------------------------------------------------------

def _named(root):
    return [p for p in root.iterdir() if re.match(r"^step-\d+$", p.name)]


def any_folder_with_a_manifest(root):
    return sorted(((int(p.name[5:]), p) for p in _named(root) if (p / "manifest.json").exists()),
                  reverse=True)


def sorted_by_name(root):
    found = []
    for p in _named(root):
        try:
            read_manifest(p)
        except CheckpointError:
            continue
        found.append(p)
    return [(int(p.name[5:]), p) for p in sorted(found, key=lambda p: p.name.lstrip("step-0"),
                                                 reverse=True)]


def oldest_first(root):
    return list(reversed(checkpoints(root)))


def test_checkpoints_solution_and_mistakes():
    full("lesson09.checkpoints", checkpoints)
    for wrong in (any_folder_with_a_manifest, sorted_by_name, oldest_first):
        less("lesson09.checkpoints", wrong)


# lesson09.accumulation_steps ------------------------------------------------------------------

def ignores_micro_batch(global_batch, micro_batch, world_size):
    return global_batch // world_size


def rounds_down(global_batch, micro_batch, world_size):
    return max(1, global_batch // (micro_batch * world_size))


def test_accumulation_steps_solution_and_mistakes():
    full("lesson09.accumulation_steps", accumulation_steps)
    for wrong in (ignores_micro_batch, rounds_down):
        less("lesson09.accumulation_steps", wrong)
