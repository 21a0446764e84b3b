"""Lesson 09a's writing checks: `write_atomic` (run to the end, or killed half-way in a child
process) and `save` on the first 2, 3 and 4 ranks of the grader's cluster, every rank's shard
writes, fsyncs and renames watched (a full disk on one rank, a save over an earlier checkpoint).

Components (course_lib.checkpoint_files, ...) are imported inside the functions that use them,
on purpose: the learner's overlay decides at each call which version runs (theirs or the
reference), and a name bound at import time would keep the first one.
"""

from __future__ import annotations

import errno
import json
import os
import signal
import stat
import tempfile
import time
from pathlib import Path

from course_lib.course.grading import RANK, WORLD_SIZE, Exercise, case, register
from course_lib.course.catalogue import CheckTimeout
from course_lib.course.grading.exercises.lesson09.fixtures import (W_BASE, W_NUMEL, _cleanup,
                                                                  _raised, _shared_folder,
                                                                  padded_pieces, read_back,
                                                                  saved_values, write_fixture)
from course_lib.course.grading.sub_worlds import on_first_ranks, register_on_sub_worlds

PART_A = "09a_checkpoints"
OLD, NEW = b"old checkpoint " * 4096, b"NEW checkpoint " * 4096  # 60 KiB each
CHUNKS = 6


# --- lesson09.write_atomic ---------------------------------------------------------------------


class _DieAt(list):
    """The new bytes in chunks; iterating past chunk `at` kills this process (SIGKILL)."""

    def __init__(self, chunks: list, at: int):
        super().__init__(chunks)
        self.at = at

    def __iter__(self):
        for i, chunk in enumerate(list.__iter__(self)):
            if i == self.at:
                os.kill(os.getpid(), signal.SIGKILL)
            yield chunk


class _Watch:
    """Log fsyncs (of a file or a folder) and renames in this process, in order, with the
    destination's name: [("fsync file",), ("fsync folder",), ("rename", src, dst name)].
    `before_rename(src, dst)` and `before_fsync(fd)` hooks let a check slow one rank down or
    look at a file as it is renamed into place."""

    def __init__(self, before_rename=None, before_fsync=None):
        self.events: list[tuple] = []
        self.before_rename, self.before_fsync = before_rename, before_fsync
        self.saved = (os.fsync, os.replace, os.rename)

    def __enter__(self) -> "_Watch":
        real_fsync, real_replace, real_rename = self.saved

        def fsync(fd):
            folder = stat.S_ISDIR(os.fstat(fd).st_mode)
            if self.before_fsync is not None and not folder:
                self.before_fsync(fd)
            self.events.append(("fsync folder",) if folder else ("fsync file",))
            return real_fsync(fd)

        def renamer(real):
            def call(src, dst, *args, **kwargs):
                if self.before_rename is not None:
                    self.before_rename(Path(src), Path(dst))
                self.events.append(("rename", str(src), Path(dst).name))
                return real(src, dst, *args, **kwargs)
            return call

        os.fsync, os.replace, os.rename = fsync, renamer(real_replace), renamer(real_rename)
        return self

    def __exit__(self, *exc) -> None:
        os.fsync, os.replace, os.rename = self.saved

    def durable_before(self, name_matches) -> str:
        """How the file whose name `name_matches` got there: "fsynced, then renamed into
        place", "renamed into place without an fsync first", or None if no rename made it."""
        last = None
        for i, event in enumerate(self.events):
            if event[0] == "rename" and name_matches(event[2]):
                last = i
        if last is None:
            return None
        since = [e for e in self.events[:last] if e[0] != "fsync folder"]
        previous = max((i for i, e in enumerate(since) if e[0] == "rename"), default=-1)
        fsynced = any(e[0] == "fsync file" for e in since[previous + 1:])
        return "fsynced, then renamed into place" if fsynced else \
            "renamed into place without an fsync first"

    def folder_fsynced_after(self, name_matches) -> bool:
        at = [i for i, e in enumerate(self.events) if e[0] == "rename" and name_matches(e[2])]
        return bool(at) and any(e[0] == "fsync folder" for e in self.events[at[-1]:])


def atomic_harness(fn, scenario: str) -> dict:
    """Run `fn(path, parts)` in a forked child over a file holding OLD: to the end, or
    SIGKILLed in the middle of the parts. Reports what the file holds afterwards and, for a
    run to the end, whether the new bytes were fsynced before the rename onto the file, the
    folder after it, and whether anything else was left in the folder."""
    folder = Path(tempfile.mkdtemp(prefix="lesson09-atomic-"))
    path = folder / "manifest.json"
    path.write_bytes(OLD)
    size = len(NEW) // CHUNKS
    chunks = [memoryview(NEW)[i * size:(i + 1) * size] for i in range(CHUNKS)]
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: the learner's write, then a JSON line to the parent; no return
        try:
            os.close(read_end)
            watch = _Watch()
            error = None
            with watch:
                try:
                    fn(path, _DieAt(chunks, CHUNKS // 2) if scenario == "killed" else chunks)
                except Exception as exc:  # noqa: BLE001 - reported to the parent
                    error = f"{type(exc).__name__}: {exc}"
            os.write(write_end, json.dumps({
                "error": error, "durable": watch.durable_before(lambda n: n == path.name),
                "folder": watch.folder_fsynced_after(lambda n: n == path.name)}).encode())
        finally:
            os._exit(0)
    os.close(write_end)
    deadline, status = time.monotonic() + 10.0, None
    while status is None and time.monotonic() < deadline:
        done, code = os.waitpid(pid, os.WNOHANG)
        status = code if done else None
        if status is None:
            time.sleep(0.01)
    if status is None:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
    with os.fdopen(read_end, "rb") as f:
        report = json.loads(f.read() or b'{"error": "no report", "durable": null, "folder": false}')
    data = path.read_bytes() if path.exists() else None
    holds = ("the old bytes" if data == OLD else "all the new bytes" if data == NEW
             else "nothing (gone)" if data is None else f"a mix: {len(data)} bytes")
    others = sorted(p.name for p in folder.iterdir() if p.name != path.name)
    for leftover in folder.iterdir():
        leftover.unlink()
    folder.rmdir()
    if status is None:
        return {"file holds": holds, "finished": "no: still running after 10 s"}
    if scenario == "killed":
        return {"file holds": holds}
    return {"file holds": holds, "error": report["error"],
            "new bytes fsynced before the rename": report["durable"] == (
                "fsynced, then renamed into place"),
            "folder fsynced after the rename": report["folder"],
            "other files left in the folder": len(others)}


register(Exercise(
    name="lesson09.write_atomic",
    notebook=PART_A,
    params=("path", "parts"),
    cases=[case("finished", label="written to the end"),
           case("killed", label="SIGKILLed half-way through the parts")],
    reference="lesson09:write_atomic",
    explain="lesson09:explain_write_atomic",
    harness=atomic_harness,
    points=2,
    hints=("The name must only ever point at a complete file: the new bytes go somewhere no "
           "reader looks, become durable there, and then take the name in one atomic step, "
           "which must itself become durable.",
           "Four steps, in this order: write the temporary file in the same folder, flush and "
           "fsync it, rename it onto the name, fsync the folder. If anything raises on the "
           "way, remove the temporary file."),
))


# --- lesson09.save ----------------------------------------------------------------------------


def save_state(rank: int, k: int, step: int = 200) -> dict:
    """Rank `rank` of `k`'s state: its ZeRO piece of `w`, the replicated `bias`, the step."""
    import torch

    from course_lib.zero import Piece

    offset, n = padded_pieces(W_NUMEL, k)[rank]
    whole = torch.arange(W_NUMEL, dtype=torch.float64) + W_BASE + 100 * (step - 100)
    return {"w": Piece(whole[offset:offset + n].clone(), offset, torch.Size([W_NUMEL])),
            "bias": torch.arange(1.0, 5.0) * step / 100, "step": step}


def _save_body(dist, rank: int, fn, scenario: str) -> dict:
    """One save by k ranks into a shared folder, every rank's renames and fsyncs watched. The
    other ranks write their shards 0.3 s late and rank 0's manifest rename waits 0.3 s, so
    what goes down in what order does not depend on scheduling."""
    from course_lib import checkpoint_files as cf

    k = dist.get_world_size()
    folder = _shared_folder(dist, rank, "save")
    full = scenario == "disk full" and rank == k - 1
    seen: dict = {}
    try:
        if scenario != "fresh" and rank == 0:
            write_fixture(folder, 2, step=100, token="0ld")
        old = (folder / cf.MANIFEST).read_bytes() if (folder / cf.MANIFEST).exists() else None
        dist.barrier()
        slow = {"done": False}

        def before_fsync(fd):
            if full:
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            if rank != 0 and not slow["done"]:
                slow["done"] = True
                time.sleep(0.3)

        def before_rename(src: Path, dst: Path):
            if dst.name != cf.MANIFEST:
                return
            time.sleep(0.3)
            try:
                listed = json.loads(src.read_bytes())["files"]
            except Exception:  # noqa: BLE001 - not a manifest we can read: the check says so
                seen["manifest"] = "renamed into place, unreadable"
                return
            missing = sorted(name for name, info in listed.items()
                             if not (folder / name).is_file()
                             or (folder / name).stat().st_size != info.get("bytes"))
            seen["manifest"] = ("before rank " + str(int(missing[0][6:11])) + "'s shard was on "
                                "disk" if missing else "after every shard it names")

        watch = _Watch(before_rename, before_fsync)
        raised = None
        with watch:
            try:
                fn(save_state(rank, k), folder, dist=dist)
            except (NotImplementedError, CheckTimeout):
                raise
            except Exception as exc:  # noqa: BLE001 - what the learner's save raised
                raised = _raised(exc)
        def mine(name: str) -> bool:  # this save's shard of this rank, not the earlier save's
            return name.startswith(f"shard-{rank:05d}-of-{k:05d}.") and ".0ld." not in name

        shard = watch.durable_before(mine)
        if shard is None:
            shard = ("written under its final name (no rename)" if any(
                mine(p.name) for p in folder.iterdir()) else "none")
        out = {"raised": raised, "own shard": shard}
        if raised is None:
            try:
                on_disk = json.loads((folder / cf.MANIFEST).read_bytes())["files"]
                out["on return"] = ("the new manifest is on disk" if any(mine(n) for n in on_disk)
                                    else "no new manifest yet")
            except Exception:  # noqa: BLE001
                out["on return"] = "no new manifest yet"
        dist.barrier()
        if rank == 0:
            now = (folder / cf.MANIFEST).read_bytes() if (folder / cf.MANIFEST).exists() else None
            how = watch.durable_before(lambda n: n == cf.MANIFEST)
            if now is None or now == old:
                out["manifest"] = "the previous one, untouched" if now else "none"
            elif how is None:
                out["manifest"] = "written in place (no rename)"
            elif how != "fsynced, then renamed into place":
                out["manifest"] = "renamed into place without an fsync first"
            elif not watch.folder_fsynced_after(lambda n: n == cf.MANIFEST):
                out["manifest"] = "renamed into place, the folder not fsynced after"
            else:
                out["manifest"] = "fsynced, renamed into place " + seen.get("manifest", "")
            back = read_back(folder)
            out["loads as"] = ("the new state" if back == saved_values(200) else
                               "the previous state" if back == saved_values(100) else
                               "nothing loadable: " + back.get("error", "another state"))
            if scenario == "over an old one":
                listed = set(json.loads(now)["files"]) if now else set()
                out["earlier files left"] = len([p for p in folder.iterdir() if p.name not in
                                                 listed and p.name != cf.MANIFEST])
        return out
    finally:
        _cleanup(dist, rank, folder)


def save_harness(fn, rank: int, world_size: int, k: int, scenario: str):
    return on_first_ranks(k, _save_body, fn, scenario)


register_on_sub_worlds(
    "lesson09.save", PART_A,
    params=("state_dict", "checkpoint_id"),
    cases=[case(RANK, WORLD_SIZE, 2, "fresh", label="2 ranks save a sharded tensor"),
           case(RANK, WORLD_SIZE, 3, "fresh", label="3 ranks save a sharded tensor"),
           case(RANK, WORLD_SIZE, 4, "over an old one",
                label="4 ranks save over an earlier checkpoint"),
           case(RANK, WORLD_SIZE, 2, "disk full", label="2 ranks, the disk of rank 1 is full"),
           case(RANK, WORLD_SIZE, 3, "disk full", label="3 ranks, the disk of rank 2 is full"),
           case(RANK, WORLD_SIZE, 4, "disk full", label="4 ranks, the disk of rank 3 is full")],
    reference="lesson09:save",
    explain="lesson09:explain_save",
    harness=save_harness,
    points=3,
    time_limit=20.0,
    hints=("A checkpoint exists from the moment its manifest does, and a manifest may only name "
           "files that are whole and durable on disk. So the manifest cannot go down before "
           "every rank has said that its shard did, and no rank may return, or give up alone, "
           "before all of them know how the save ended.",
           "Four phases: every rank writes its own shard atomically; every rank hears every "
           "rank's outcome (the files' sizes and checksums, or an error); if any rank failed, "
           "every rank raises the same error; otherwise one rank writes the manifest "
           "atomically, and everyone waits to hear that it did."),
)
