"""What lesson 09's checks share: a temporary folder every rank of a check uses, fixture
checkpoints written with `course_lib.checkpoint_files` (never through the learner's `save`, so
each check stands on its own) and read back with the package's own reader, and a learner's
exception as the checks report it.

Components (course_lib.checkpoint_files, ...) are imported inside the functions that use them,
on purpose: the learner's overlay decides at each call which version runs (theirs or the
reference), and a name bound at import time would keep the first one.
"""

from __future__ import annotations

import json
import math
import re
import shutil
import tempfile
from pathlib import Path


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



def saved_values(step: int) -> dict:
    """What `read_back` finds in a checkpoint of `save_state`'s (or `write_fixture`'s) step."""
    return {"w": [W_BASE + 100 * (step - 100) + e for e in range(W_NUMEL)],
            "bias": [float(v) * step / 100 for v in range(1, 5)], "step": step}
