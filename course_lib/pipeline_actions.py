"""Pipeline schedules as action lists per stage, with model chunks (lesson 07d's given part).

A schedule gives each stage (rank) its list of compute actions, as lesson 07c's orders do: F
(forward), B (backward) and, in the zero-bubble schedules, W. `B` always computes the gradient
of the chunk's input, the one the previous stage waits for; where the schedule has a `W` of the
same micro-batch and chunk, `B` leaves the weight gradients to it, otherwise `B` is the whole
backward (lesson 07c's). A stage may hold several model chunks ("virtual stages"): chunk c of
`n_chunks` runs on stage `placement[c]`, and micro-batch j flows through chunks 0, 1, ... in
order.

Here: `Action`, `Schedule`, the placements, and the orders lesson 07d does not ask a learner to
write: GPipe, 1F1B, ZB-H1 (zero bubble at 1F1B's memory) and ZBV (zero bubble in a V: two
chunks per stage, stage s holding chunks s and 2p-1-s), plus `interleave`, the 1F1B pattern over
any two sequences. The interleaved order and the backward split are lesson 07d's
(`course_lib.pipeline_schedules`); the messages are `course_lib.pipeline_comms`'s, the checker
`course_lib.pipeline_check`'s and `course_lib.pipeline_nccl`'s, the executor
`course_lib.pipeline_multi`'s.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterable, NamedTuple, Sequence

import torch
from torch import nn

KINDS = ("F", "B", "W")


class Action(NamedTuple):
    """One compute action: `kind` F, B or W of micro-batch `mb` in model chunk `chunk`."""
    kind: str
    mb: int
    chunk: int = 0

    def __str__(self) -> str:
        return f"{self.kind}{self.mb}@c{self.chunk}"


@dataclass(frozen=True)
class Schedule:
    """Every stage's action list, and where each model chunk runs (`placement[chunk]`)."""
    name: str
    n_microbatches: int
    placement: tuple[int, ...]
    stages: tuple[tuple[Action, ...], ...]

    @property
    def n_stages(self) -> int:
        """p: the number of ranks."""
        return len(self.stages)

    @property
    def n_chunks(self) -> int:
        """The number of model chunks (virtual stages), v * p."""
        return len(self.placement)

    @property
    def chunks_per_stage(self) -> int:
        """v: model chunks per stage."""
        return self.n_chunks // self.n_stages

    def chunks_of(self, stage: int) -> list[int]:
        """The chunks stage `stage` runs, in model order."""
        return [c for c, s in enumerate(self.placement) if s == stage]

    def split_backward(self, mb: int, chunk: int) -> bool:
        """Whether B of (mb, chunk) leaves the weight gradients to a W action."""
        return Action("W", mb, chunk) in self.stages[self.placement[chunk]]

    def __str__(self) -> str:
        rows = [f"stage {s}: " + " ".join(map(str, acts)) for s, acts in enumerate(self.stages)]
        return f"{self.name} (m={self.n_microbatches}):\n" + "\n".join(rows)


# -- placements ------------------------------------------------------------------------------

def looped_placement(p: int, v: int = 1) -> tuple[int, ...]:
    """Chunk c on stage c % p: v loops over the ranks (interleaved 1F1B)."""
    return tuple(c % p for c in range(p * v))


def v_placement(p: int) -> tuple[int, ...]:
    """Chunks 0..p-1 down the ranks, p..2p-1 back up: stage s holds s and 2p-1-s."""
    return tuple(c if c < p else 2 * p - 1 - c for c in range(2 * p))


def from_orders(name: str, m: int, placement: Sequence[int],
                order_of: Callable[[int, int, int], Iterable]) -> Schedule:
    """A Schedule from a per-stage order function `order_of(m, p, stage)`; lesson 07's
    (action, micro-batch) pairs get the stage's only chunk."""
    p = max(placement) + 1
    stages = []
    for s in range(p):
        own = [c for c, at in enumerate(placement) if at == s]
        stages.append(tuple(as_action(a, own[0]) for a in order_of(m, p, s)))
    return Schedule(name, m, tuple(placement), tuple(stages))


def as_action(item: Sequence, chunk: int = 0) -> Action:
    """An Action from an Action, or from lesson 07's ("F", mb) pair on chunk `chunk`."""
    if isinstance(item, Action):
        return item
    kind, mb, *rest = item
    return Action(str(kind), int(mb), int(rest[0]) if rest else chunk)


# -- GPipe and 1F1B (lesson 07's orders, with chunks) ------------------------------------------

def gpipe_order(n_microbatches: int, num_stages: int, stage_index: int) -> list[Action]:
    """GPipe: every forward, then every backward, in micro-batch order."""
    m, c = n_microbatches, stage_index
    return [Action("F", j, c) for j in range(m)] + [Action("B", j, c) for j in range(m)]


def one_f_one_b_order(n_microbatches: int, num_stages: int, stage_index: int) -> list[Action]:
    """1F1B: p-1-s forwards to warm up, then one forward and one backward, then the drain."""
    m, c = n_microbatches, stage_index
    warmup = min(num_stages - 1 - stage_index, m)
    actions = [Action("F", j, c) for j in range(warmup)]
    for j in range(m - warmup):
        actions += [Action("F", warmup + j, c), Action("B", j, c)]
    return actions + [Action("B", j, c) for j in range(m - warmup, m)]


def gpipe(p: int, m: int) -> Schedule:
    """GPipe on p stages, m micro-batches."""
    return from_orders("GPipe", m, looped_placement(p), gpipe_order)


def one_f_one_b(p: int, m: int) -> Schedule:
    """1F1B (PipeDream-flush) on p stages, m micro-batches."""
    return from_orders("1F1B", m, looped_placement(p), one_f_one_b_order)


def interleave(forwards: list[Action], backwards: list[Action], warmup: int) -> list[Action]:
    """`warmup` forwards, then one forward and one backward while forwards last, then the
    remaining backwards: the 1F1B pattern over any two sequences."""
    actions = forwards[:warmup]
    for f, b in zip(forwards[warmup:], backwards):
        actions += [f, b]
    return actions + backwards[len(forwards) - warmup:]


# -- zero bubble: ZB-H1 ------------------------------------------------------------------------

def zb_h1_order(n_microbatches: int, num_stages: int, stage_index: int) -> list[Action]:
    """ZB-H1: 1F1B with each backward split into B and W, stage s running W j only after
    B j+s, so every stage keeps at most p micro-batches (1F1B's stage 0) and the delayed Ws
    fill the drain."""
    m, p, s = n_microbatches, num_stages, stage_index
    actions: list[Action] = []
    for a in one_f_one_b_order(m, p, s):
        actions.append(a)
        if a.kind == "B" and a.mb - s >= 0:
            actions.append(Action("W", a.mb - s, s))
    return actions + [Action("W", j, s) for j in range(max(m - s, 0), m)]


def zb_h1(p: int, m: int) -> Schedule:
    """ZB-H1 on p stages, m micro-batches."""
    return from_orders("ZB-H1", m, looped_placement(p), zb_h1_order)


# -- zero bubble in a V: ZBV -------------------------------------------------------------------

def zbv_order(n_microbatches: int, num_stages: int, stage_index: int) -> list[Action]:
    """ZBV (zero-bubble paper, section 6): stage s holds chunk s (down) and 2p-1-s (up).
    Warm up on the down chunk, then F-B-W of the up chunk, then a steady F-B-W of both, then
    the drain with the Ws last. Built for max(m, 2p-1) micro-batches, the extra ones dropped."""
    p, s = num_stages, stage_index
    m = max(n_microbatches, 2 * p - 1)
    down, up = s, 2 * p - 1 - s
    nxt = {("F", down): 0, ("F", up): 0, ("B", down): 0, ("B", up): 0,
           ("W", down): 0, ("W", up): 0}
    actions: list[Action] = []

    def run(kind: str, chunk: int) -> None:
        actions.append(Action(kind, nxt[kind, chunk], chunk))
        nxt[kind, chunk] += 1

    for _ in range(2 * (p - s) - 1):
        run("F", down)
    for _ in range(s):
        run("F", up), run("F", down)
    for _ in range(p - s):
        run("F", up), run("B", up), run("W", up)
    while nxt["F", up] < m:
        if nxt["F", down] < m:
            run("F", down)
        run("B", down), run("W", down), run("F", up), run("B", up), run("W", up)
    for _ in range(s):
        run("B", down), run("B", up)
    for _ in range(p - s):
        run("B", down), run("W", down)
    while nxt["W", up] < m:
        run("W", up)
    while nxt["W", down] < m:
        run("W", down)
    return [a for a in actions if a.mb < n_microbatches]


def zbv(p: int, m: int) -> Schedule:
    """ZBV on p stages (2p chunks in a V), m micro-batches."""
    return from_orders("ZBV", m, v_placement(p), zbv_order)


# -- the backward split: B (input gradient) now, W (weight gradients) later ---------------------

class Segment(NamedTuple):
    """One layer of a chunk as F ran it: its detached input, its output, and (after B) the
    gradient of that output, kept for W."""
    layer: nn.Module | None
    inp: torch.Tensor
    out: torch.Tensor
    grad_out: list


def has_weights(segment: Segment) -> bool:
    """Whether the segment's layer has parameters that need gradients."""
    return segment.layer is not None and any(q.requires_grad for q in segment.layer.parameters())


