"""What lessons 08a and 08b use but do not build: the bookkeeping around ZeRO's cores.

The learner writes the cores in the lessons (`course_lib.sharding`, `course_lib.zero`,
`course_lib.fsdp`); each lesson shows a short sketch of what lives here and links to it:

- `Layout`: a `FlatLayout` that also says which slices of which tensors a rank owns
  (`pieces`: what a sharded checkpoint writes, lesson 09).
- `Bucket` (ZeRO-1/2: parameters of one dtype in a padded flat buffer, this rank's shard of it,
  and its reduction in flight) and `ShardedOptimizer` (construction, the local optimizer on the
  shards, `no_sync`, state dicts), under `course_lib.zero.ZeroRedundancyOptimizer`.
- `UnitBase`: an FSDP unit's construction (the module's parameters moved into flat buffers,
  the modules' attributes replaced), under `course_lib.fsdp.FSDPUnit`.
- from `course_lib.sharded_state`, importable from here too: `storage_bytes`, `state_bytes`
  (what a rank holds, counted from the tensors' storages) and `Piece`, `full_state_dict`,
  `sharded_state_dict` (the two views of a sharded model's state).

Nothing here imports `course_lib.zero` or `course_lib.fsdp` (they import this).
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterable, Iterator

import torch
from torch import nn

from course_lib.backend import global_rank
from course_lib.data_parallel import broadcast_coalesced, make_buckets
from course_lib.gloo_sharded import sharded_dist
from course_lib.grad_bucket import check_same_tensors
from course_lib.i18n import _
from course_lib.sharded_state import (Piece, full_state_dict, sharded_state_dict, state_bytes,
                                      storage_bytes)
from course_lib.sharded_state import units_of  # noqa: F401 - course_lib.zero imports it from here
from course_lib.sharding import FlatLayout, reduce_scatter_grads

__all__ = ["Layout", "storage_bytes", "state_bytes", "group_rank", "add_grad", "tensors_in",
           "Bucket", "ShardedOptimizer", "UnitBase", "Piece", "full_state_dict",
           "sharded_state_dict"]


class Layout(FlatLayout):
    """A `FlatLayout` that also says which slices of which tensors each rank owns."""

    def pieces(self, rank: int) -> list[tuple[int, int, int, int]]:
        """(tensor index, start, stop, position in the shard) of each slice of a tensor that
        `rank` owns; start and stop count the tensor's elements in flattened order."""
        lo = rank * self.shard_numel
        hi = lo + self.shard_numel
        out = []
        for i, (o, n) in enumerate(zip(self.offsets, self.numels)):
            start, stop = max(lo, o), min(hi, o + n)
            if start < stop:
                out.append((i, start - o, stop - o, start - lo))
        return out


# --- small helpers -----------------------------------------------------------------------------


def group_rank(dist: Any, group: Any, who: str) -> tuple[int, int]:
    """(this process's rank in `group`, the group's size); an error if it is not a member."""
    rank = dist.get_rank(group)
    if rank < 0:
        raise ValueError(_("{who}: this process is not a member of the group it was given",
                           who=who))
    return rank, dist.get_world_size(group)


def add_grad(param: torch.Tensor, grad: torch.Tensor) -> None:
    """`param.grad` gains `grad`, as autograd accumulates (set when there is none yet)."""
    if param.grad is None:
        param.grad = grad
    else:
        param.grad += grad


def tensors_in(output: Any) -> list[torch.Tensor]:
    """The tensors of a module's output (a tensor, or lists, tuples and dicts of them)."""
    if isinstance(output, torch.Tensor):
        return [output]
    if isinstance(output, (list, tuple)):
        return [t for o in output for t in tensors_in(o)]
    if isinstance(output, dict):
        return [t for o in output.values() for t in tensors_in(o)]
    return []


# --- ZeRO-1 and ZeRO-2: the buckets and the optimizer around them ------------------------------


class Bucket:
    """Parameters of one dtype and one param group in one padded flat buffer; the
    parameters become views of it, and this rank's optimizer steps on its shard of it.

    During a backward: `ready` holds the ids of the parameters whose gradient is complete;
    `staging` is the bucket's padded flat gradient (stage 2 fills it from the hooks, stage 1
    flattens autograd's gradients into it at launch); `reduced` and `work` are the shard-sized
    average and its reduce-scatter in flight."""

    def __init__(self, params: list[torch.Tensor], world: int, rank: int, group_index: int):
        self.params, self.group_index = params, group_index
        self.index = {id(p): i for i, p in enumerate(params)}
        self.layout = Layout([p.shape for p in params], world, params[0].dtype)
        self.flat = self.layout.flatten([p.detach() for p in params])
        for p, view in zip(params, self.layout.views(self.flat)):
            p.data = view
        # A view: the optimizer's in-place update of the shard is the update of `flat`.
        self.shard = nn.Parameter(self.layout.chunks(self.flat)[rank])
        self.staging: torch.Tensor | None = None
        self.reduced: torch.Tensor | None = None
        self.work: Any = None
        self.ready: set[int] = set()

    def launch_reduce(self, dist: Any, group: Any) -> None:
        """Start averaging this bucket's flat gradient into a new shard-sized tensor."""
        if self.staging is None:  # stage 1: autograd's (accumulated) gradients, flattened now
            self.staging = self.layout.flatten([p.grad for p in self.params])
        self.reduced = torch.empty(self.layout.shard_numel, dtype=self.layout.dtype,
                                   device=self.flat.device)
        self.work = reduce_scatter_grads(self.staging, self.reduced, dist=dist, group=group,
                                         async_op=True)


class ShardedOptimizer(torch.optim.Optimizer):
    """The part of `ZeroRedundancyOptimizer` that no exercise needs: checking the input,
    broadcasting the group's first rank's parameters, laying every parameter group's trainable
    parameters out in buckets (lesson 04's `make_buckets`), building the local optimizer on
    this rank's shards, hooking each parameter, `no_sync`, and the state dicts.

    What a subclass's hooks read and write: `stage`, `dist`, `group`, `buckets`, `bucket_of`
    (parameter id -> its bucket), `next_bucket` (the first bucket not launched in this
    backward), `require_backward_grad_sync` (False inside `no_sync()`), `optim` (the local
    optimizer).

    A bucket is DDP's unit of reduction, and here also the unit of the step and of the
    all-gather after it: smaller than DDP's 25 MB by default, since an optimizer steps through
    several 8 MB shards faster than through one large one (`python -m course_lib.course.bench
    zero` shows the step)."""

    def __init__(self, params: Iterable[Any], optimizer_class: type, *, stage: int = 1,
                 bucket_cap_mb: float = 8.0, dist: Any = None, group: Any = None,
                 **optimizer_kwargs: Any) -> None:
        if stage not in (1, 2):
            raise ValueError(_("ZeroRedundancyOptimizer: stage must be 1 or 2, got {stage} "
                               "(stage 3 is fully_shard)", stage=repr(stage)))
        if not (isinstance(optimizer_class, type)
                and issubclass(optimizer_class, torch.optim.Optimizer)):
            raise TypeError(_("ZeroRedundancyOptimizer: optimizer_class must be a "
                              "torch.optim.Optimizer class, got {optimizer_class}",
                              optimizer_class=repr(optimizer_class)))
        self.dist, self.group, self.stage = sharded_dist(dist, group), group, stage
        self.rank, self.world_size = group_rank(self.dist, group, "ZeroRedundancyOptimizer")
        super().__init__(params, optimizer_kwargs)
        given = [p for g in self.param_groups for p in g["params"]]
        check_same_tensors(given, "ZeroRedundancyOptimizer", dist=self.dist, group=group,
                           extra=(stage,))
        # Every rank starts from the group's rank 0's values (frozen ones too), as with DDP.
        broadcast_coalesced([p.detach() for p in given], global_rank(self.dist, group, 0),
                            dist=self.dist, group=group)
        self.buckets: list[Bucket] = []
        local_groups = []
        for gi, g in enumerate(self.param_groups):
            mine = [p for p in g["params"] if p.requires_grad]
            for params in (make_buckets(mine, bucket_cap_mb, None) if mine else []):
                self.buckets.append(Bucket(params, self.world_size, self.rank, gi))
                local_groups.append({**self._hyper(g), "params": [self.buckets[-1].shard]})
        if not local_groups:
            raise ValueError(_("ZeroRedundancyOptimizer: no parameter requires grad"))
        self.optim = optimizer_class(local_groups)
        self.in_backward, self.next_bucket = False, 0
        self.require_backward_grad_sync = True
        self.bucket_of = {id(p): b for b in self.buckets for p in b.params}
        self._handles = [p.register_post_accumulate_grad_hook(self._hook)
                         for b in self.buckets for p in b.params]

    def _hook(self, p: torch.Tensor) -> None:
        """Autograd: `p`'s gradient is complete for this backward. The first hook of a
        backward queues `end_of_backward`, which autograd runs once backward is over."""
        if not self.in_backward:
            self.in_backward, self.next_bucket = True, 0
            torch.autograd.Variable._execution_engine.queue_callback(self.end_of_backward)
        if id(p) in self.bucket_of[id(p)].ready:
            raise RuntimeError(_("ZeroRedundancyOptimizer: a parameter got its gradient twice "
                                 "in one backward (reentrant backward is not supported)"))
        self.grad_ready(p)

    def end_of_backward(self) -> None:
        try:
            self.finish()
        finally:
            self.in_backward = False
            for b in self.buckets:
                b.ready.clear()

    def grad_ready(self, p: torch.Tensor) -> None:
        raise NotImplementedError

    def finish(self) -> None:
        raise NotImplementedError

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backward passes run inside this block only accumulate this rank's gradients (stage
        1 in `p.grad`, stage 2 in each bucket's flat gradient): no reduce-scatter until the
        first backward after it, as DDP's `no_sync` for gradient accumulation."""
        old, self.require_backward_grad_sync = self.require_backward_grad_sync, False
        try:
            yield
        finally:
            self.require_backward_grad_sync = old

    @staticmethod
    def _hyper(group: dict) -> dict:
        return {k: v for k, v in group.items() if k != "params"}

    def run_closure(self, closure: Callable[[], float] | None) -> float | None:
        """At the start of `step`: copy the param groups' hyperparameters (an lr scheduler's
        changes) to the local optimizer's, and return the closure's loss, if any."""
        for local, b in zip(self.optim.param_groups, self.buckets):
            local.update(self._hyper(self.param_groups[b.group_index]))
        if closure is None:
            return None
        with torch.enable_grad():
            return closure()

    def add_param_group(self, param_group: dict) -> None:
        if hasattr(self, "buckets"):
            raise NotImplementedError(_("ZeroRedundancyOptimizer: parameters cannot be added "
                                        "after construction (the shards are laid out then); "
                                        "build a new one with every parameter"))
        super().add_param_group(param_group)

    def zero_grad(self, set_to_none: bool = True) -> None:
        super().zero_grad(set_to_none)
        for b in self.buckets:
            b.shard.grad = None
            b.staging = None

    def state_dict(self) -> dict:
        """This rank's shard of the optimizer state, with where the shard lies in each bucket."""
        return {"local": self.optim.state_dict(), "rank": self.rank,
                "world_size": self.world_size,
                "buckets": [{"numel": b.layout.numel, "shard": [
                    self.rank * b.layout.shard_numel, (self.rank + 1) * b.layout.shard_numel]}
                    for b in self.buckets],
                "param_groups": [self._hyper(g) for g in self.param_groups]}

    def load_state_dict(self, state_dict: dict) -> None:
        mine = self.state_dict()
        if (state_dict.get("world_size"), state_dict.get("buckets"), state_dict.get("rank")) != (
                mine["world_size"], mine["buckets"], mine["rank"]):
            raise ValueError(_("ZeroRedundancyOptimizer.load_state_dict: the state was saved "
                               "with another layout (world size {saved_world}, rank "
                               "{saved_rank}); this is rank {rank} of {world_size}",
                               saved_world=state_dict.get("world_size"),
                               saved_rank=state_dict.get("rank"), rank=self.rank,
                               world_size=self.world_size))
        for g, saved in zip(self.param_groups, state_dict["param_groups"]):
            g.update(saved)
        self.optim.load_state_dict(state_dict["local"])


# --- ZeRO-3 (FSDP): a unit's construction ------------------------------------------------------


class UnitBase:
    """An FSDP unit's construction: every parameter of `module` that no inner unit holds goes
    into a flat buffer per (dtype, requires_grad), made by the subclass's `flat_class(entries,
    params, world, rank)`; the modules' attributes are deleted (the forward hook installs views
    of the gathered buffer in their place) and the shards registered as `module`'s parameters.
    The outermost unit's `schedule_class()` is shared by every unit inside it.

    Refused with a message: a parameter shared with another unit (wrap the common parent), and
    different shapes on different ranks. Tied weights inside one unit are gathered once."""

    flat_class: Callable[..., Any]
    schedule_class: Callable[[], Any]

    def __init__(self, module: nn.Module, reshard_after_forward: bool, dist: Any, group: Any):
        # its gathers and reductions are in flight while it computes
        self.dist = sharded_dist(dist, group, overlapped=True)
        self.module, self.group = module, group
        self.reshard_after_forward = reshard_after_forward
        self.rank, self.world_size = group_rank(self.dist, group, "fully_shard")
        inner = [m._zero_unit for m in module.modules()
                 if m is not module and isinstance(getattr(m, "_zero_unit", None), UnitBase)]
        owned = {id(p) for u in inner for p in u.managed}
        entries: dict[int, list[tuple[nn.Module, str]]] = {}
        params: dict[int, nn.Parameter] = {}
        for sub in module.modules():
            for name, p in sub._parameters.items():
                if p is None or getattr(p, "_zero_shard", False):
                    continue
                if id(p) in owned or getattr(p, "_zero_managed", False):
                    raise ValueError(_("fully_shard: parameter {name} of {module} is also used "
                                       "inside another fully_shard unit; shard the modules that "
                                       "share it together (wrap their common parent)",
                                       name=repr(name), module=type(sub).__name__))
                entries.setdefault(id(p), []).append((sub, name))
                params[id(p)] = p
        self.managed = list(params.values())
        for p in self.managed:  # a second unit must not shard a tied weight again, apart
            p._zero_managed = True
        check_same_tensors(self.managed, "fully_shard", dist=self.dist, group=group)
        broadcast_coalesced([p.detach() for p in self.managed], global_rank(self.dist, group, 0),
                            dist=self.dist, group=group)
        kinds: dict[tuple, list[nn.Parameter]] = {}
        for p in self.managed:
            kinds.setdefault((p.dtype, p.requires_grad), []).append(p)
        self.flats: list[Any] = []
        for same in kinds.values():
            index = {id(p): i for i, p in enumerate(same)}
            where = [(sub, name, index[id(p)]) for p in same for sub, name in entries[id(p)]]
            self.flats.append(self.flat_class(where, same, self.world_size, self.rank))
        for p in self.managed:
            for sub, name in entries[id(p)]:
                del sub._parameters[name]
        for i, flat in enumerate(self.flats):
            module.register_parameter(f"zero_flat_param_{i}", flat.shard)
        self.schedule = self.schedule_class()
        for u in inner:  # the outermost unit's schedule is the one every inner unit shares
            u.schedule = self.schedule
        self.schedule.units = [self, *inner]
        self.backward_started = False
        self._expected_params = self._own_parameters()

    def _own_parameters(self) -> set[int]:
        return {id(p) for p in self.module.parameters()}

    def check_parameters(self) -> None:
        if self._own_parameters() != self._expected_params:
            raise RuntimeError(_("fully_shard: the module's parameters changed after it was "
                                 "wrapped; add every parameter before calling fully_shard"))

    @property
    def is_root(self) -> bool:
        return self.schedule.units[0] is self
