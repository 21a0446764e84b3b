"""Lesson 09 (failures): the atomic write (killed mid-write in a child process), the resharding
index arithmetic, choosing the checkpoint to load, and the accumulation that keeps the global
batch when the world shrinks."""

from __future__ import annotations

import json
import os
import signal
import tempfile
import time
from pathlib import Path

from course_lib.grading import Exercise, case, register

OLD, NEW = b"old checkpoint " * 4096, b"NEW checkpoint " * 4096  # 60 KiB each
CHUNKS = 6


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


def _watch_calls(events: list) -> None:
    """Log fsync (of a file or a folder) and rename calls, in order, in this (child) process."""
    real_fsync, real_replace, real_rename = os.fsync, os.replace, os.rename

    def fsync(fd):
        import stat

        events.append("fsync folder" if stat.S_ISDIR(os.fstat(fd).st_mode) else "fsync file")
        return real_fsync(fd)

    def rename(real):
        def call(src, dst, *args, **kwargs):
            events.append(f"rename onto {Path(dst).name}")
            return real(src, dst, *args, **kwargs)
        return call

    os.fsync, os.replace, os.rename = fsync, rename(real_replace), rename(real_rename)


def atomic_harness(fn, scenario: str) -> dict:
    """Run `fn(path, parts)` in a forked child over a file holding OLD: to the end, or
    SIGKILLed in the middle of the parts. Reports what the file holds afterwards and, for a
    run to the end, whether the new bytes were fsynced before the rename onto the file and the
    folder after it."""
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
            events: list = []
            _watch_calls(events)
            error = None
            try:
                fn(path, _DieAt(chunks, CHUNKS // 2) if scenario == "killed" else chunks)
            except Exception as exc:  # noqa: BLE001 - reported to the parent
                error = f"{type(exc).__name__}: {exc}"
            os.write(write_end, json.dumps({"events": events, "error": error}).encode())
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
        report = json.loads(f.read() or b'{"events": [], "error": "no report"}')
    data = path.read_bytes() if path.exists() else None
    holds = ("the old bytes" if data == OLD else "all the new bytes" if data == NEW
             else "nothing (gone)" if data is None else f"a mix: {len(data)} bytes")
    for leftover in folder.iterdir():
        leftover.unlink()
    folder.rmdir()
    if status is None:
        return {"file holds": holds, "finished": "no: still running after 10 s"}
    if scenario == "killed":
        return {"file holds": holds}
    events = report["events"]
    renamed = f"rename onto {path.name}"
    at = events.index(renamed) if renamed in events else None
    return {"file holds": holds, "error": report["error"],
            "new bytes fsynced before the rename": at is not None and "fsync file" in events[:at],
            "folder fsynced after the rename": at is not None and "fsync folder" in events[at:]}


def _atomic_reference(scenario: str) -> dict:
    from course_lib.checkpoint import write_atomic

    return atomic_harness(write_atomic, scenario)


register(Exercise(
    name="lesson09.write_atomic",
    notebook="09_failures",
    params=("path", "parts"),
    cases=[case("finished", label="written to the end"),
           case("killed", label="SIGKILLed half-way through the parts")],
    reference=_atomic_reference,
    harness=atomic_harness,
    points=2,
    hints=("Write to a temporary name in the same folder (open it with 'xb'), flush and "
          "os.fsync it, os.replace it onto `path`, then fsync_dir(path.parent); remove the "
          "temporary file in a finally if something failed.",),
))


# --- lesson09.read_plan: which saved pieces a new rank reads --------------------------------

def _pieces(numel: int, world: int) -> list[tuple[int, int]]:
    """(offset, numel) of each rank's piece when `numel` elements are sharded as ZeRO does
    (padded to a multiple of the world; the last ranks may hold less, or nothing)."""
    spans = [_want(numel, world, r) for r in range(world)]
    return [(a, b - a) for a, b in spans if a < numel]


def plan_harness(fn, saved: list, start: int, stop: int) -> list:
    """Fill [start, stop) through the learner's plan from pieces holding 100 + element index;
    -1 where nothing was read, "twice" where two reads overlap."""
    out: list = [-1] * (stop - start)
    for i, src, dst, n in fn([tuple(p) for p in saved], start, stop):
        offset, numel = saved[i]
        if n <= 0 or src < 0 or src + n > numel or dst < 0 or dst + n > stop - start:
            return [f"read ({i}, {src}, {dst}, {n}) falls outside piece {i} or the range"]
        for k in range(n):
            out[dst + k] = "twice" if out[dst + k] != -1 else 100 + offset + src + k
    return out


def _plan_reference(saved: list, start: int, stop: int) -> list:
    return [100 + e for e in range(start, stop)]


_RESHARDS = [(13, 4, 2, 0), (13, 4, 2, 1), (10, 2, 3, 1), (10, 2, 3, 2), (17, 3, 4, 3),
             (17, 3, 4, 0), (5, 4, 3, 1)]


def _want(numel: int, world: int, rank: int) -> tuple[int, int]:
    """The elements [start, stop) `rank` of `world` owns: lesson 08's equal padded shards, cut
    at the end (stated here, not imported: lesson 08 may be the learner's, or unwritten)."""
    size = -(-numel // world)
    return min(numel, rank * size), min(numel, (rank + 1) * size)


register(Exercise(
    name="lesson09.read_plan",
    notebook="09_failures",
    params=("saved", "start", "stop"),
    cases=[case(_pieces(n, old), *_want(n, new, r),
                label=f"{n} elements saved on {old} ranks, rank {r} of {new} loads")
           for n, old, new, r in _RESHARDS]
    + [case([(0, 12)], 3, 9, label="one whole saved tensor, a middle slice"),
       case([(0, 4), (4, 4), (8, 4)], 0, 12, label="every piece, exactly"),
       case([(0, 4), (4, 4), (8, 4)], 4, 8, label="exactly the second piece"),
       case([(0, 4), (4, 4), (8, 4)], 6, 6, label="an empty range")],
    reference=_plan_reference,
    harness=plan_harness,
    points=2,
    hints=("For each saved piece [offset, offset + numel), intersect it with [start, stop): "
          "lo = max(start, offset), hi = min(stop, offset + numel); if lo < hi it gives "
          "(index, lo - offset, lo - start, hi - lo).",),
))


# --- lesson09.checkpoints: which checkpoint to load -----------------------------------------

def checkpoints_harness(fn, layout: str) -> list:
    """Make a folder of checkpoints, some damaged, and return what `fn(root)` lists:
    [(step, folder name)], newest first."""
    import torch

    from course_lib import checkpoint

    root = Path(tempfile.mkdtemp(prefix="lesson09-choose-"))
    try:
        steps = {"plain": [5, 10, 15], "damaged": [100, 200, 300, 400, 900],
                 "wide": [8, 9, 10, 11, 99, 100]}[layout]
        for step in steps:
            checkpoint.save({"w": torch.full((64,), float(step))}, root / f"step-{step:09d}")
        if layout == "damaged":
            (root / "step-000000900" / checkpoint.MANIFEST).unlink()  # killed before its manifest
            shard = next((root / "step-000000400").glob("*.safetensors"))
            shard.write_bytes(shard.read_bytes()[:-8])  # truncated after its manifest
            (root / "step-000000250").mkdir()  # an empty folder
            (root / "notes.txt").write_text("not a checkpoint")
            (root / "step-latest").mkdir()
        got = fn(root)
        return [(int(s), Path(p).name) for s, p in got]
    finally:
        for sub in sorted(root.rglob("*"), reverse=True):
            sub.rmdir() if sub.is_dir() else sub.unlink()
        root.rmdir()


def _checkpoints_reference(layout: str) -> list:
    from course_lib.recovery import checkpoints

    return checkpoints_harness(checkpoints, layout)


register(Exercise(
    name="lesson09.checkpoints",
    notebook="09_failures",
    params=("root",),
    cases=[case("plain", label="three complete checkpoints"),
           case("damaged", label="one without a manifest, one truncated, strays"),
           case("wide", label="steps 8 to 100: newest by number")],
    reference=_checkpoints_reference,
    harness=checkpoints_harness,
    points=2,
    hints=("List root, keep the folders named step-<digits>, keep those whose manifest "
          "checkpoint.read_manifest accepts (it raises CheckpointError otherwise), and sort by "
          "the step as a number, newest first.",),
))


# --- lesson09.accumulation_steps ---------------------------------------------------------------

def accumulation_harness(fn, global_batch: int, micro_batch: int, world_size: int):
    try:
        return fn(global_batch, micro_batch, world_size)
    except ValueError:
        return "raises ValueError"


def _accumulation_reference(global_batch: int, micro_batch: int, world_size: int):
    from course_lib.recovery import accumulation_steps

    return accumulation_harness(accumulation_steps, global_batch, micro_batch, world_size)


register(Exercise(
    name="lesson09.accumulation_steps",
    notebook="09_failures",
    params=("global_batch", "micro_batch", "world_size"),
    cases=[case(12, 1, 4, label="12 = 4 ranks x 3 micro-batches of 1"),
           case(12, 1, 3, label="one of the 4 ranks died: 3 ranks"),
           case(48, 4, 2, label="48 on 2 ranks of micro-batches of 4"),
           case(64, 8, 8, label="a step of one micro-batch each"),
           case(12, 1, 5, label="5 ranks cannot share 12 samples: an error"),
           case(48, 5, 2, label="micro-batches of 5 do not add up to 48: an error")],
    reference=_accumulation_reference,
    harness=accumulation_harness,
    points=1,
    hints=("Each step takes micro_batch x world_size samples per micro-batch round: the count "
          "is global_batch // (micro_batch * world_size), and a ValueError when that does not "
          "divide exactly (the global batch would change).",),
))
