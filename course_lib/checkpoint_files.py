"""The files of a checkpoint, for lesson 09a's `save` and `load` (`course_lib.checkpoint`).

A checkpoint is a folder: one safetensors file per rank that holds something, and
`manifest.json`, written last, naming every tensor's pieces (file, offset in the flattened
tensor, length) and every file's size and CRC-32. Nothing is unpickled: tensors are raw bytes,
everything else JSON. What the lesson teaches (the order of the writes, the agreement between
ranks, which saved pieces a rank reads, the checks before anything is changed) is written by
the learner in `course_lib.checkpoint`; this module holds the bookkeeping, and the format
(`course_lib.checkpoint_format`, whose names are importable from here too):

- `flatten`: a nested state dict's leaves by dotted key, as DCP names them;
- `plan_save`: every rank's holdings, all-gathered as JSON; who writes which tensor (a
  replicated one by the least loaded holder), the shard names, the manifest's text;
- `write_shard` (the format's): a safetensors file straight from tensor memory, hashed as it
  goes out, through the atomic writer it is given;
- `read_manifest`, `map_file`, `parse_shard`, `crc32` (the format's): reading back, nothing
  trusted unchecked;
- `destinations`: where each tensor of a state dict is filled from, its dtype and shape checked;
- `attempt`, `all_gather_json`, `agree`: every rank hears of every rank's failure, so no rank
  waits forever on one that gave up.
"""

from __future__ import annotations

import json
import math
import secrets
from pathlib import Path
from typing import Any, Callable

import torch

from course_lib.backend import comm_device, default_dist
from course_lib.checkpoint_format import (FORMAT, MANIFEST, ST_DTYPE, CheckpointError, Crc32,
                                          crc32, map_file, parse_shard, read_manifest,
                                          read_shard, shard_name, shard_parts, verify,
                                          write_shard)
from course_lib.i18n import _
from course_lib.zero import Piece

__all__ = ["MANIFEST", "FORMAT", "VALUE_TYPES", "ST_DTYPE", "CheckpointError", "Crc32", "crc32",
           "flatten", "is_tensor", "dtype_name", "describe", "flat", "rank_and_size",
           "all_gather_json", "attempt", "agree", "plan_writes", "shard_name", "SavePlan",
           "plan_save", "shard_parts", "write_shard", "read_manifest", "map_file", "parse_shard",
           "read_shard", "verify", "Targets", "destinations", "Piece"]

VALUE_TYPES = (int, float, str, bool, type(None))


# -- state dicts -------------------------------------------------------------------------------


def flatten(state_dict: Any, prefix: str = "") -> dict[str, tuple[Any, Any, Any]]:
    """Every leaf of a nested dict/list as `{dotted key: (leaf, container, key in it)}`, the
    way DCP flattens ("optim.state.0.weight.exp_avg"); the container lets `load` replace values."""
    out: dict[str, tuple[Any, Any, Any]] = {}
    items = state_dict.items() if isinstance(state_dict, dict) else enumerate(state_dict)
    for k, v in items:
        if not isinstance(k, (str, int)):
            raise TypeError(_("checkpoint: key {key} under {prefix} is not a str", key=repr(k),
                              prefix=repr(prefix)) if prefix else
                            _("checkpoint: key {key} under 'the root' is not a str", key=repr(k)))
        key = f"{prefix}{k}"
        if isinstance(v, (dict, list)) and len(v):
            sub = flatten(v, key + ".")
        elif isinstance(v, (torch.Tensor, Piece, dict, list) + VALUE_TYPES):
            sub = {key: (v, state_dict, k)}
        else:
            raise TypeError(_("checkpoint: {key} is a {kind}; a state dict holds tensors, Pieces, "
                              "JSON values and dicts/lists of them", key=repr(key),
                              kind=type(v).__name__))
        clash = out.keys() & sub.keys()
        if clash:
            raise ValueError(_("checkpoint: two entries flatten to the key {key}",
                               key=repr(clash.pop())))
        out.update(sub)
    return out


def is_tensor(leaf: Any) -> bool:
    return isinstance(leaf, (torch.Tensor, Piece))


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def describe(leaf: Any) -> dict:
    """What this rank holds under one key, as plain JSON."""
    if isinstance(leaf, Piece):
        return {"kind": "piece", "dtype": dtype_name(leaf.tensor.dtype),
                "shape": list(leaf.shape), "offset": leaf.offset, "numel": leaf.tensor.numel()}
    if isinstance(leaf, torch.Tensor):
        return {"kind": "tensor", "dtype": dtype_name(leaf.dtype), "shape": list(leaf.shape),
                "offset": 0, "numel": leaf.numel()}
    return {"kind": "value", "value": leaf}


def flat(leaf: Any) -> torch.Tensor:
    """A leaf's values as one contiguous row (a copy only when they are not contiguous)."""
    return (leaf.tensor if isinstance(leaf, Piece) else leaf).detach().reshape(-1).contiguous()


# -- every rank hears of every rank --------------------------------------------------------------


def rank_and_size(dist: Any, group: Any) -> tuple[Any, int, int]:
    """(dist or None for one process, this rank in the group, the group's size)."""
    dist = default_dist(dist)
    if not dist.is_initialized():
        return None, 0, 1
    return dist, dist.get_rank(group), dist.get_world_size(group)


def all_gather_json(obj: Any, dist: Any, group: Any, world: int) -> list[Any]:
    """Every rank's `obj`, in rank order, as JSON bytes in uint8 tensors (never pickled)."""
    if dist is None:
        return [obj]
    data, device = json.dumps(obj).encode(), comm_device(dist, group)  # CUDA under NCCL
    size = torch.tensor([len(data)], dtype=torch.int64, device=device)
    sizes = [torch.zeros(1, dtype=torch.int64, device=device) for _ in range(world)]
    dist.all_gather(sizes, size, group=group)
    longest = int(max(s.item() for s in sizes))
    mine = torch.zeros(longest, dtype=torch.uint8, device=device)
    if data:
        mine[:len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    everyone = [torch.empty(longest, dtype=torch.uint8, device=device) for _ in range(world)]
    dist.all_gather(everyone, mine, group=group)
    return [json.loads(bytes(t[:int(s.item())].cpu().numpy())) for t, s in zip(everyone, sizes)]


def attempt(fn: Callable[..., Any], *args: Any) -> tuple[Any, str | None]:
    """(fn(*args), None), or (None, what went wrong) if it raised: a failure to tell the other
    ranks about instead of leaving them waiting."""
    try:
        return fn(*args), None
    except CheckpointError as exc:
        return None, str(exc)
    except Exception as exc:  # noqa: BLE001 - every rank must hear of it, not wait for it
        return None, f"{type(exc).__name__}: {exc}"


def agree(errors: list[str | None], what: str) -> None:
    """Raise one CheckpointError naming every rank whose entry in `errors` (all ranks' outcomes,
    in rank order, as `all_gather_json` returns them) is an error; nothing if none is."""
    failed = [_("rank {rank}: {message}", rank=r, message=e) for r, e in enumerate(errors) if e]
    if failed:
        raise CheckpointError(f"{what}: " + "; ".join(failed))


# -- saving ------------------------------------------------------------------------------------


def plan_writes(plans: list[dict[str, dict]]) -> tuple[dict[str, dict], dict[str, Any], list[list]]:
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
            raise ValueError(_("{key} is a {kinds} on others", key=repr(key),
                               kinds=_(" on some ranks and a ").join(sorted(kinds))))
        if kinds == {"value"}:
            differ = [r for r, h in held if h["value"] != held[0][1]["value"]]
            if differ:
                raise ValueError(_("{key} differs between rank {a} and rank {b}: key a rank's own "
                                   "state by its rank", key=repr(key), a=held[0][0], b=differ[0]))
            values[key] = held[0][1]["value"]
            continue
        r0, h0 = held[0]
        for r, h in held:
            if (h["dtype"], h["shape"]) != (h0["dtype"], h0["shape"]):
                raise ValueError(_("{key} is {a} on rank {ra} but {b} on rank {rb}", key=repr(key),
                                   a=f"{h0['dtype']}{h0['shape']}", ra=r0,
                                   b=f"{h['dtype']}{h['shape']}", rb=r))
        pieces: dict[tuple[int, int], int] = {}
        for r, h in held:
            span = (h["offset"], h["numel"])
            if span not in pieces or load[r] < load[pieces[span]]:
                pieces[span] = r  # replicated: the least loaded holder writes it
        numel = math.prod(h0["shape"])
        entries[key] = {"dtype": h0["dtype"], "shape": h0["shape"], "pieces": []}
        at = 0
        for (offset, n), r in sorted(pieces.items()):
            if offset != at or offset + n > numel:
                raise ValueError(_("{key}: its pieces overlap or leave elements [{at}, {offset}) "
                                   "of {numel} to no rank", key=repr(key), at=at, offset=offset,
                                   numel=numel))
            at = offset + n
            name = key if h0["kind"] == "tensor" else f"{key}@{offset}"
            entries[key]["pieces"].append({"rank": r, "name": name, "offset": offset,
                                           "numel": n})
            writes[r].append((key, name))
            load[r] += n
        if at != numel:
            raise ValueError(_("{key}: elements [{at}, {numel}) are held by no rank", key=repr(key),
                               at=at, numel=numel))
    return entries, values, writes


class SavePlan:
    """What one save writes, the same on every rank: `shard(rank)` names a rank's file,
    `tensors(rank)` is what this rank writes into it, `manifest(infos)` the manifest's text
    once every rank's file info is known, `remove_others(folder)` deletes an earlier save's
    files once this save's manifest is the one on disk."""

    def __init__(self, leaves: dict, plans: list[dict], world: int, token: str, folder: Path):
        entries, self.values, self.writes = plan_writes(plans)
        self.leaves, self.world, self.token, self.folder = leaves, world, token, folder
        for entry in entries.values():
            for piece in entry["pieces"]:
                piece["file"] = self.shard(piece.pop("rank"))
        self.entries = entries

    def shard(self, rank: int) -> str:
        return shard_name(rank, self.world, self.token)

    def tensors(self, rank: int) -> dict[str, torch.Tensor]:
        return {name: flat(self.leaves[key][0]) for key, name in self.writes[rank]}

    def manifest(self, infos: list[dict | None]) -> bytes:
        files = {self.shard(r): info for r, info in enumerate(infos) if info is not None}
        return json.dumps({"format": FORMAT, "world_size": self.world, "files": files,
                           "tensors": self.entries, "values": self.values}, indent=1).encode()

    def remove_others(self, folder: Path) -> None:
        """Delete what an earlier save left in `folder`, if the manifest there is this save's
        (else nothing: the files the manifest on disk names are still needed)."""
        try:
            mine = json.loads((folder / MANIFEST).read_bytes())["files"]
        except (OSError, ValueError, KeyError, TypeError):
            return
        if not mine or any(self.token not in name for name in mine):
            return
        for old in folder.iterdir():
            if old.name != MANIFEST and old.name not in mine:
                old.unlink(missing_ok=True)


def plan_save(leaves: dict, folder: Path, dist: Any, group: Any, world: int) -> SavePlan:
    """Every rank's holdings, all-gathered; the same plan on every rank (rank 0's random token
    names this save's files); the folder made. A plan no rank can carry out (pieces that leave
    elements to no rank) is a CheckpointError on every rank."""
    mine = {k: describe(leaf) for k, (leaf, _, _) in leaves.items()}
    plans = all_gather_json({"plan": mine, "token": secrets.token_hex(6)}, dist, group, world)
    try:
        plan = SavePlan(leaves, [p["plan"] for p in plans], world, plans[0]["token"], folder)
    except ValueError as exc:
        raise CheckpointError(_("save of {folder}: {exc}", folder=folder, exc=exc)) from None
    folder.mkdir(parents=True, exist_ok=True)
    return plan


# -- loading -----------------------------------------------------------------------------------


class Targets(list):
    """`destinations`' answer: (key, flat, start, pieces) per tensor of the state dict: fill
    elements [start, start + len(flat)) of the saved tensor into `flat`, from `pieces` (the
    manifest's, each with its file, name in it, offset and numel). `commit()`, once every
    read is done, writes back the targets that were not contiguous and replaces the values."""

    def __init__(self, leaves: dict, manifest: dict):
        super().__init__()
        self.leaves, self.manifest, self.copied = leaves, manifest, []

    def commit(self) -> None:
        with torch.no_grad():
            for target, flat_copy in self.copied:
                target.copy_(flat_copy.view_as(target))
        for key, (leaf, container, k) in self.leaves.items():
            if not is_tensor(leaf):
                container[k] = self.manifest["values"][key]


def destinations(leaves: dict, manifest: dict, folder: Path | str = "") -> Targets:
    """Where each tensor of a state dict (`flatten`'s leaves) is filled from, after checking
    that the checkpoint has every key with the same dtype and shape (a CheckpointError
    naming the first that differs). Nothing is changed yet."""
    missing = [k for k, (leaf, _, _) in leaves.items()
               if k not in manifest["tensors" if is_tensor(leaf) else "values"]]
    if missing:
        more = _(" and {n} more", n=len(missing) - 5) if len(missing) > 5 else ""
        raise CheckpointError(_("{folder}: no {keys}{more}", folder=folder,
                                keys=", ".join(map(repr, missing[:5])), more=more))
    targets = Targets(leaves, manifest)
    for key, (leaf, _container, _k) in leaves.items():
        if not is_tensor(leaf):
            continue
        entry = manifest["tensors"][key]
        tensor, start, shape = ((leaf.tensor, leaf.offset, list(leaf.shape))
                                if isinstance(leaf, Piece) else (leaf, 0, list(leaf.shape)))
        if (dtype_name(tensor.dtype), shape) != (entry["dtype"], entry["shape"]):
            raise CheckpointError(_("{key}: the checkpoint holds {held}, the state dict asks for "
                                    "{asked}", key=repr(key),
                                    held=f"{entry['dtype']}{entry['shape']}",
                                    asked=f"{dtype_name(tensor.dtype)}{shape}"))
        if tensor.is_contiguous():
            row = tensor.detach().view(-1)
        else:
            row = tensor.detach().reshape(-1).clone()
            targets.copied.append((tensor.detach(), row))
        targets.append((key, row, start, entry["pieces"]))
    return targets
