"""What a sharded model holds, for lessons 08a and 08b (`course_lib.zero_machinery` gathers these
names with the rest of what the lessons use but do not build):

- `units_of`, `storage_bytes`, `state_bytes`: what a rank holds, counted from the tensors'
  storages;
- `Piece`, `full_state_dict`, `sharded_state_dict`: the two views of a sharded model's state.

Nothing here imports `course_lib.zero` or `course_lib.fsdp` (they import this, through
`course_lib.zero_machinery`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable

import torch
from torch import nn

from course_lib.sharding import all_gather_params

__all__ = ["units_of", "storage_bytes", "state_bytes", "Piece", "full_state_dict",
           "sharded_state_dict"]


# --- counting what a rank holds ----------------------------------------------------------------


def units_of(module: nn.Module) -> list[Any]:
    """The fully_shard units inside `module`, outermost first."""
    return [m._zero_unit for m in module.modules() if hasattr(m, "_zero_unit")]


def storage_bytes(tensors: Iterable[torch.Tensor | None]) -> int:
    """Bytes of the distinct storages behind `tensors` (views of one buffer count once; a
    DTensor, as torch's FSDP2 holds, by its local shard)."""
    seen: dict[int, int] = {}
    for t in tensors:
        if t is not None:
            t = t.to_local() if hasattr(t, "to_local") else t
            s = t.untyped_storage()
            if s.nbytes():
                seen[s.data_ptr()] = s.nbytes()
    return sum(seen.values())


def state_bytes(module: nn.Module, optimizer: torch.optim.Optimizer | None = None
                ) -> dict[str, int]:
    """Bytes of parameters, gradients and optimizer state this rank holds, counted from the
    tensors' storages (scalar step counters left out: a few bytes per tensor)."""
    params = list(module.parameters())
    units = units_of(module)
    fulls = [f.full for u in units for f in u.flats]
    grads = [p.grad for p in params] + [f.full.grad for u in units for f in u.flats]
    grads += [g for u in units[:1] for *_, g in u.schedule.pending]
    local = getattr(optimizer, "optim", optimizer)  # a ZeroRedundancyOptimizer's own optimizer
    for b in getattr(optimizer, "buckets", ()):
        grads += [b.shard.grad, b.staging, b.reduced]
    state = ([v for s in local.state.values() for k, v in s.items()
              if isinstance(v, torch.Tensor) and k != "step"] if local is not None else [])
    return {"parameters": storage_bytes(params + fulls), "gradients": storage_bytes(grads),
            "optimizer state": storage_bytes(state)}


# --- state dicts of a sharded model ------------------------------------------------------------


@dataclass
class Piece:
    """The part of a parameter one rank holds: elements [offset, offset + numel) of the
    parameter flattened, out of a whole of `shape`."""

    tensor: torch.Tensor
    offset: int
    shape: torch.Size


def _entry_names(module: nn.Module) -> dict[int, str]:
    return {id(m): (prefix + "." if prefix else "") for prefix, m in module.named_modules()}


def _plain(module: nn.Module, copy: bool) -> dict[str, torch.Tensor]:
    """Parameters no unit shards and buffers, by name, as module.state_dict() has them
    (copies, or views that write through to the module)."""
    out = {n: p.detach() for n, p in module.named_parameters()
           if not getattr(p, "_zero_shard", False)}
    out.update({n: b.detach() for n, b in module.named_buffers()})
    return {n: t.clone() for n, t in out.items()} if copy else out


def full_state_dict(module: nn.Module, *, rank0_only: bool = True) -> dict[str, torch.Tensor]:
    """The unsharded model's state dict, gathered (every rank takes part; with `rank0_only`
    the group's rank 0 gets it, the others an empty dict), as torch's
    `StateDictOptions(full_state_dict=True, cpu_offload=True)`."""
    prefix = _entry_names(module)
    out: dict[str, torch.Tensor] = {}
    units = units_of(module)
    for unit in units:
        for flat in unit.flats:
            full = torch.empty(flat.layout.padded_numel, dtype=flat.layout.dtype,
                               device=flat.shard.device)
            all_gather_params(full, flat.shard.detach(), flat.layout, dist=unit.dist,
                              group=unit.group)
            views = flat.layout.views(full)
            for sub, name, i in flat.entries:
                out[prefix[id(sub)] + name] = views[i].to("cpu", copy=True)  # cpu_offload
    out.update(_plain(module, copy=True))
    rank = units[0].rank if units else 0
    return out if (rank == 0 or not rank0_only) else {}


def sharded_state_dict(module: nn.Module) -> dict[str, Any]:
    """This rank's pieces of every sharded parameter (a parameter this rank holds nothing of
    is left out), plus the unsharded parameters and buffers: what each rank checkpoints.
    Views, as torch's sharded state dicts are: loading into them loads the model."""
    prefix = _entry_names(module)
    out: dict[str, Any] = {}
    for unit in units_of(module):
        for flat in unit.flats:
            shard = flat.shard.detach()
            for i, start, stop, at in flat.layout.pieces(unit.rank):
                for sub, name, j in flat.entries:
                    if j == i:
                        out[prefix[id(sub)] + name] = Piece(shard[at:at + stop - start],
                                                            start, flat.layout.shapes[i])
    out.update(_plain(module, copy=False))
    return out
