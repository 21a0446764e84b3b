"""What a training run needs to stop anywhere and resume exactly, for lesson 09b
(`course_lib.recovery` re-exports all of it): the state of the model and optimizer by parameter
name (plain, DDP, ZeRO or FSDP, loadable on another number of ranks), every RNG of a rank, the
sampler's place in the epoch, and `run_with_recovery`, which reruns a function on a cluster
after an engine dies.

Shaped like `torch.distributed.checkpoint.state_dict`: `get_state_dict(model, optimizer)`
returns views, so loading a checkpoint into them loads the model and optimizer in place;
`set_state_dict` puts back what cannot be a view (the optimizer's hyperparameters).
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Sized

import numpy as np
import torch
from torch import nn

from course_lib.data import DistributedSampler
from course_lib.i18n import _
from course_lib.rng import get_rng_tracker
from course_lib.zero import Piece, ZeroRedundancyOptimizer, _units, sharded_state_dict
from course_lib.cluster import EngineDied


def _unwrap(model: nn.Module) -> nn.Module:
    """The module a DDP wrapper (ours or torch's) holds, so names carry no "module." prefix."""
    inner = getattr(model, "module", None)
    return inner if isinstance(inner, nn.Module) else model


def _owners(model: nn.Module, optimizer: torch.optim.Optimizer
            ) -> dict[int, list[tuple[str, torch.Size, int, int, int]]]:
    """For each tensor the (inner) optimizer steps: the parameters it holds part of, as
    (name, full shape, start, stop in the flattened parameter, position in the tensor)."""
    params = dict(model.named_parameters())
    names = {id(p): n for n, p in params.items()}
    out: dict[int, list] = {}
    for unit in _units(model):
        prefix = {id(m): (p + "." if p else "") for p, m in model.named_modules()}
        for flat in unit.flats:
            first = {}
            for sub, attr, i in flat.entries:
                first.setdefault(i, prefix[id(sub)] + attr)  # a tied parameter: its first name
            out[id(flat.shard)] = [(first[i], flat.layout.shapes[i], start, stop, at)
                                   for i, start, stop, at in flat.layout.pieces(unit.rank)]
    if isinstance(optimizer, ZeroRedundancyOptimizer):
        for b in optimizer.buckets:
            out[id(b.shard)] = [(names[id(b.params[i])], b.layout.shapes[i], start, stop, at)
                                for i, start, stop, at in b.layout.pieces(optimizer.rank)]
    for name, p in params.items():
        out.setdefault(id(p), [(name, p.shape, 0, p.numel(), 0)])
    return out


def _inner(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    return optimizer.optim if isinstance(optimizer, ZeroRedundancyOptimizer) else optimizer


@torch.no_grad()
def init_optimizer_state(optimizer: torch.optim.Optimizer) -> None:
    """Create the state an optimizer creates on its first step, without changing a parameter
    (a step with zero gradients at learning rate 0, as torch's DCP does), so there is
    something to load into. Frozen parameters get none, as in training; a trainable one that
    never had a gradient would get state its checkpoint lacks, and the load names it."""
    inner = _inner(optimizer)
    params = [p for g in inner.param_groups for p in g["params"]
              if p.requires_grad and p not in inner.state]
    if not params:
        return
    lrs = [g["lr"] for g in inner.param_groups]
    for p in params:
        p.grad = torch.zeros_like(p)
    try:
        for g in inner.param_groups:
            g["lr"] = 0.0
        inner.step()
    finally:
        for g, lr in zip(inner.param_groups, lrs):
            g["lr"] = lr
        for p in params:
            p.grad = None


def get_state_dict(model: nn.Module, optimizer: torch.optim.Optimizer | None = None, *,
                   init_state: bool = False) -> tuple[dict, dict]:
    """(model state, optimizer state), keyed by parameter name whatever the sharding: tensors
    where this rank holds a whole parameter, `Piece`s where it holds part (ZeRO, FSDP).
    Views: loading into them loads the model and optimizer. `init_state` first creates the
    optimizer's state if it has none yet (for loading into a fresh optimizer)."""
    model = _unwrap(model)
    model_sd = sharded_state_dict(model) if _units(model) else model.state_dict()
    if optimizer is None:
        return model_sd, {}
    if init_state:
        init_optimizer_state(optimizer)
    owners, inner = _owners(model, optimizer), _inner(optimizer)
    state: dict[str, dict] = {}
    for p in (p for g in inner.param_groups for p in g["params"] if p in inner.state):
        for name, shape, start, stop, at in owners[id(p)]:
            entry = state.setdefault(name, {})
            for key, v in inner.state[p].items():
                if not isinstance(v, torch.Tensor):
                    entry[key] = v
                elif v.shape != p.shape:  # a per-parameter scalar such as Adam's step
                    entry[key] = v
                elif (start, stop, tuple(p.shape)) == (0, shape.numel(), tuple(shape)):
                    entry[key] = v
                else:
                    entry[key] = Piece(v.view(-1)[at:at + stop - start], start, shape)
    names = {id(p): n for n, p in model.named_parameters()}
    groups = [{**{k: v for k, v in g.items() if k != "params"},
               "params": [names[id(p)] for p in g["params"]]} for g in optimizer.param_groups]
    for g in groups:
        for k, v in g.items():
            if isinstance(v, tuple):
                g[k] = list(v)  # betas: JSON has lists; set_state_dict gives tuples back
    return model_sd, {"state": state, "param_groups": groups}


def set_state_dict(model: nn.Module, optimizer: torch.optim.Optimizer | None,
                   model_state: dict, optim_state: dict) -> None:
    """After a load into `get_state_dict`'s views: put back the optimizer's hyperparameters
    (learning rate and the like, which are values, not tensors)."""
    del model, model_state  # loaded in place through the views
    if optimizer is None or not optim_state:
        return
    if len(optim_state["param_groups"]) != len(optimizer.param_groups):
        raise ValueError(_("the checkpoint has {saved} parameter groups, the optimizer {own}",
                           saved=len(optim_state["param_groups"]),
                           own=len(optimizer.param_groups)))
    for g, saved in zip(optimizer.param_groups, optim_state["param_groups"]):
        for k, v in saved.items():
            if k != "params":
                g[k] = tuple(v) if isinstance(g.get(k), tuple) else v


def rng_state() -> dict:
    """Every random stream a run may draw from on this rank: torch's, Python's and numpy's,
    the RNG tracker's streams (`course_lib.rng`, when seeded) and each CUDA device's (when
    CUDA is available)."""
    version, words, gauss = random.getstate()
    np_kind, np_keys, np_pos, np_has_gauss, np_gauss = np.random.get_state()
    state = {"torch": torch.get_rng_state(),
             "python": {"version": version, "words": torch.tensor(words, dtype=torch.int64),
                        "gauss": gauss},
             "numpy": {"kind": np_kind, "keys": torch.from_numpy(np_keys.astype(np.int64)),
                       "pos": int(np_pos), "has_gauss": int(np_has_gauss),
                       "gauss": float(np_gauss)}}
    tracker = get_rng_tracker().get_states()
    if tracker:
        state["tracker"] = tracker
    if torch.cuda.is_available():
        state["cuda"] = {str(i): s for i, s in enumerate(torch.cuda.get_rng_state_all())}
    return state


def set_rng_state(state: dict) -> None:
    """Restore what `rng_state` captured."""
    torch.set_rng_state(state["torch"])
    py = state["python"]
    random.setstate((py["version"], tuple(py["words"].tolist()), py["gauss"]))
    n = state["numpy"]
    np.random.set_state((n["kind"], n["keys"].numpy().astype(np.uint32), n["pos"],
                         n["has_gauss"], n["gauss"]))
    if "tracker" in state:
        get_rng_tracker().set_states(state["tracker"])
    if "cuda" in state and torch.cuda.is_available():
        cuda = state["cuda"]
        torch.cuda.set_rng_state_all([cuda[str(i)] for i in range(len(cuda))])


class ResumableSampler(DistributedSampler):
    """Lesson 03's sampler, able to start mid-epoch: `position` counts the samples of the
    epoch's global order that every rank together has consumed. Resumed on any number of ranks,
    each yields its share of the rest, so the global sample order does not change."""

    def __init__(self, dataset: Sized, num_replicas: int | None = None,
                 rank: int | None = None, shuffle: bool = True, seed: int = 0,
                 drop_last: bool = False, **kwargs: Any) -> None:
        super().__init__(dataset, num_replicas, rank, shuffle, seed, drop_last, **kwargs)
        self.position = 0

    def __iter__(self) -> Iterator[int]:
        if self.position % self.num_replicas:
            raise ValueError(_("ResumableSampler: position {position} is not a multiple of the "
                               "{ranks} ranks (resume at a step boundary)",
                               position=self.position, ranks=self.num_replicas))
        return iter(list(super().__iter__())[self.position // self.num_replicas:])

    def __len__(self) -> int:
        return max(0, self.num_samples - self.position // self.num_replicas)

    def set_epoch(self, epoch: int) -> None:
        super().set_epoch(epoch)
        self.position = 0

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "position": self.position}

    def load_state_dict(self, state: dict) -> None:
        self.epoch, self.position = int(state["epoch"]), int(state["position"])


@dataclass
class Failure:
    """One failure `run_with_recovery` survived: which ranks died and why, how long the run
    had gone when it failed, how long the restart or shrink took, the world size after."""

    dead: dict[int, str]
    failed_after_s: float
    recovered_in_s: float
    world_size: int


def run_with_recovery(cluster: Any, fn: Callable[..., Any], *args: Any,
                      on_failure: str = "restart", max_failures: int = 3,
                      **kwargs: Any) -> tuple[list[Any], list[Failure]]:
    """Run `fn(*args, **kwargs)` on every rank of `cluster` until it finishes. When an engine
    dies, restart every engine (on_failure="restart", as torchrun's --max-restarts does) or go
    on with the survivors (on_failure="shrink", elastic), then run `fn` again: it must resume
    from its newest checkpoint. Returns the ranks' results and the failures survived."""
    if on_failure not in ("restart", "shrink"):
        raise ValueError(_('on_failure must be "restart" or "shrink", got {on_failure}',
                           on_failure=repr(on_failure)))
    failures: list[Failure] = []
    while True:
        started = time.monotonic()
        try:
            return cluster.run(fn, *args, **kwargs), failures
        except EngineDied as exc:
            if len(failures) >= max_failures:
                raise
            noticed = time.monotonic()
            cluster.shrink() if on_failure == "shrink" else cluster.restart()
            failures.append(Failure(dict(exc.failures), noticed - started,
                                    time.monotonic() - noticed, cluster.world_size))
