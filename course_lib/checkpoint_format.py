"""The bytes of a checkpoint's files, for `course_lib.checkpoint_files` (and through it lesson
09a's `save` and `load`).

A checkpoint is a folder: one safetensors file per rank that holds something, and
`manifest.json`, written last, naming every tensor's pieces (file, offset in the flattened
tensor, length) and every file's size and CRC-32. Nothing is unpickled: tensors are raw bytes,
everything else JSON.

- `shard_name`, `shard_parts`, `write_shard`: a safetensors file straight from tensor memory,
  hashed as it goes out, through the atomic writer it is given;
- `read_manifest`, `map_file`, `parse_shard`, `read_shard`, `verify`, `crc32`: reading back,
  nothing trusted unchecked;
- `CheckpointError`: what cannot be saved or loaded, naming the file and the rank.
"""

from __future__ import annotations

import json
import math
import mmap
import os
import struct
import threading
import warnings
import zlib
from pathlib import Path
from typing import Any, Callable

import torch

from course_lib.dist.wire import byte_view
from course_lib.i18n import _

MANIFEST = "manifest.json"
FORMAT = "course_lib.checkpoint/1"
ST_DTYPE = {torch.float64: "F64", torch.float32: "F32", torch.float16: "F16",
            torch.bfloat16: "BF16", torch.int64: "I64", torch.int32: "I32", torch.int16: "I16",
            torch.int8: "I8", torch.uint8: "U8", torch.bool: "BOOL"}  # safetensors' names


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be saved or loaded, naming the file and the rank."""


class Crc32:
    """zlib's CRC-32 with hashlib's update/hexdigest: twice SHA-256's speed, and enough to
    catch torn writes and flipped bits (a manifest is not a signature either way)."""

    def __init__(self) -> None:
        self.value = 0

    def update(self, data: Any) -> None:
        self.value = zlib.crc32(data, self.value)

    def hexdigest(self) -> str:
        return f"{self.value:08x}"


def crc32(data: Any) -> str:
    """The CRC-32 of a buffer (bytes, a memoryview, a uint8 tensor) as the manifest writes it."""
    digest = Crc32()
    digest.update(data.numpy() if isinstance(data, torch.Tensor) else data)
    return digest.hexdigest()


# -- writing -----------------------------------------------------------------------------------


def shard_name(rank: int, world: int, token: str) -> str:
    return f"shard-{rank:05d}-of-{world:05d}.{token}.safetensors"


def shard_parts(tensors: dict[str, torch.Tensor]) -> list:
    """A safetensors file's bytes as buffers: the header, then each tensor's memory (no copy)."""
    header, at = {}, 0
    # Widest elements first, as safetensors writes them, so every tensor's offset is aligned.
    tensors = dict(sorted(tensors.items(), key=lambda kv: -kv[1].element_size()))
    for name, t in tensors.items():
        header[name] = {"dtype": ST_DTYPE[t.dtype], "shape": list(t.shape),
                        "data_offsets": [at, at + t.nbytes]}
        at += t.nbytes
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # the format pads the header to 8 bytes with spaces
    return [struct.pack("<Q", len(text)) + text] + [byte_view(t) for t in tensors.values()]


def to_host(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`tensors` in host memory, before any byte of them is read through a host pointer (the
    file writes and the CRC thread): GPU tensors are copied out, into pinned buffers without
    blocking, then one synchronization; CPU tensors are kept as they are (no copy)."""
    out = {k: t if t.device.type == "cpu" else torch.empty(
               t.shape, dtype=t.dtype, device="cpu", pin_memory=t.device.type == "cuda"
           ).copy_(t.detach(), non_blocking=True) for k, t in tensors.items()}
    if any(t.device.type == "cuda" for t in tensors.values()):
        torch.cuda.synchronize()
    return out


def write_shard(path: Path, tensors: dict[str, torch.Tensor],
                write: Callable[[Path, list], None]) -> dict | None:
    """Write `tensors` as a safetensors file through `write(path, parts)` (the atomic writer),
    hashing on a second thread as the bytes go out; its size and CRC-32 for the manifest, or
    None when there is nothing to write."""
    if not tensors:
        return None
    parts = shard_parts(to_host(tensors))
    digest = Crc32()
    hasher = threading.Thread(target=lambda: [digest.update(p) for p in parts])
    hasher.start()  # zlib and file writes both release the GIL on large buffers
    try:
        write(path, parts)
    except Exception as exc:  # noqa: BLE001 - named with the file, for every rank to read
        raise CheckpointError(_("writing {path}: {kind}: {exc}", path=path,
                                kind=type(exc).__name__, exc=exc)) from exc
    finally:
        hasher.join()
    return {"bytes": sum(len(p) for p in parts), "crc32": digest.hexdigest()}


# -- loading -----------------------------------------------------------------------------------


def read_manifest(checkpoint_id: str | os.PathLike) -> dict:
    """The manifest of a complete checkpoint (every file present with its size, every piece in
    a listed file), or a CheckpointError naming what is missing or malformed. Checksums are
    the loader's to check."""
    folder = Path(checkpoint_id)
    path = folder / MANIFEST
    try:
        manifest = json.loads(path.read_bytes())
    except FileNotFoundError:
        raise CheckpointError(_("{folder}: no {manifest} (the save never finished)",
                                folder=folder, manifest=MANIFEST)) from None
    except (OSError, ValueError) as exc:
        raise CheckpointError(_("{path}: unreadable manifest: {exc}", path=path, exc=exc)) from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT or not all(
            isinstance(manifest.get(k), dict) for k in ("files", "tensors", "values")):
        raise CheckpointError(_("{path}: not a {format} manifest", path=path, format=FORMAT))
    for name, info in manifest["files"].items():
        if Path(name).name != name:
            raise CheckpointError(_("{path}: file name {name} leaves the folder", path=path,
                                    name=repr(name)))
        try:
            size = (folder / name).stat().st_size
        except OSError:
            raise CheckpointError(_("{file}: missing", file=folder / name)) from None
        if size != info.get("bytes"):
            raise CheckpointError(_("{file}: {size} bytes, the manifest says {listed} (truncated "
                                    "or overwritten)", file=folder / name, size=size,
                                    listed=info.get("bytes")))
    for key, entry in manifest["tensors"].items():
        for piece in entry.get("pieces", []):
            if piece.get("file") not in manifest["files"]:
                raise CheckpointError(_("{path}: {key} is in {file}, which it does not list",
                                        path=path, key=repr(key), file=piece.get("file")))
    return manifest


def map_file(path: Path) -> torch.Tensor:
    """A file's bytes as a read-only uint8 tensor over the file mapped into memory (no copy)."""
    try:
        with open(path, "rb") as f:
            if os.fstat(f.fileno()).st_size < 8:
                raise CheckpointError(_("{path}: too short for a safetensors file", path=path))
            mapped = mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ,
                               flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0))
    except OSError as exc:
        raise CheckpointError(f"{path}: {exc}") from None
    with warnings.catch_warnings():  # read-only memory: only ever copied out of
        warnings.simplefilter("ignore", UserWarning)
        return torch.frombuffer(mapped, dtype=torch.uint8)


def parse_shard(buffer: torch.Tensor, path: Path | str = "shard") -> dict[str, torch.Tensor]:
    """A safetensors file's tensors, as flat views of its bytes, every offset checked."""
    try:
        (size,) = struct.unpack("<Q", bytes(buffer[:8].numpy()))
        if not 2 <= size <= buffer.numel() - 8:
            raise ValueError(_("header of {size} bytes in a file of {total}", size=size,
                               total=buffer.numel()))
        header = json.loads(bytes(buffer[8:8 + size].numpy()))
        data, out = buffer[8 + size:], {}
        dtypes = {v: k for k, v in ST_DTYPE.items()}
        for name, entry in header.items():
            if name == "__metadata__":
                continue
            dtype, (a, b) = dtypes[entry["dtype"]], entry["data_offsets"]
            numel = math.prod(int(n) for n in entry["shape"])
            if not 0 <= a <= b <= data.numel() or b - a != numel * dtype.itemsize:
                raise ValueError(_("{name}: offsets [{a}, {b}) do not fit {entry}",
                                   name=repr(name), a=a, b=b, entry=entry))
            raw = data[a:b] if a % dtype.itemsize == 0 else data[a:b].clone()  # another writer's
            out[name] = raw.view(dtype).view(-1) if numel else torch.empty(0, dtype=dtype)
        return out
    except (ValueError, KeyError, TypeError, RuntimeError, struct.error) as exc:
        raise CheckpointError(_("{path}: not a safetensors file: {exc}", path=path,
                                exc=exc)) from None


def read_shard(folder: Path, name: str, info: dict) -> dict[str, torch.Tensor]:
    """One shard's tensors after checking its size and checksum against the manifest's `info`."""
    data = map_file(Path(folder) / name)
    if data.numel() != info["bytes"]:
        raise CheckpointError(_("{file}: {size} bytes, the manifest says {listed} (truncated or "
                                "overwritten)", file=Path(folder) / name, size=data.numel(),
                                listed=info["bytes"]))
    if crc32(data) != info["crc32"]:
        raise CheckpointError(_("{file}: checksum mismatch (the file is corrupt)",
                                file=Path(folder) / name))
    return parse_shard(data, Path(folder) / name)


def verify(checkpoint_id: str | os.PathLike) -> dict:
    """Read every file of a checkpoint and check it against the manifest; returns the manifest."""
    manifest = read_manifest(checkpoint_id)
    for name, info in manifest["files"].items():
        read_shard(Path(checkpoint_id), name, info)
    return manifest
