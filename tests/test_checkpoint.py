"""Checkpoints on one process: what is saved loads back bit for bit, and nothing that went
wrong while saving, or happened to the files since, is ever loaded.

Every failure (a writer killed mid-save, a truncated or corrupted shard, a missing or
malformed manifest, a full disk) must leave the previous checkpoint loadable, and must be
reported naming the file. Multi-rank saving, resharding and exact resume are in test_resume.py.
"""

from __future__ import annotations

import errno
import os
import random
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from course_lib import checkpoint
from course_lib.checkpoint import CheckpointError, Piece
from course_lib.recovery import CheckpointManager, checkpoints


def state(step: int, size: int = 1000) -> dict:
    """A state dict whose every value depends on `step`: tensors of several dtypes, a piece,
    nested lists and JSON values."""
    g = torch.Generator().manual_seed(step)
    return {"model": {"w": torch.randn(size, generator=g), "b": torch.randn(3, 5, generator=g,
                                                                            dtype=torch.float64),
                      "h": torch.randn(4, generator=g).to(torch.bfloat16),
                      "mask": torch.rand(6, generator=g) > 0.5,
                      "ids": torch.randint(-9, 9, (7,), generator=g)},
            "piece": Piece(torch.randn(4, generator=g), 0, torch.Size([2, 2])),
            "sched": {"last_epoch": step, "lrs": [0.1 * step, 0.2], "name": "step", "x": None},
            "empty": torch.zeros(0), "step": step}


def blank(size: int = 1000) -> dict:
    """`state`'s structure, every value different from any step's."""
    out = state(0, size)
    for key, (leaf, container, k) in checkpoint.flatten(out).items():
        if isinstance(leaf, Piece):
            leaf.tensor.fill_(-1)
        elif torch.is_tensor(leaf):
            leaf.zero_() if leaf.dtype != torch.bool else leaf.fill_(False)
        else:
            container[k] = "blank"
    return out


def assert_state_equal(got: dict, want: dict) -> None:
    g, w = checkpoint.flatten(got), checkpoint.flatten(want)
    assert g.keys() == w.keys()
    for key in g:
        a, b = g[key][0], w[key][0]
        if isinstance(a, Piece):
            assert torch.equal(a.tensor, b.tensor) and a.offset == b.offset, key
        elif torch.is_tensor(a):
            assert a.dtype == b.dtype and torch.equal(a, b), key
        else:
            assert a == b, key


def test_a_saved_state_loads_back_bit_for_bit_in_place(tmp_path):
    want = state(3)
    checkpoint.save(want, tmp_path / "c")
    got = blank()
    w = got["model"]["w"]
    checkpoint.load(got, tmp_path / "c")
    assert got["model"]["w"] is w  # in place: the same tensor object, filled
    assert_state_equal(got, want)


def test_shards_are_safetensors_files_the_library_opens(tmp_path):
    """Written by hand from tensor memory, read by the safetensors library as it wrote them."""
    from safetensors.torch import load_file

    want = state(4)
    checkpoint.save(want, tmp_path / "c")
    opened = load_file(_shard(tmp_path / "c"))
    for key, (leaf, _, _) in checkpoint.flatten(want).items():
        if isinstance(leaf, Piece):
            assert torch.equal(opened[f"{key}@0"], leaf.tensor.reshape(-1)), key
        elif torch.is_tensor(leaf):
            assert torch.equal(opened[key], leaf.reshape(-1)), key


def test_any_part_of_a_tensor_loads_from_what_was_saved(tmp_path):
    """A tensor saved whole loads as any piece of it (a rank of a new sharding)."""
    whole = torch.arange(10.0)
    # one rank alone cannot save a sharded tensor it holds only part of: the save says what is missing
    with pytest.raises(CheckpointError, match=r"'t': elements \[4, 10\) are held by no rank"):
        checkpoint.save({"t": Piece(whole[:4].clone(), 0, torch.Size([2, 5]))}, tmp_path / "p")
    assert not (tmp_path / "p" / checkpoint.MANIFEST).exists()
    checkpoint.save({"t": whole.view(2, 5)}, tmp_path / "whole")
    for a, b in [(0, 10), (3, 7), (9, 10), (0, 0)]:
        got = Piece(torch.full((b - a,), -1.0), a, torch.Size([2, 5]))
        checkpoint.load({"t": got}, tmp_path / "whole")
        assert torch.equal(got.tensor, whole[a:b])


@pytest.mark.parametrize("seed", range(5))
def test_read_plan_covers_exactly_the_wanted_elements(seed):
    """Against brute force: random cuts of a tensor into saved pieces, random wanted ranges."""
    rng = random.Random(seed)
    numel = rng.randint(1, 60)
    cuts = sorted({0, numel, *rng.sample(range(numel + 1), rng.randint(0, min(numel, 6)))})
    saved = [(a, b - a) for a, b in zip(cuts, cuts[1:])]
    source = np.arange(numel) * 10
    for _ in range(20):
        start = rng.randint(0, numel)
        stop = rng.randint(start, numel)
        got = np.full(stop - start, -1)
        for i, src, dst, n in checkpoint.read_plan(saved, start, stop):
            piece = source[saved[i][0]:saved[i][0] + saved[i][1]]
            assert n > 0 and (got[dst:dst + n] == -1).all(), "a read overlaps another"
            got[dst:dst + n] = piece[src:src + n]
        assert (got == source[start:stop]).all()


def test_a_second_save_to_the_same_folder_replaces_the_first_atomically(tmp_path):
    checkpoint.save(state(1), tmp_path / "c")
    first = set(os.listdir(tmp_path / "c"))
    checkpoint.save(state(2), tmp_path / "c")
    got = blank()
    checkpoint.load(got, tmp_path / "c")
    assert_state_equal(got, state(2))
    assert not first & set(os.listdir(tmp_path / "c")) - {checkpoint.MANIFEST}, \
        "the first save's shard was left behind"


def _shard(folder: Path) -> Path:
    return next(p for p in folder.iterdir() if p.suffix == ".safetensors")


@pytest.mark.parametrize("damage, message", [
    ("truncate", "truncated"),
    ("flip", "checksum mismatch"),
    ("delete shard", "missing"),
    ("delete manifest", "no manifest.json"),
    ("garble manifest", "unreadable manifest"),
    ("foreign manifest", "not a course_lib.checkpoint/1 manifest"),
])
def test_a_damaged_checkpoint_is_never_loaded_and_the_previous_one_is(tmp_path, damage, message):
    manager = CheckpointManager(tmp_path, keep=3)
    manager.save(state(1), 1)
    bad = manager.save(state(2), 2)
    if damage == "truncate":
        shard = _shard(bad)
        shard.write_bytes(shard.read_bytes()[:-10])
    elif damage == "flip":
        shard = _shard(bad)
        data = bytearray(shard.read_bytes())
        data[len(data) // 2] ^= 0x40
        shard.write_bytes(bytes(data))
    elif damage == "delete shard":
        _shard(bad).unlink()
    elif damage == "delete manifest":
        (bad / checkpoint.MANIFEST).unlink()
    elif damage == "garble manifest":
        (bad / checkpoint.MANIFEST).write_text('{"format": ')
    else:
        (bad / checkpoint.MANIFEST).write_text('{"format": "something else"}')
    with pytest.raises(CheckpointError, match=message) as exc:
        checkpoint.load(blank(), bad)
    assert str(bad) in str(exc.value)
    got = blank()
    assert manager.load_latest(got) == 1
    assert_state_equal(got, state(1))
    if damage == "flip":  # complete on disk, caught by its checksum on load, and reported
        assert len(manager.skipped) == 1 and "checksum mismatch" in manager.skipped[0]


def test_keep_holds_the_newest_complete_checkpoints(tmp_path):
    manager = CheckpointManager(tmp_path, keep=2)
    for step in (5, 10, 15, 20):
        manager.save(state(step), step)
    assert [s for s, _ in checkpoints(tmp_path)] == [20, 15]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-000000015", "step-000000020"]


def test_loading_checks_names_dtypes_and_shapes(tmp_path):
    checkpoint.save(state(1), tmp_path / "c")
    wrong_shape = blank()
    wrong_shape["model"]["b"] = torch.zeros(5, 3, dtype=torch.float64)
    with pytest.raises(CheckpointError, match=r"'model.b': the checkpoint holds float64\[3, 5\]"):
        checkpoint.load(wrong_shape, tmp_path / "c")
    wrong_dtype = blank()
    wrong_dtype["model"]["w"] = torch.zeros(1000, dtype=torch.float64)
    with pytest.raises(CheckpointError, match="float32.*float64"):
        checkpoint.load(wrong_dtype, tmp_path / "c")
    extra = blank()
    extra["model"]["new"] = torch.zeros(1)
    with pytest.raises(CheckpointError, match="no 'model.new'"):
        checkpoint.load(extra, tmp_path / "c")
    with pytest.raises(TypeError, match="'model.f' is a builtin_function_or_method; a state dict holds"):
        checkpoint.save({"model": {"f": len}}, tmp_path / "d")
    assert not (tmp_path / "d").exists()


def test_a_full_disk_fails_the_save_naming_the_file_and_keeps_the_previous(tmp_path, monkeypatch):
    manager = CheckpointManager(tmp_path, keep=3)
    manager.save(state(1), 1)
    real_fsync = os.fsync

    def no_space(fd):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "fsync", no_space)
    with pytest.raises(CheckpointError, match=r"No space left on device") as exc:
        manager.save(state(2), 2)
    assert "shard-00000-of-00001" in str(exc.value)
    monkeypatch.setattr(os, "fsync", real_fsync)
    got = blank()
    assert manager.load_latest(got) == 1
    assert_state_equal(got, state(1))
    assert not any(p.name.endswith(".tmp") for p in (tmp_path / "step-000000002").iterdir())


@pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("mount"),
                    reason="mounting a small tmpfs needs root")
def test_a_really_full_tmpfs_keeps_the_previous_checkpoint(tmp_path):
    disk = tmp_path / "disk"
    disk.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(disk)], check=True)
    try:
        manager = CheckpointManager(disk, keep=5)
        manager.save(state(1, size=100), 1)
        with pytest.raises(CheckpointError, match="No space left on device"):
            manager.save(state(2, size=20000), 2)  # 80 KB of floats in a 64 KB disk
        got = blank(size=100)
        assert manager.load_latest(got) == 1
        assert_state_equal(got, state(1, size=100))
    finally:
        subprocess.run(["umount", str(disk)], check=True)


WRITER = textwrap.dedent("""
    import sys, time
    sys.path.insert(0, sys.argv[2])
    from test_checkpoint import state
    from course_lib.recovery import CheckpointManager
    manager = CheckpointManager(sys.argv[1], keep=2)
    step = int(sys.argv[3])
    while True:
        manager.save(state(step, size=1_000_000), step)
        print(step, flush=True)
        step += 1
""")


def test_a_writer_killed_at_random_moments_never_leaves_a_broken_newest(tmp_path):
    """SIGKILL a process that saves 4 MB checkpoints back to back, three times at random
    moments; after each kill the newest complete checkpoint loads and holds its step's state."""
    rng = random.Random(0)
    start = 1
    for kill in range(3):
        proc = subprocess.Popen([sys.executable, "-c", WRITER, str(tmp_path),
                                 str(Path(__file__).parent), str(start)],
                                stdout=subprocess.PIPE, text=True)
        try:
            assert proc.stdout.readline().strip() == str(start)  # one save done
            time.sleep(rng.uniform(0.0, 0.3))
        finally:
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)
            proc.stdout.close()
        got = blank(size=1_000_000)
        step = CheckpointManager(tmp_path).load_latest(got)
        assert step is not None and step >= start
        assert_state_equal(got, state(step, size=1_000_000))
        start = step + 1


def sharded(step: int, rank: int, world: int) -> dict:
    """Rank `rank`'s piece of a 3000-element tensor (its values depend on the step)."""
    whole = torch.arange(3000, dtype=torch.float64) + 1000 * step
    size = -(-3000 // world)
    lo, hi = rank * size, min(3000, (rank + 1) * size)
    return {"w": Piece(whole[lo:hi].clone(), lo, torch.Size([3000])), "step": step}


def die_while_saving(rank: int, world: int, root: str) -> None:
    """Save step 1; then rank 1 is SIGKILLed half-way through writing its shard of step 2."""
    import json

    from course_lib import checkpoint as ck

    manager = CheckpointManager(root, keep=3)
    manager.save(sharded(1, rank, world), 1)
    if rank == 1:
        real = ck.write_atomic

        class DieHalfway(list):
            def __iter__(self):
                for i, part in enumerate(list.__iter__(self)):
                    if i == 1:
                        os.kill(os.getpid(), signal.SIGKILL)
                    yield part

        ck.write_atomic = lambda path, parts: real(path, DieHalfway(parts))
    try:
        manager.save(sharded(2, rank, world), 2)
        outcome = None
    except Exception as exc:  # noqa: BLE001 - what the survivors saw
        outcome = f"{type(exc).__name__}: {exc}"
    Path(root, f"rank{rank}.json").write_text(json.dumps(outcome))


def test_a_rank_killed_while_writing_leaves_the_previous_checkpoint(tmp_path):
    """On 3 ranks: every survivor's save fails (naming the dead rank), step 2 never gets a
    manifest, and step 1 loads whole on one process."""
    import json

    from course_lib.spawn import SpawnError, spawn

    with pytest.raises(SpawnError) as info:
        spawn(die_while_saving, 3, str(tmp_path), backend="scratch", timeout=30)
    assert set(info.value.failures) == {1}
    for rank in (0, 2):
        outcome = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert outcome and "rank 1" in outcome, outcome
    assert not (tmp_path / "step-000000002" / checkpoint.MANIFEST).exists()
    got = {"w": torch.zeros(3000, dtype=torch.float64), "step": 0}
    assert CheckpointManager(tmp_path).load_latest(got) == 1
    assert torch.equal(got["w"], torch.arange(3000, dtype=torch.float64) + 1000) and got["step"] == 1
