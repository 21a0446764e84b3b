"""Lesson 09 (failures), in two parts.

09a (checkpoints): the atomic write (killed mid-write in a child process), the save protocol and
the verified load on the first 2, 3 and 4 ranks of the grader's cluster (shard writes and renames
watched, a full disk on one rank, a checkpoint saved on another number of ranks, a flipped byte,
a missing piece), and the resharding plan. 09b (recovery): the flight recorder's verdict on
another rank from its record, what a checkpoint must hold to resume exactly (checked by
resuming a short run on 2, 3 and 4 ranks), the accumulation that keeps the global batch when
the world shrinks, and which checkpoints are complete.

Fixture checkpoints are written here with `course_lib.checkpoint_files`, never through the
learner's `save`, so each check stands on its own. Expected values and explanations are
judge-side (`course_lib/course/grading/references/lesson09.py`).

Components (course_lib.ddp, ...) are imported inside the functions that use them, on
purpose: the learner's overlay decides at each call which version runs (theirs or the
reference), and a name bound at import time would keep the first one.
"""

from __future__ import annotations

import errno
import json
import math
import os
import re
import shutil
import signal
import stat
import tempfile
import time
from pathlib import Path

from course_lib.course.grading import RANK, WORLD_SIZE, Exercise, case, register
from course_lib.course.catalogue import CheckTimeout
from course_lib.course.grading.sub_worlds import on_first_ranks, register_on_sub_worlds

PART_A, PART_B = "09a_checkpoints", "09b_recovery"
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


# --- a shared folder and fixture checkpoints --------------------------------------------------


def _shared_folder(dist, rank: int, what: str) -> Path:
    """A new temporary folder, made by rank 0 and named to the others by a broadcast."""
    import torch

    name = torch.zeros(256, dtype=torch.uint8)
    if rank == 0:
        text = tempfile.mkdtemp(prefix=f"lesson09-{what}-").encode()
        name[:len(text)] = torch.frombuffer(bytearray(text), dtype=torch.uint8)
    dist.broadcast(name, 0)
    return Path(bytes(name[name != 0].numpy()).decode())


def _remove(folder: Path) -> None:
    shutil.rmtree(folder, ignore_errors=True)


def _cleanup(dist, rank: int, folder: Path) -> None:
    """After a case: the ranks meet, then rank 0 removes the shared folder, even when a wrong
    version left the ranks in different collectives and the meeting fails."""
    try:
        dist.barrier()
    finally:
        if rank == 0:
            _remove(folder)


def _plain_write(path: Path, parts: list) -> None:
    with open(path, "wb") as f:
        for part in parts:
            f.write(part)


def padded_pieces(numel: int, world: int) -> list[tuple[int, int]]:
    """(offset, numel) of each rank's piece when `numel` elements are sharded as ZeRO shards a
    flat buffer: padded to a multiple of the world, the last ranks holding less, or nothing."""
    size = math.ceil(numel / world)
    spans = [(min(numel, r * size), min(numel, (r + 1) * size)) for r in range(world)]
    return [(a, b - a) for a, b in spans]


W_NUMEL, W_BASE = 13, 1000.0  # the sharded tensor `w`: element e holds W_BASE + e


def write_fixture(folder: Path, world: int, *, step: int = 100, token: str = "f1x7",
                  drop_last_piece: bool = False) -> dict:
    """A checkpoint as `world` ranks would have saved it: `w` (W_NUMEL elements, one ZeRO piece
    per rank), `bias` (4 elements, written by rank 0), `step`; written directly, not through
    the learner's save. Returns the manifest."""
    import torch

    from course_lib import checkpoint_files as cf

    folder.mkdir(parents=True, exist_ok=True)
    whole = torch.arange(W_NUMEL, dtype=torch.float64) + W_BASE + 100 * (step - 100)
    files, pieces = {}, []
    for r, (offset, n) in enumerate(padded_pieces(W_NUMEL, world)):
        tensors = {f"w@{offset}": whole[offset:offset + n].clone()} if n else {}
        if r == 0:
            tensors["bias"] = torch.arange(1.0, 5.0) * step / 100
        if not tensors:
            continue
        name = cf.shard_name(r, world, token)
        files[name] = cf.write_shard(folder / name, tensors, _plain_write)
        if n:
            pieces.append({"file": name, "name": f"w@{offset}", "offset": offset, "numel": n})
    if drop_last_piece:
        pieces.pop()
    manifest = {"format": cf.FORMAT, "world_size": world, "files": files,
                "tensors": {"w": {"dtype": "float64", "shape": [W_NUMEL], "pieces": pieces},
                            "bias": {"dtype": "float32", "shape": [4], "pieces": [
                                {"file": cf.shard_name(0, world, token), "name": "bias",
                                 "offset": 0, "numel": 4}]}},
                "values": {"step": step}}
    (folder / cf.MANIFEST).write_text(json.dumps(manifest, indent=1))
    return manifest


def read_back(folder: Path) -> dict:
    """What a checkpoint in `folder` holds, read with the package's own reader: {"w": [...],
    "bias": [...], "step": n}, or {"error": why}."""
    import torch

    from course_lib import checkpoint_files as cf

    try:
        manifest = cf.read_manifest(folder)
        out = {}
        for key, entry in manifest["tensors"].items():
            whole = torch.zeros(math.prod(entry["shape"]), dtype=getattr(torch, entry["dtype"]))
            for piece in entry["pieces"]:
                data = cf.read_shard(folder, piece["file"], manifest["files"][piece["file"]])
                whole[piece["offset"]:piece["offset"] + piece["numel"]] = data[piece["name"]]
            out[key] = [round(float(v), 6) for v in whole]
        out.update(manifest["values"])
        return out
    except Exception as exc:  # noqa: BLE001 - what is wrong with it, for the report
        return {"error": f"{type(exc).__name__}: {exc}"[:160]}


def _raised(exc: BaseException) -> str:
    """A learner's exception as the check reports it: its kind and the ranks it names."""
    from course_lib.checkpoint_files import CheckpointError

    if isinstance(exc, CheckpointError):
        ranks = sorted({int(r) for r in re.findall(r"\brank (\d+)", str(exc))})
        return ("CheckpointError naming rank " + ", ".join(map(str, ranks)) if ranks
                else "CheckpointError naming no rank")
    return f"{type(exc).__name__}: {str(exc)[:80]}"


# --- lesson09.save ----------------------------------------------------------------------------


def saved_values(step: int) -> dict:
    """What `read_back` finds in a checkpoint of `save_state`'s (or `write_fixture`'s) step."""
    return {"w": [W_BASE + 100 * (step - 100) + e for e in range(W_NUMEL)],
            "bias": [float(v) * step / 100 for v in range(1, 5)], "step": step}


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


# --- lesson09.standing: the flight recorder's verdict on one rank -------------------------------


def _entry(seq: int, op: str, state: str, dtype: str | None = "float32",
           shape: list | None = None) -> dict:
    if op == "barrier":
        dtype, shape = None, None
    return {"seq": seq, "op": op, "dtype": dtype, "shape": [1024] if shape is None and dtype
            else shape, "start": float(seq), "end": None if state == "started" else seq + 0.5,
            "state": state, "algorithm": None}


def _done(n: int, op: str = "all_reduce") -> list[dict]:
    return [_entry(s, op, "completed") for s in range(n)]


# Each scenario: (the asking rank's failed call, {rank: its record or None}); the asking rank
# is not in the records, as in the flight recorder.
SCENARIOS = {
    "2 ranks: rank 1 sleeps": (
        _entry(3, "all_reduce", "failed"), {1: _done(3)}),
    "3 ranks: rank 2 skipped a barrier": (
        _entry(3, "barrier", "failed"),
        {1: _done(3) + [_entry(3, "barrier", "started")],
         2: _done(3) + [_entry(3, "all_reduce", "started")]}),
    "3 ranks: rank 2 called all_reduce on another shape": (
        _entry(3, "all_reduce", "failed"),
        {1: _done(3) + [_entry(3, "all_reduce", "failed")],
         2: _done(3) + [_entry(3, "all_reduce", "failed", shape=[5])]}),
    "4 ranks: rank 3 sleeps, ranks 1 and 2 wait too": (
        _entry(3, "all_reduce", "failed"),
        {1: _done(3) + [_entry(3, "all_reduce", "started")],
         2: _done(3) + [_entry(3, "all_reduce", "started")], 3: _done(3)}),
    "4 ranks: one done, one gone, one stuck in an earlier call": (
        _entry(3, "all_reduce", "failed"),
        {1: _done(3) + [_entry(3, "all_reduce", "completed")], 2: None,
         3: _done(2) + [_entry(2, "all_gather", "started")]}),
    "4 ranks: rank 2 never completed a call of this group": (
        _entry(0, "broadcast", "failed"),
        {1: [_entry(0, "broadcast", "started")], 2: [], 3: [_entry(0, "broadcast", "started")]}),
}


def standing_harness(fn, scenario: str) -> list:
    """The learner's verdict on every other rank of the scenario, in rank order (None for the
    asking rank 0)."""
    call, records = SCENARIOS[scenario]
    world = 1 + max(records)
    out = [None] * world
    for rank in range(1, world):
        record = records[rank]
        got = fn(dict(call), None if record is None else [dict(e) for e in record])
        out[rank] = got
    return out


register(Exercise(
    name="lesson09.standing",
    notebook=PART_B,
    params=("call", "record"),
    cases=[case("2 ranks: rank 1 sleeps", label="2 ranks: rank 1 sleeps"),
           case("3 ranks: rank 2 skipped a barrier", label="3 ranks: rank 2 skipped a barrier"),
           case("3 ranks: rank 2 called all_reduce on another shape",
                label="3 ranks: rank 2 called all_reduce on another shape"),
           case("4 ranks: rank 3 sleeps, ranks 1 and 2 wait too",
                label="4 ranks: rank 3 sleeps, ranks 1 and 2 wait too"),
           case("4 ranks: one done, one gone, one stuck in an earlier call",
                label="4 ranks: one done, one gone, one stuck in an earlier call"),
           case("4 ranks: rank 2 never completed a call of this group",
                label="4 ranks: rank 2 never completed a call of this group")],
    reference="lesson09:standing",
    explain="lesson09:explain_standing",
    harness=standing_harness,
    points=3,
    hints=("A rank that made the same call at the same sequence number is not to blame, "
           "whatever state it is in: it waits, or got through, like this rank. The rank to "
           "blame made no call at that number yet, or made a different one there; and the same "
           "call means the same operation, dtype and shape, not only the same number.",
           "Look at the other rank's entries with this call's sequence number: the last of "
           "them, if any, decides between the same call and another call. For any other "
           "verdict, say how far it got (the highest sequence number below this one that it "
           "completed) and where it is now (the collective it is in, if any)."),
))


# --- lesson09.run_state: what a checkpoint holds to resume exactly ------------------------------

RESUME_SAMPLES, RESUME_PER_RANK, RESUME_STEPS = 24, 2, 6


def _resume_body(dist, rank: int, fn) -> dict:
    import torch

    from course_lib import checkpoint
    from course_lib.recovery import ResumableSampler, restore

    k = dist.get_world_size()
    xs = torch.randn(RESUME_SAMPLES, 6, generator=torch.Generator().manual_seed(1),
                     dtype=torch.float64)
    ys = xs.sum(1, keepdim=True).tanh()

    def build():
        torch.manual_seed(11)
        model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Dropout(0.3),
                                    torch.nn.Tanh(), torch.nn.Linear(8, 1)).double()
        opt = torch.optim.AdamW(model.parameters(), lr=0.05)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
        sampler = ResumableSampler(range(RESUME_SAMPLES), num_replicas=k, rank=rank,
                                   shuffle=True, seed=5)
        torch.manual_seed(100 + rank)  # each rank draws its own dropout masks
        return model, opt, sched, sampler

    def train(parts, steps):
        model, opt, sched, sampler = parts
        for _ in range(steps):
            if sampler.position >= RESUME_SAMPLES:
                sampler.set_epoch(sampler.epoch + 1)
            idx = list(sampler)[:RESUME_PER_RANK]
            sampler.position += RESUME_PER_RANK * k
            torch.nn.functional.mse_loss(model(xs[idx]), ys[idx]).backward()
            for p in model.parameters():
                dist.all_reduce(p.grad)
                p.grad /= k
            opt.step()
            opt.zero_grad()
            sched.step()

    def now(parts):
        model, opt, _, sampler = parts
        if sampler.position >= RESUME_SAMPLES:
            sampler.set_epoch(sampler.epoch + 1)
        return {"next samples": list(sampler)[:RESUME_PER_RANK],
                "learning rate": opt.param_groups[0]["lr"], "draw": torch.rand(3).tolist()}

    half = RESUME_STEPS // 2
    clean = build()
    train(clean, half)
    want = now(clean)
    train(clean, RESUME_STEPS - half)
    folder = _shared_folder(dist, rank, "resume")
    try:
        first = build()
        train(first, half)
        checkpoint.save(fn(*first, half), folder, dist=dist)
        second = build()
        torch.manual_seed(12345)  # whatever the restart's RNG holds: the checkpoint decides
        state = fn(*second, 0, init=True)
        try:
            checkpoint.load(state, folder, dist=dist)
        except checkpoint.CheckpointError as exc:
            return {"resumes at step": "load failed: " + str(exc).rsplit(": ", 1)[-1][:80]}
        try:
            step = restore(*second, state)
        except (KeyError, TypeError) as exc:
            return {"resumes at step": f"restore failed: {type(exc).__name__} {exc}"}
        got = now(second)
        train(second, RESUME_STEPS - half)
        diff = max(float((a - b).abs().max()) for a, b in
                   zip(clean[0].parameters(), second[0].parameters()))
        return {"resumes at step": step, "next samples": got["next samples"],
                "learning rate": got["learning rate"],
                "next random draw": ("as in the uninterrupted run" if got["draw"] == want["draw"]
                                     else "not the uninterrupted run's"),
                "parameters": ("bitwise equal to the uninterrupted run's" if diff == 0 else
                               f"differ from the uninterrupted run's by up to {diff:.1e}")}
    finally:
        _cleanup(dist, rank, folder)


def resume_harness(fn, rank: int, world_size: int, k: int):
    return on_first_ranks(k, _resume_body, fn)


register_on_sub_worlds(
    "lesson09.run_state", PART_B,
    params=("model", "optimizer", "scheduler", "sampler", "step"),
    cases=[case(RANK, WORLD_SIZE, 2, label="2 ranks: 3 steps, save, restart, 3 steps"),
           case(RANK, WORLD_SIZE, 3, label="3 ranks: 3 steps, save, restart, 3 steps"),
           case(RANK, WORLD_SIZE, 4, label="4 ranks: 3 steps, save, restart, 3 steps")],
    reference="lesson09:run_state",
    explain="lesson09:explain_run_state",
    harness=resume_harness,
    points=2,
    time_limit=20.0,
    hints=("The next step depends on more than the weights: on the optimizer's moments, on "
           "the learning rate the scheduler will give, on which samples come next, and on the "
           "random numbers each rank will draw. Some of that is the same on every rank and some "
           "is a rank's own; a checkpoint keeps one copy of what is the same everywhere.",
           "Six entries, by the names the restore expects. The RNG state of a rank must sit "
           "under a key that names that rank, or every rank comes back with one rank's stream."),
)


# --- lesson09.accumulation_steps ---------------------------------------------------------------


def accumulation_harness(fn, global_batch: int, micro_batch: int, world_size: int):
    try:
        return fn(global_batch, micro_batch, world_size)
    except ValueError:
        return "raises ValueError"


register(Exercise(
    name="lesson09.accumulation_steps",
    notebook=PART_B,
    params=("global_batch", "micro_batch", "world_size"),
    cases=[case(12, 1, 4, label="12 = 4 ranks x 3 micro-batches of 1"),
           case(12, 1, 3, label="one of the 4 ranks died: 3 ranks"),
           case(48, 4, 2, label="48 on 2 ranks of micro-batches of 4"),
           case(64, 8, 8, label="a step of one micro-batch each"),
           case(12, 1, 5, label="5 ranks cannot share 12 samples: an error"),
           case(48, 5, 2, label="micro-batches of 5 do not add up to 48: an error")],
    reference="lesson09:accumulation_steps",
    explain="lesson09:explain_accumulation_steps",
    harness=accumulation_harness,
    points=1,
    hints=("A step must take the same number of samples on any world: that number is fixed, "
           "the world is not, so what each rank accumulates must make up the difference; and a "
           "step that cannot take exactly that many is an error, never a rounded step.",
           "One round of micro-batches, one per rank, takes micro_batch samples on each of the "
           "ranks; count how many such rounds make one global batch."),
))


# --- lesson09.checkpoints: which checkpoint to load ---------------------------------------------


def checkpoints_harness(fn, layout: str) -> list:
    """Make a folder of checkpoints, some damaged, and return what `fn(root)` lists:
    [(step, folder name)], newest first."""
    from course_lib import checkpoint_files as cf

    root = Path(tempfile.mkdtemp(prefix="lesson09-choose-"))
    try:
        steps = {"plain": [5, 10, 15], "damaged": [100, 200, 300, 400, 900],
                 "wide": [8, 9, 10, 11, 99, 100]}[layout]
        for step in steps:
            write_fixture(root / f"step-{step:09d}", 1, step=step)
        if layout == "damaged":
            (root / "step-000000900" / cf.MANIFEST).unlink()  # killed before its manifest
            shard = next((root / "step-000000400").glob("*.safetensors"))
            shard.write_bytes(shard.read_bytes()[:-8])  # truncated after its manifest
            (root / "step-000000250").mkdir()  # an empty folder
            (root / "notes.txt").write_text("not a checkpoint")
            (root / "step-latest").mkdir()
        got = fn(root)
        return [(int(s), Path(p).name) for s, p in got]
    finally:
        _remove(root)


register(Exercise(
    name="lesson09.checkpoints",
    notebook=PART_B,
    params=("root",),
    cases=[case("plain", label="three complete checkpoints"),
           case("damaged", label="one without a manifest, one truncated, strays"),
           case("wide", label="steps 8 to 100: newest by number")],
    reference="lesson09:checkpoints",
    explain="lesson09:explain_checkpoints",
    harness=checkpoints_harness,
    points=2,
    hints=("A folder is a checkpoint only if its manifest exists, parses, and every file it "
           "names is there at its size: the reader the lesson gives says so, or raises. "
           "Anything else in the root is not a checkpoint, whatever its name.",
           "Newest means the highest step, compared as a number: the folder names hold it with "
           "leading zeros, and strays do not hold one at all."),
))
