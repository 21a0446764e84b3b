"""Lesson 09's exercises (09a checkpoints, 09b recovery): the solutions score full points, realistic
wrong versions less, with a reason that names what is wrong. The atomic write is checked in a
child process killed half-way; the save, the load and the resume run on the first 2, 3 and 4
ranks of a 4-rank cluster."""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path

import cloudpickle
import pytest

from conftest import full, less
from course_lib import checkpoint_files as cf
from course_lib.checkpoint import (MANIFEST, CheckpointError, agree, all_gather_json, attempt,
                                   crc32, destinations, flatten, fsync_dir, load, map_file,
                                   parse_shard, plan_save, rank_and_size, read_manifest,
                                   read_plan, save, write_atomic, write_shard)
from course_lib.dist.diagnosis import same_call, standing
from course_lib.recovery import (accumulation_steps, checkpoints, get_state_dict, rng_state,
                                 run_state)

cloudpickle.register_pickle_by_value(sys.modules[__name__])
SOLUTIONS = Path(__file__).resolve().parent.parent / "solutions"


def reason(result) -> str:
    """The title's reason and every row's note, whole, as one text to search."""
    return "\n".join([result.reason] + [row.note for c in result.cases for row in c.rows])


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
    said = {wrong.__name__: reason(less("lesson09.write_atomic", wrong))
            for wrong in (in_place, rename_without_fsync, no_folder_fsync, delete_then_write)}
    assert "a crash tears it" in said["in_place"], said["in_place"]
    assert "before they were fsynced" in said["rename_without_fsync"]
    assert "folder was not fsynced" in said["no_folder_fsync"]
    assert "a crash tears it" in said["delete_then_write"]


# lesson09.save --------------------------------------------------------------------------------

def _begin(state_dict, checkpoint_id, dist, group):
    dist, rank, world = rank_and_size(dist, group)
    folder, leaves = Path(checkpoint_id), flatten(state_dict)
    return dist, rank, world, folder, plan_save(leaves, folder, dist, group, world)


def manifest_before_agreement(state_dict, checkpoint_id, *, dist=None, group=None):
    """Rank 0 writes the manifest as soon as it has every outcome, before checking them."""
    dist, rank, world, folder, plan = _begin(state_dict, checkpoint_id, dist, group)
    info, error = attempt(write_shard, folder / plan.shard(rank), plan.tensors(rank), write_atomic)
    outcomes = all_gather_json([info, error], dist, group, world)
    if rank == 0:
        write_atomic(folder / MANIFEST, [plan.manifest([i for i, _ in outcomes])])
    agree([e for _, e in outcomes], f"save of {folder} failed")


def manifest_then_shards(state_dict, checkpoint_id, *, dist=None, group=None):
    """Computes every shard's size and checksum first, writes the manifest, then the shards."""
    dist, rank, world, folder, plan = _begin(state_dict, checkpoint_id, dist, group)
    tensors = plan.tensors(rank)
    parts = cf.shard_parts(tensors) if tensors else None
    info = {"bytes": sum(len(p) for p in parts), "crc32": crc32(b"".join(map(bytes, parts)))} \
        if parts else None
    infos = all_gather_json(info, dist, group, world)
    if rank == 0:
        write_atomic(folder / MANIFEST, [plan.manifest(infos)])
    if parts:
        write_atomic(folder / plan.shard(rank), parts)
    all_gather_json(None, dist, group, world)


def only_rank0_checks(state_dict, checkpoint_id, *, dist=None, group=None):
    """Every outcome reaches every rank, but only rank 0 looks at them; nobody waits after."""
    dist, rank, world, folder, plan = _begin(state_dict, checkpoint_id, dist, group)
    info, error = attempt(write_shard, folder / plan.shard(rank), plan.tensors(rank), write_atomic)
    outcomes = all_gather_json([info, error], dist, group, world)
    if rank == 0:
        agree([e for _, e in outcomes], f"save of {folder} failed")
        write_atomic(folder / MANIFEST, [plan.manifest([i for i, _ in outcomes])])
        plan.remove_others(folder)


def manifest_in_place(state_dict, checkpoint_id, *, dist=None, group=None):
    dist, rank, world, folder, plan = _begin(state_dict, checkpoint_id, dist, group)
    info, error = attempt(write_shard, folder / plan.shard(rank), plan.tensors(rank), write_atomic)
    outcomes = all_gather_json([info, error], dist, group, world)
    agree([e for _, e in outcomes], f"save of {folder} failed")
    if rank == 0:
        (folder / MANIFEST).write_bytes(plan.manifest([i for i, _ in outcomes]))
        plan.remove_others(folder)
    all_gather_json(None, dist, group, world)


def _rename_only(path, parts):
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        f.writelines(parts)
    os.replace(tmp, path)
    fsync_dir(path.parent)


def shards_renamed_without_fsync(state_dict, checkpoint_id, *, dist=None, group=None):
    dist, rank, world, folder, plan = _begin(state_dict, checkpoint_id, dist, group)
    info, error = attempt(write_shard, folder / plan.shard(rank), plan.tensors(rank), _rename_only)
    outcomes = all_gather_json([info, error], dist, group, world)
    agree([e for _, e in outcomes], f"save of {folder} failed")
    if rank == 0:
        write_atomic(folder / MANIFEST, [plan.manifest([i for i, _ in outcomes])])
        plan.remove_others(folder)
    all_gather_json(None, dist, group, world)


def returns_before_the_manifest(state_dict, checkpoint_id, *, dist=None, group=None):
    dist, rank, world, folder, plan = _begin(state_dict, checkpoint_id, dist, group)
    info, error = attempt(write_shard, folder / plan.shard(rank), plan.tensors(rank), write_atomic)
    outcomes = all_gather_json([info, error], dist, group, world)
    agree([e for _, e in outcomes], f"save of {folder} failed")
    if rank == 0:
        write_atomic(folder / MANIFEST, [plan.manifest([i for i, _ in outcomes])])
        plan.remove_others(folder)


def test_save_solution_and_mistakes(scratch_cluster_4):
    c = scratch_cluster_4
    full("lesson09.save", save, c)
    said = {wrong.__name__: reason(less("lesson09.save", wrong, c, time_limit=5)) for wrong in (
        manifest_before_agreement, manifest_then_shards, only_rank0_checks, manifest_in_place,
        shards_renamed_without_fsync, returns_before_the_manifest)}  # (one hangs: 5 s a case)
    assert "a new manifest went down although rank" in said["manifest_before_agreement"]
    assert "went down before every shard was known to be whole" in said["manifest_then_shards"]
    assert "returned normally although rank" in said["only_rank0_checks"]
    assert "written under its own name" in said["manifest_in_place"]
    assert "renamed into place before it was fsynced" in said["shards_renamed_without_fsync"]
    assert "returned before the manifest was on disk" in said["returns_before_the_manifest"]


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


def padded_pieces(saved, start, stop):
    """Takes every saved piece to be as long as the longest (the padded shard), not its numel."""
    size = max(n for _, n in saved)
    out = []
    for i, (offset, _) in enumerate(saved):
        lo, hi = max(start, offset), min(stop, offset + size)
        if lo < hi:
            out.append((i, lo - offset, lo - start, hi - lo))
    return out


def test_read_plan_solution_and_mistakes():
    full("lesson09.read_plan", read_plan)
    said = {wrong.__name__: reason(less("lesson09.read_plan", wrong)) for wrong in (
        inclusive_end, offset_from_zero, only_pieces_starting_inside, same_index_as_rank,
        padded_pieces)}
    assert "is read from no piece" in said["inclusive_end"]
    assert "falls outside" in said["offset_from_zero"]
    assert "is read from no piece" in said["only_pieces_starting_inside"]
    assert "is read from no piece" in said["same_index_as_rank"]
    assert "runs past the end of piece 0, which holds 2 elements" in said["padded_pieces"]


# lesson09.load --------------------------------------------------------------------------------

def _load(state_dict, checkpoint_id, dist, group, *, check_crc=True, local=False, cover=True,
          agreed=True):
    """The solution's steps, each of which a wrong version leaves out."""
    dist, rank, world = rank_and_size(dist, group)
    folder, leaves = Path(checkpoint_id), flatten(state_dict)
    copies, shards, error = [], {}, None
    try:
        manifest = read_manifest(folder)
        targets = destinations(leaves, manifest, folder)
        for key, flat, start, pieces in targets:
            first = 0 if local else start
            plan = read_plan([(p["offset"], p["numel"]) for p in pieces], first, first + len(flat))
            if cover and sum(n for *_, n in plan) != len(flat):
                raise CheckpointError(f"{folder}: {key!r}: elements not all in the checkpoint")
            copies += [(flat, pieces[i], src, dst, n) for i, src, dst, n in plan]
        for name in sorted({piece["file"] for _, piece, *_ in copies}):
            data = map_file(folder / name)
            if check_crc and crc32(data) != manifest["files"][name]["crc32"]:
                raise CheckpointError(f"{folder / name}: checksum mismatch (the file is corrupt)")
            shards[name] = parse_shard(data, folder / name)
    except CheckpointError as exc:
        if not agreed:
            raise
        error = str(exc)
    if agreed:
        agree(all_gather_json(error, dist, group, world), f"load of {folder} failed")
    for flat, piece, src, dst, n in copies:
        flat[dst:dst + n].copy_(shards[piece["file"]][piece["name"]][src:src + n])
    targets.commit()


def no_checksum(state_dict, checkpoint_id, *, dist=None, group=None):
    _load(state_dict, checkpoint_id, dist, group, check_crc=False)


def no_agreement(state_dict, checkpoint_id, *, dist=None, group=None):
    """Each rank checks what it reads, and copies unless it found something wrong itself."""
    _load(state_dict, checkpoint_id, dist, group, agreed=False)


def local_offsets(state_dict, checkpoint_id, *, dist=None, group=None):
    """Reads elements [0, n) for every piece: the offsets of the old rank, not the tensor's."""
    _load(state_dict, checkpoint_id, dist, group, local=True)


def no_coverage_check(state_dict, checkpoint_id, *, dist=None, group=None):
    _load(state_dict, checkpoint_id, dist, group, cover=False)


def test_load_solution_and_mistakes(scratch_cluster_4):
    c = scratch_cluster_4
    full("lesson09.load", load, c)
    said = {wrong.__name__: reason(less("lesson09.load", wrong, c)) for wrong in (
        no_checksum, no_agreement, local_offsets, no_coverage_check)}
    assert "loaded a checkpoint with a flipped byte" in said["no_checksum"]
    assert "although another rank refused it" in said["no_agreement"]
    assert "a piece's place is its global offset" in said["local_offsets"]
    assert "lacks a piece of w" in said["no_coverage_check"]


# lesson09.standing ----------------------------------------------------------------------------

def _standing(call, record, *, same=same_call, done_state="completed", last_by_state=True):
    if record is None:
        return {"verdict": "no answer"}
    here = [e for e in record if e["seq"] == call["seq"]]
    if here and same(here[-1], call):
        return {"verdict": "same call", "state": here[-1]["state"]}
    done = [e["seq"] for e in record if (e["state"] == done_state or not last_by_state)
            and e["seq"] < call["seq"]]
    inside = [e for e in record if e["state"] == "started"]
    return {"verdict": "other call" if here else "behind",
            "last completed": max(done) if done else None,
            "in": inside[-1] if inside else None, "called": here[-1] if here else None}


def blames_the_waiting_rank(call, record):
    """A rank is behind unless it has completed the call: those that wait in it are blamed."""
    return _standing(call, record, same=lambda a, b: same_call(a, b) and a["state"] == "completed")


def sequence_number_only(call, record):
    """The same sequence number is taken for the same call, whatever the op or shape."""
    return _standing(call, record, same=lambda a, b: a["seq"] == b["seq"])


def last_entry_as_last_completed(call, record):
    """Counts every entry before the call as completed, the one it is stuck in too."""
    return _standing(call, record, last_by_state=False)


def test_standing_solution_and_mistakes():
    full("lesson09.standing", standing)
    said = {wrong.__name__: reason(less("lesson09.standing", wrong)) for wrong in (
        blames_the_waiting_rank, sequence_number_only, last_entry_as_last_completed)}
    assert "it waits like the asking rank, it is not the one to blame" in \
        said["blames_the_waiting_rank"]
    assert "is another call" in said["sequence_number_only"]
    assert "last completed #1" in said["last_entry_as_last_completed"]


# lesson09.run_state ---------------------------------------------------------------------------

def _state(model, optimizer, scheduler, sampler, step, init, **drop):
    m, o = get_state_dict(model, optimizer, init_state=init and not drop.get("no_init"))
    out = {"model": m, "optim": o, "sched": scheduler.state_dict(),
           "sampler": sampler.state_dict(), "rng": {f"rank{sampler.rank}": rng_state()},
           "step": step}
    if drop.get("rng_shared"):
        out["rng"] = rng_state()
    return {k: v for k, v in out.items() if not drop.get(k)}


def without_rng(model, optimizer, scheduler, sampler, step, *, init=False):
    return _state(model, optimizer, scheduler, sampler, step, init, rng=True)


def rng_under_one_key(model, optimizer, scheduler, sampler, step, *, init=False):
    """Every rank's RNG state under the same key: the checkpoint keeps one rank's."""
    return _state(model, optimizer, scheduler, sampler, step, init, rng_shared=True)


def without_sampler(model, optimizer, scheduler, sampler, step, *, init=False):
    return _state(model, optimizer, scheduler, sampler, step, init, sampler=True)


def without_scheduler(model, optimizer, scheduler, sampler, step, *, init=False):
    return _state(model, optimizer, scheduler, sampler, step, init, sched=True)


def ignores_init(model, optimizer, scheduler, sampler, step, *, init=False):
    """A fresh optimizer has no state yet: nothing of Adam's moments is loaded."""
    return _state(model, optimizer, scheduler, sampler, step, init, no_init=True)


def test_run_state_solution_and_mistakes(scratch_cluster_4):
    c = scratch_cluster_4
    full("lesson09.run_state", run_state, c)
    said = {wrong.__name__: reason(less("lesson09.run_state", wrong, c)) for wrong in (
        without_rng, rng_under_one_key, without_sampler, without_scheduler, ignores_init)}
    assert "holds no RNG state" in said["without_rng"]
    assert "under a key that names the rank" in said["rng_under_one_key"]
    assert "sampler" in said["without_sampler"]
    assert "scheduler" in said["without_scheduler"]
    assert "optimizer" in said["ignores_init"]


# lesson09.accumulation_steps ------------------------------------------------------------------

def ignores_micro_batch(global_batch, micro_batch, world_size):
    return global_batch // world_size


def rounds_down(global_batch, micro_batch, world_size):
    return max(1, global_batch // (micro_batch * world_size))


def test_accumulation_steps_solution_and_mistakes():
    full("lesson09.accumulation_steps", accumulation_steps)
    said = {wrong.__name__: reason(less("lesson09.accumulation_steps", wrong))
            for wrong in (ignores_micro_batch, rounds_down)}
    assert "192 samples per step, not 48" in said["ignores_micro_batch"]
    assert "must be refused" in said["rounds_down"]


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
    said = {wrong.__name__: reason(less("lesson09.checkpoints", wrong))
            for wrong in (any_folder_with_a_manifest, sorted_by_name, oldest_first)}
    assert "shorter than its manifest says" in said["any_folder_with_a_manifest"]
    assert "not ordered by step as a number" in said["sorted_by_name"]
    assert "oldest first" in said["oldest_first"]


@pytest.mark.parametrize("part", ["09a_checkpoints", "09b_recovery"])
def test_the_parts_exist(part):
    assert (SOLUTIONS / f"{part}.ipynb").is_file()
