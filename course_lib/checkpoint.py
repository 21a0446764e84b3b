"""Checkpoints that cannot be half-written, saved by every rank in parallel and loaded on any
number of ranks, shaped like `torch.distributed.checkpoint` (`save`, `load` in place).

A checkpoint is a folder: one safetensors file per rank that holds something, and
`manifest.json`, written last, naming every tensor's pieces (file, offset in the flattened
tensor, length) and every file's size and CRC-32. A folder without a complete manifest, or
whose files do not match it, is never loaded. Nothing is unpickled: tensors are raw bytes,
everything else JSON.

Shards are in the safetensors format (the `safetensors` library opens them), written straight
from tensor memory and checksummed as they go out, read by mapping the file into memory.

State dicts are nested dicts and lists whose leaves are tensors (the same on every rank that
holds them: saved once), `Piece`s (one rank's part of a sharded tensor: ZeRO, FSDP) and JSON
values (int, float, str, bool, None).
"""

from __future__ import annotations

import zlib
import json
import math
import mmap
import os
import secrets
import struct
import threading
import warnings
from pathlib import Path
from typing import Any, Iterator

import torch

from course_lib.backend import default_dist
from course_lib.dist.wire import byte_view
from course_lib.zero import Piece

__all__ = ["CheckpointError", "Piece", "flatten", "read_plan", "save", "load", "verify",
           "MANIFEST", "FORMAT", "read_manifest", "read_shard", "write_atomic",
           "rank_and_size"]

MANIFEST = "manifest.json"
FORMAT = "course_lib.checkpoint/1"
_VALUE_TYPES = (int, float, str, bool, type(None))
_ST_DTYPE = {torch.float64: "F64", torch.float32: "F32", torch.float16: "F16",
             torch.bfloat16: "BF16", torch.int64: "I64", torch.int32: "I32", torch.int16: "I16",
             torch.int8: "I8", torch.uint8: "U8", torch.bool: "BOOL"}  # safetensors' names


class Crc32:
    """zlib's CRC-32 with hashlib's update/hexdigest: twice SHA-256's speed, and enough to
    catch torn writes and flipped bits (a manifest is not a signature either way)."""

    def __init__(self) -> None:
        self.value = 0

    def update(self, data: Any) -> None:
        self.value = zlib.crc32(data, self.value)

    def hexdigest(self) -> str:
        return f"{self.value:08x}"


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be saved or loaded, naming the file and the rank."""


def flatten(state_dict: Any, prefix: str = "") -> dict[str, tuple[Any, Any, Any]]:
    """Every leaf of a nested dict/list as `{dotted key: (leaf, container, key in it)}`, the
    way DCP flattens ("optim.state.0.weight.exp_avg"); the container lets `load` replace values."""
    out: dict[str, tuple[Any, Any, Any]] = {}
    items = state_dict.items() if isinstance(state_dict, dict) else enumerate(state_dict)
    for k, v in items:
        if not isinstance(k, (str, int)):
            raise TypeError(f"checkpoint: key {k!r} under {prefix or 'the root'!r} is not a str")
        key = f"{prefix}{k}"
        if isinstance(v, (dict, list)) and len(v):
            sub = flatten(v, key + ".")
        elif isinstance(v, (torch.Tensor, Piece, dict, list) + _VALUE_TYPES):
            sub = {key: (v, state_dict, k)}
        else:
            raise TypeError(f"checkpoint: {key!r} is a {type(v).__name__}; a state dict holds "
                            "tensors, Pieces, JSON values and dicts/lists of them")
        clash = out.keys() & sub.keys()
        if clash:
            raise ValueError(f"checkpoint: two entries flatten to the key {clash.pop()!r}")
        out.update(sub)
    return out


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _describe(leaf: Any) -> dict:
    """What this rank holds under one key, as plain JSON."""
    if isinstance(leaf, Piece):
        return {"kind": "piece", "dtype": _dtype_name(leaf.tensor.dtype),
                "shape": list(leaf.shape), "offset": leaf.offset, "numel": leaf.tensor.numel()}
    if isinstance(leaf, torch.Tensor):
        return {"kind": "tensor", "dtype": _dtype_name(leaf.dtype), "shape": list(leaf.shape),
                "offset": 0, "numel": leaf.numel()}
    return {"kind": "value", "value": leaf}


def rank_and_size(dist: Any, group: Any) -> tuple[Any, int, int]:
    """(dist or None for one process, this rank in the group, the group's size)."""
    dist = default_dist(dist)
    if not dist.is_initialized():
        return None, 0, 1
    return dist, dist.get_rank(group), dist.get_world_size(group)


def _all_gather_json(obj: Any, dist: Any, group: Any, world: int) -> list[Any]:
    """Every rank's `obj`, in rank order, as JSON bytes in uint8 tensors (never pickled)."""
    if dist is None:
        return [obj]
    data = json.dumps(obj).encode()
    size = torch.tensor([len(data)], dtype=torch.int64)
    sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(world)]
    dist.all_gather(sizes, size, group=group)
    longest = int(max(s.item() for s in sizes))
    mine = torch.zeros(longest, dtype=torch.uint8)
    mine[:len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else mine[:0]
    everyone = [torch.empty(longest, dtype=torch.uint8) for _ in range(world)]
    dist.all_gather(everyone, mine, group=group)
    return [json.loads(bytes(t[:int(s.item())].numpy())) for t, s in zip(everyone, sizes)]


def _agree(error: str | None, what: str, dist: Any, group: Any, world: int) -> None:
    """Raise the same CheckpointError on every rank if any rank failed (nobody waits forever
    on a rank that gave up)."""
    errors = _all_gather_json(error, dist, group, world)
    failed = [f"rank {r}: {e}" for r, e in enumerate(errors) if e]
    if failed:
        raise CheckpointError(f"{what} failed: " + "; ".join(failed))


def _plan(plans: list[dict[str, dict]]) -> tuple[dict[str, dict], dict[str, Any], list[list]]:
    """From every rank's holdings: each tensor's entry (dtype, shape, pieces), the values, and
    what each rank writes (keys and pieces), sharing replicated tensors' writes out by bytes."""
    entries: dict[str, dict] = {}
    values: dict[str, Any] = {}
    writes: list[list] = [[] for _ in plans]
    load = [0] * len(plans)
    for key in sorted({k for p in plans for k in p}):
        held = [(r, p[key]) for r, p in enumerate(plans) if key in p]
        kinds = {h["kind"] for _, h in held}
        if len(kinds) > 1:
            raise ValueError(f"{key!r} is a {' on some ranks and a '.join(sorted(kinds))} on "
                             "others")
        if kinds == {"value"}:
            differ = [r for r, h in held if h["value"] != held[0][1]["value"]]
            if differ:
                raise ValueError(f"{key!r} differs between rank {held[0][0]} and rank "
                                 f"{differ[0]}: key a rank's own state by its rank")
            values[key] = held[0][1]["value"]
            continue
        r0, h0 = held[0]
        for r, h in held:
            if (h["dtype"], h["shape"]) != (h0["dtype"], h0["shape"]):
                raise ValueError(f"{key!r} is {h0['dtype']}{h0['shape']} on rank {r0} but "
                                 f"{h['dtype']}{h['shape']} on rank {r}")
        pieces: dict[tuple[int, int], int] = {}
        for r, h in held:
            span = (h["offset"], h["numel"])
            if span not in pieces or load[r] < load[pieces[span]]:
                pieces[span] = r  # replicated: the least loaded holder writes it
        numel = 1
        for n in h0["shape"]:
            numel *= n
        entries[key] = {"dtype": h0["dtype"], "shape": h0["shape"], "pieces": []}
        at = 0
        for (offset, n), r in sorted(pieces.items()):
            if offset != at or offset + n > numel:
                raise ValueError(f"{key!r}: its pieces overlap or leave elements "
                                 f"[{at}, {offset}) of {numel} to no rank")
            at = offset + n
            name = key if h0["kind"] == "tensor" else f"{key}@{offset}"
            entries[key]["pieces"].append({"rank": r, "name": name, "offset": offset,
                                           "numel": n})
            writes[r].append((key, name, offset))
            load[r] += n
        if at != numel:
            raise ValueError(f"{key!r}: elements [{at}, {numel}) are held by no rank")
    return entries, values, writes


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_atomic(path: Path, data: bytes | list) -> None:
    """Write `data` (bytes, or a list of buffers) to a temporary name beside `path`, fsync
    it, rename it onto `path` and fsync the folder: `path` holds the old bytes or all the new
    ones, never part of them."""
    tmp = path.with_name(f".{path.name}.{secrets.token_hex(4)}.tmp")
    try:
        with open(tmp, "xb") as f:
            for part in [data] if isinstance(data, bytes) else data:
                f.write(part)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    _fsync_dir(path.parent)


def _flat(leaf: Any) -> torch.Tensor:
    """A leaf's values as one contiguous row (a copy only when they are not contiguous)."""
    return (leaf.tensor if isinstance(leaf, Piece) else leaf).detach().reshape(-1).contiguous()


def _write_shard(path: Path, tensors: dict[str, torch.Tensor]) -> dict:
    """Write a safetensors file straight from the tensors' memory (no serialized copy),
    hashing on a second thread as the bytes go out; atomically, as `write_atomic` does."""
    header, at = {}, 0
    # Widest elements first, as safetensors writes them, so every tensor's offset is aligned.
    tensors = dict(sorted(tensors.items(), key=lambda kv: -kv[1].element_size()))
    for name, t in tensors.items():
        header[name] = {"dtype": _ST_DTYPE[t.dtype], "shape": list(t.shape),
                        "data_offsets": [at, at + t.nbytes]}
        at += t.nbytes
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # the format pads the header to 8 bytes with spaces
    parts = [struct.pack("<Q", len(text)) + text] + [byte_view(t) for t in tensors.values()]
    digest = Crc32()
    hasher = threading.Thread(target=lambda: [digest.update(p) for p in parts])
    hasher.start()  # hashlib and file writes both release the GIL on large buffers
    try:
        write_atomic(path, parts)
    finally:
        hasher.join()
    return {"bytes": sum(len(p) for p in parts), "crc32": digest.hexdigest()}


def save(state_dict: dict, checkpoint_id: str | os.PathLike, *, dist: Any = None,
         group: Any = None) -> None:
    """Save `state_dict` into the folder `checkpoint_id`; every rank of `group` calls it with
    its own part. Returns once the manifest is on disk: until then the folder's previous
    checkpoint, if any, is the one that loads."""
    dist, rank, world = rank_and_size(dist, group)
    folder = Path(checkpoint_id)
    leaves = flatten(state_dict)
    mine = {k: _describe(leaf) for k, (leaf, _, _) in leaves.items()}
    token = secrets.token_hex(6)
    plans = _all_gather_json({"plan": mine, "token": token}, dist, group, world)
    token = plans[0]["token"]  # rank 0's: every rank names its file for this save
    error = info = None
    try:
        entries, values, writes = _plan([p["plan"] for p in plans])
    except ValueError as exc:
        raise CheckpointError(f"save of {folder}: {exc}") from None
    shard = f"shard-{rank:05d}-of-{world:05d}.{token}.safetensors"
    try:
        folder.mkdir(parents=True, exist_ok=True)
        if writes[rank]:
            info = _write_shard(folder / shard,
                                {name: _flat(leaves[key][0]) for key, name, _ in writes[rank]})
    except Exception as exc:  # noqa: BLE001 - every rank must hear of it, not wait for it
        error = f"writing {folder / shard}: {type(exc).__name__}: {exc}"
    infos = _all_gather_json({"error": error, "info": info}, dist, group, world)
    failed = [f"rank {r}: {i['error']}" for r, i in enumerate(infos) if i["error"]]
    if failed:
        if info is not None:
            (folder / shard).unlink(missing_ok=True)
        raise CheckpointError(f"save of {folder} failed, the previous checkpoint stays: "
                              + "; ".join(failed))
    files = {f"shard-{r:05d}-of-{world:05d}.{token}.safetensors": i["info"]
             for r, i in enumerate(infos) if i["info"] is not None}
    for entry in entries.values():
        for piece in entry["pieces"]:
            piece["file"] = f"shard-{piece.pop('rank'):05d}-of-{world:05d}.{token}.safetensors"
    error = None
    if rank == 0:
        manifest = {"format": FORMAT, "world_size": world, "files": files, "tensors": entries,
                    "values": values}
        try:
            write_atomic(folder / MANIFEST, json.dumps(manifest, indent=1).encode())
            for old in folder.iterdir():  # an earlier save's files, in the same folder
                if old.name != MANIFEST and old.name not in files:
                    old.unlink(missing_ok=True)
        except OSError as exc:
            error = f"writing {folder / MANIFEST}: {exc}"
    _agree(error, f"save of {folder}", dist, group, world)


def read_manifest(checkpoint_id: str | os.PathLike) -> dict:
    """The manifest of a complete checkpoint (every file present with its size), or a
    CheckpointError naming what is missing or malformed. Checksums are checked on read."""
    folder = Path(checkpoint_id)
    path = folder / MANIFEST
    try:
        manifest = json.loads(path.read_bytes())
    except FileNotFoundError:
        raise CheckpointError(f"{folder}: no {MANIFEST} (the save never finished)") from None
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"{path}: unreadable manifest: {exc}") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT or not all(
            isinstance(manifest.get(k), dict) for k in ("files", "tensors", "values")):
        raise CheckpointError(f"{path}: not a {FORMAT} manifest")
    for name, info in manifest["files"].items():
        if Path(name).name != name:
            raise CheckpointError(f"{path}: file name {name!r} leaves the folder")
        try:
            size = (folder / name).stat().st_size
        except OSError:
            raise CheckpointError(f"{folder / name}: missing") from None
        if size != info.get("bytes"):
            raise CheckpointError(f"{folder / name}: {size} bytes, the manifest says "
                                  f"{info.get('bytes')} (truncated or overwritten)")
    return manifest


def read_shard(folder: Path, name: str, info: dict) -> dict[str, torch.Tensor]:
    """One shard file's tensors, read-only views of the file mapped into memory, after checking
    its size and checksum against the manifest and its header against the safetensors format.
    (Mapping costs no copy and no fresh pages: reading into a new buffer took twice as long.)"""
    path = folder / name
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            if size != info["bytes"] or size < 8:
                raise CheckpointError(f"{path}: {size} bytes, the manifest says "
                                      f"{info['bytes']} (truncated or overwritten)")
            mapped = mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ,
                               flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0))
    except OSError as exc:
        raise CheckpointError(f"{path}: {exc}") from None
    digest = Crc32()
    digest.update(mapped)
    if digest.hexdigest() != info["crc32"]:
        raise CheckpointError(f"{path}: checksum mismatch (the file is corrupt)")
    with warnings.catch_warnings():  # read-only memory: we only ever copy out of it
        warnings.simplefilter("ignore", UserWarning)
        buffer = torch.frombuffer(mapped, dtype=torch.uint8)
    try:
        return _parse_safetensors(buffer)
    except (ValueError, KeyError, TypeError, RuntimeError) as exc:
        raise CheckpointError(f"{path}: not a safetensors file: {exc}") from None


def _parse_safetensors(buffer: torch.Tensor) -> dict[str, torch.Tensor]:
    """Tensors as views of a safetensors file's bytes, every offset checked against its size."""
    (size,) = struct.unpack("<Q", bytes(buffer[:8].numpy()))
    if not 2 <= size <= buffer.numel() - 8:
        raise ValueError(f"header of {size} bytes in a file of {buffer.numel()}")
    header = json.loads(bytes(buffer[8:8 + size].numpy()))
    data, out = buffer[8 + size:], {}
    dtypes = {v: k for k, v in _ST_DTYPE.items()}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        dtype, (a, b) = dtypes[entry["dtype"]], entry["data_offsets"]
        shape = [int(n) for n in entry["shape"]]
        numel = math.prod(shape)
        if not 0 <= a <= b <= data.numel() or b - a != numel * dtype.itemsize:
            raise ValueError(f"{name!r}: offsets [{a}, {b}) do not fit {entry}")
        raw = data[a:b] if a % dtype.itemsize == 0 else data[a:b].clone()  # another writer's
        out[name] = raw.view(dtype).view(shape) if numel else torch.empty(shape, dtype=dtype)
    return out


def verify(checkpoint_id: str | os.PathLike) -> dict:
    """Read every file of a checkpoint and check it against the manifest; returns the manifest."""
    manifest = read_manifest(checkpoint_id)
    for name, info in manifest["files"].items():
        read_shard(Path(checkpoint_id), name, info)
    return manifest


def read_plan(saved: list[tuple[int, int]], start: int, stop: int
              ) -> list[tuple[int, int, int, int]]:
    """Which saved pieces fill elements [start, stop) of a flattened tensor, given each piece's
    (offset, numel): (piece index, offset in that piece, offset in [start, stop), length)."""
    out = []
    for i, (offset, numel) in enumerate(saved):
        lo, hi = max(start, offset), min(stop, offset + numel)
        if lo < hi:
            out.append((i, lo - offset, lo - start, hi - lo))
    return out


def _destination(key: str, leaf: Any, entry: dict) -> tuple[torch.Tensor, int]:
    """(the flat tensor to fill, its offset in the saved tensor), checking dtype and shape."""
    tensor, offset, shape = ((leaf.tensor, leaf.offset, list(leaf.shape))
                             if isinstance(leaf, Piece) else (leaf, 0, list(leaf.shape)))
    if (_dtype_name(tensor.dtype), shape) != (entry["dtype"], entry["shape"]):
        raise CheckpointError(f"{key!r}: the checkpoint holds {entry['dtype']}{entry['shape']}, "
                              f"the state dict asks for {_dtype_name(tensor.dtype)}{shape}")
    return tensor, offset


def _reads(key: str, leaf: Any, entry: dict) -> Iterator[tuple[str, str, int, int, int]]:
    """(file, tensor name, offset in it, offset in the destination, length) for one leaf."""
    tensor, start = _destination(key, leaf, entry)
    stop = start + tensor.numel()
    pieces = entry["pieces"]
    plan = read_plan([(p["offset"], p["numel"]) for p in pieces], start, stop)
    if sum(n for *_, n in plan) != stop - start:
        raise CheckpointError(f"{key!r}: elements [{start}, {stop}) are not all in the "
                              "checkpoint")
    for i, src, dst, n in plan:
        yield pieces[i]["file"], pieces[i]["name"], src, dst, n


def load(state_dict: dict, checkpoint_id: str | os.PathLike, *, dist: Any = None,
         group: Any = None) -> None:
    """Fill `state_dict` in place from the checkpoint: tensors and Pieces are copied into, values
    replaced. Each rank reads only the files its tensors overlap, on any number of ranks; every
    file read is checked first, and if any rank's check fails no rank changes anything."""
    dist, rank, world = rank_and_size(dist, group)
    folder = Path(checkpoint_id)
    leaves = flatten(state_dict)
    error, reads, shards = None, [], {}
    try:
        manifest = read_manifest(folder)
        missing = [k for k, (leaf, _, _) in leaves.items()
                   if k not in (manifest["tensors"] if isinstance(leaf, (torch.Tensor, Piece))
                                else manifest["values"])]
        if missing:
            raise CheckpointError(f"{folder}: no {', '.join(map(repr, missing[:5]))}"
                                  + (f" and {len(missing) - 5} more" if len(missing) > 5 else ""))
        for key, (leaf, _, _) in leaves.items():
            if isinstance(leaf, (torch.Tensor, Piece)):
                reads += [(key, *r) for r in _reads(key, leaf, manifest["tensors"][key])]
        for name in sorted({r[1] for r in reads}):
            if name not in manifest["files"]:
                raise CheckpointError(f"{folder / MANIFEST}: names {name}, which it does not list")
            shards[name] = read_shard(folder, name, manifest["files"][name])
    except CheckpointError as exc:
        error = str(exc)
    _agree(error, f"load of {folder}", dist, group, world)
    flats: dict[str, torch.Tensor] = {}
    with torch.no_grad():
        for key, name, tensor_name, src, dst, n in reads:
            if key not in flats:
                leaf = leaves[key][0]
                target = leaf.tensor if isinstance(leaf, Piece) else leaf
                flats[key] = target.view(-1) if target.is_contiguous() else target.reshape(-1)
            flats[key][dst:dst + n].copy_(shards[name][tensor_name][src:src + n])
        for key, flat in flats.items():  # a non-contiguous target was filled through a copy
            leaf = leaves[key][0]
            target = leaf.tensor if isinstance(leaf, Piece) else leaf
            if not target.is_contiguous():
                target.copy_(flat.view_as(target))
    for key, (leaf, container, k) in leaves.items():
        if not isinstance(leaf, (torch.Tensor, Piece)):
            container[k] = manifest["values"][key]
