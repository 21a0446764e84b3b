"""Random streams per parallel group: an RNG tracker for CPU generators, shaped like
Megatron-LM's `get_cuda_rng_tracker().fork()`.

Dropout draws from torch's default generator. In a tensor-parallel group some computation is
replicated (every rank holds the same activation: its masks must be the same on every rank of
the group, or the replicas drift apart) and some is sharded (each rank holds a different slice:
its masks must differ, or every slice is dropped in the same places). Across data-parallel
replicas, which see different samples, the masks must differ too. One seed everywhere gives
every rank of every group the same masks: the bug that cost a public run its first trillion
tokens.

A tracker holds named generator states. `with tracker.fork(name):` swaps torch's default CPU
generator for the named stream, so that `F.dropout` inside the block draws from it, then saves
the advanced stream and puts the default generator back as it was::

    tracker = seed_streams(1234, tp_rank=tp, dp_rank=dp, pp_rank=pp)
    with tracker.fork(SHARDED):      # a column-parallel activation: one stream per TP rank
        h = F.dropout(h, p)
    with tracker.fork(REPLICATED):   # after the row-parallel all-reduce: one stream per group
        y = F.dropout(y, p)

`get_states()` / `set_states()` save and restore every stream (lesson 09b's training state
saves them with the rank's other generators). The streams' seeds, from the base seed and the
rank's coordinates (`stream_seeds`), are lesson 12a's exercise (`course_lib.rng_seeds`).
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch

from course_lib.i18n import _
from course_lib.rng_seeds import REPLICATED, SHARDED, stream_seed, stream_seeds

__all__ = ["REPLICATED", "SHARDED", "RNGStatesTracker", "get_rng_tracker", "stream_seed",
           "stream_seeds", "seed_streams"]


class RNGStatesTracker:
    """Named CPU generator states; `fork(name)` runs a block on one of them."""

    def __init__(self) -> None:
        self._states: dict[str, torch.Tensor] = {}
        self._seeds: dict[str, int] = {}

    def reset(self) -> None:
        """Forget every stream."""
        self._states.clear()
        self._seeds.clear()

    @property
    def names(self) -> list[str]:
        return list(self._states)

    def __contains__(self, name: str) -> bool:
        return name in self._states

    def add(self, name: str, seed: int) -> None:
        """A new stream `name` seeded with `seed`; two streams may not share a name or a seed."""
        if name in self._states:
            raise ValueError(_("RNG stream {name} already exists", name=repr(name)))
        if seed in self._seeds.values():
            raise ValueError(_("seed {seed} is already used by another RNG stream", seed=seed))
        self._states[name] = torch.Generator().manual_seed(seed).get_state()
        self._seeds[name] = seed

    def get_states(self) -> dict[str, torch.Tensor]:
        """A copy of every stream's state, by name."""
        return {name: state.clone() for name, state in self._states.items()}

    def set_states(self, states: dict[str, torch.Tensor]) -> None:
        """Replace the streams by `states` (from `get_states`)."""
        self._states = {name: state.clone() for name, state in states.items()}

    @contextlib.contextmanager
    def fork(self, name: str = SHARDED) -> Iterator[None]:
        """Run the block with torch's default CPU generator set to the stream `name`; afterwards
        the stream keeps what the block drew and the default generator is as it was before."""
        if name not in self._states:
            raise KeyError(_("RNG stream {name} was never added (known: {known}); seed the "
                             "tracker first (seed_streams)", name=repr(name), known=self.names))
        outside = torch.get_rng_state()
        torch.set_rng_state(self._states[name])
        try:
            yield
        finally:
            self._states[name] = torch.get_rng_state()
            torch.set_rng_state(outside)


_TRACKER = RNGStatesTracker()


def get_rng_tracker() -> RNGStatesTracker:
    """The process's tracker (what layers use when they are given none)."""
    return _TRACKER


def seed_streams(seed: int, *, tp_rank: int = 0, dp_rank: int = 0, pp_rank: int = 0,
                 tracker: RNGStatesTracker | None = None) -> RNGStatesTracker:
    """Reset `tracker` (default: the process's) to two streams: `REPLICATED`, the same on every
    rank of a TP group, and `SHARDED`, one per TP rank; both differ across DP replicas and PP
    stages. Returns the tracker."""
    tracker = _TRACKER if tracker is None else tracker
    tracker.reset()
    for name, stream in stream_seeds(seed, tp_rank, dp_rank, pp_rank).items():
        tracker.add(name, stream)
    return tracker
