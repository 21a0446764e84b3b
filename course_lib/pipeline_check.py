"""The schedule checker, part one: the action lists themselves and their timeline.

1. `validate`: every stage runs F and B of every micro-batch of each of its chunks once (and W
   at most once), only on its own chunks, B after its F and W after its B.
2. `simulate`: the timeline with given costs. An action starts when its stage is free and what
   it needs is done: F j@c needs F j@c-1, B j@c needs F j@c and B j@c+1, W j@c needs B j@c
   (a hand-off between ranks adds `latency`). If no stage can move, the schedule deadlocks:
   the error names the waiting action and the one it waits for (a stage may wait on itself).

From the timeline: each stage's idle time and bubble (idle share of the step's span, lesson
07a's definition); from the order alone: each stage's peak of stored activations. The closed
forms each schedule's simulation must reproduce are at the end (`idle_time`, `bubble`,
`peak_formula`). Part two, the messages under NCCL's order, is `course_lib.pipeline_nccl`.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass
from typing import NamedTuple, Sequence

from course_lib.i18n import _, ngettext
from course_lib.pipeline_actions import Action, Schedule


class ScheduleError(ValueError):
    """A schedule that cannot run; `pair` is the first two conflicting actions or operations,
    each as (stage, what)."""

    def __init__(self, message: str, pair: tuple[tuple[int, str], tuple[int, str]]):
        super().__init__(message)
        self.pair = pair


@dataclass(frozen=True)
class Costs:
    """Seconds (or units) of F, B (input gradient) and W (weight gradients) of one micro-batch
    through one whole stage; a chunk of a stage holding v costs 1/v. A backward with no W of its
    own costs B + W. `latency`: one hand-off between ranks."""
    F: float = 1.0
    B: float = 1.0
    W: float = 1.0
    latency: float = 0.0

    def of(self, action: Action, schedule: Schedule) -> float:
        """The time `action` takes in `schedule`."""
        t = {"F": self.F, "B": self.B, "W": self.W}[action.kind]
        if action.kind == "B" and not schedule.split_backward(action.mb, action.chunk):
            t += self.W
        return t / schedule.chunks_per_stage


class Timed(NamedTuple):
    """One action of the simulated (or measured) timeline."""
    stage: int
    action: Action
    start: float
    end: float


# -- 1. the lists themselves ---------------------------------------------------------------------

def validate(schedule: Schedule) -> None:
    """Raise ScheduleError for an action on the wrong stage, twice, missing, or out of order."""
    m = schedule.n_microbatches
    for s, actions in enumerate(schedule.stages):
        seen: dict[Action, int] = {}
        for i, a in enumerate(actions):
            if a.kind not in ("F", "B", "W") or not 0 <= a.mb < m or \
                    not 0 <= a.chunk < schedule.n_chunks:
                raise ScheduleError(_("stage {s}: {a} is not an action of this schedule", s=s,
                                      a=a), ((s, str(a)), (s, str(a))))
            if schedule.placement[a.chunk] != s:
                raise ScheduleError(_("stage {s} runs {a}, but chunk {chunk} is on stage "
                                      "{owner}", s=s, a=a, chunk=a.chunk,
                                      owner=schedule.placement[a.chunk]),
                                    ((s, str(a)), (schedule.placement[a.chunk], str(a))))
            if a in seen:
                raise ScheduleError(_("stage {s} runs {a} twice (positions {first} and {i})",
                                      s=s, a=a, first=seen[a], i=i), ((s, str(a)), (s, str(a))))
            seen[a] = i
            before = _must_precede(a)
            if before is not None and before not in seen and before in actions:
                raise ScheduleError(_("stage {s}: {a} comes before {before}, which it needs",
                                      s=s, a=a, before=before), ((s, str(a)), (s, str(before))))
        for c in schedule.chunks_of(s):
            for j in range(m):
                for kind in ("F", "B"):
                    if Action(kind, j, c) not in seen:
                        raise ScheduleError(_("stage {s} is missing {action}", s=s,
                                              action=Action(kind, j, c)),
                                            ((s, str(Action(kind, j, c))),) * 2)


def _must_precede(a: Action) -> Action | None:
    """The action of the same stage that `a` needs first: F before B, B before W."""
    return {"B": Action("F", a.mb, a.chunk), "W": Action("B", a.mb, a.chunk)}.get(a.kind)


# -- 2. the timeline -------------------------------------------------------------------------

def needs(action: Action, schedule: Schedule) -> list[Action]:
    """What `action` waits for: the activation of the chunk before, the gradient of the chunk
    after, and its own stage's F (for B) or B (for W)."""
    j, c, last = action.mb, action.chunk, schedule.n_chunks - 1
    if action.kind == "F":
        return [Action("F", j, c - 1)] if c > 0 else []
    if action.kind == "B":
        return [Action("F", j, c)] + ([Action("B", j, c + 1)] if c < last else [])
    return [Action("B", j, c)]


def simulate(schedule: Schedule, costs: Costs = Costs()) -> list[Timed]:
    """Each stage runs its list in order, each action as soon as its stage is free and what it
    needs is done (plus `latency` across ranks). Raises ScheduleError on a deadlock."""
    validate(schedule)
    done: dict[Action, float] = {}
    todo = [deque(actions) for actions in schedule.stages]
    free = [0.0] * schedule.n_stages
    timeline: list[Timed] = []
    while any(todo):
        moved = False
        for s, queue in enumerate(todo):
            while queue and all(d in done for d in needs(queue[0], schedule)):
                a = queue.popleft()
                start = max([free[s]] + [done[d] + _handoff(d, a, schedule, costs)
                                         for d in needs(a, schedule)])
                free[s] = done[a] = start + costs.of(a, schedule)
                timeline.append(Timed(s, a, start, free[s]))
                moved = True
        if not moved:
            raise deadlock(schedule, todo, done)
    return timeline


def _handoff(dep: Action, action: Action, schedule: Schedule, costs: Costs) -> float:
    """The latency between `dep` and `action` if they run on different ranks."""
    same = schedule.placement[dep.chunk] == schedule.placement[action.chunk]
    return 0.0 if same else costs.latency


def deadlock(schedule: Schedule, todo: Sequence[deque], done: dict) -> ScheduleError:
    """The error for stuck stages: follow who waits for whom from the first stuck stage until
    a stage comes back; name the first waiting action and the action it waits for."""
    waits: dict[int, tuple[Action, Action]] = {}
    for s, queue in enumerate(todo):
        if queue:
            waits[s] = (queue[0], next(d for d in needs(queue[0], schedule) if d not in done))
    path, s = [], min(waits)
    while s not in path:
        path.append(s)
        s = schedule.placement[waits[s][1].chunk]
    cycle = path[path.index(s):]
    first = cycle[0]
    action, dep = waits[first]
    if len(cycle) == 1:
        msg = _("deadlock: stage {first} waits on itself: its next action {action} needs "
                "{dep}, which stage {first} runs later", first=first, action=action, dep=dep)
    else:
        chain = " -> ".join(_("stage {t}: {action} waits for {dep}", t=t, action=waits[t][0],
                              dep=waits[t][1]) for t in cycle)
        via = ", ".join(str(t) for t in cycle[1:])
        msg = ngettext("deadlock: stage {first} waits on itself through stage {via}: {chain}, "
                       "which stage {first} runs later",
                       "deadlock: stage {first} waits on itself through stages {via}: {chain}, "
                       "which stage {first} runs later", len(cycle) - 1, first=first, via=via,
                       chain=chain)
    return ScheduleError(msg, ((first, str(action)), (schedule.placement[dep.chunk], str(dep))))


# -- memory and bubble -------------------------------------------------------------------------

def peak_activations(schedule: Schedule) -> list[float]:
    """Each stage's most micro-batches stored at once, in whole-stage units (a chunk is 1/v):
    stored from F until its W, or its B where B is the whole backward."""
    v, peaks = schedule.chunks_per_stage, []
    for actions in schedule.stages:
        live = peak = 0
        for a in actions:
            frees = a.kind == "W" or (a.kind == "B" and not schedule.split_backward(a.mb, a.chunk))
            live += 1 if a.kind == "F" else -1 if frees else 0
            peak = max(peak, live)
        peaks.append(peak / v)
    return peaks


def idle_times(timeline: Sequence[Timed], p: int) -> list[float]:
    """Each stage's idle time within the step's span (first start to last end, all stages)."""
    span = max(t.end for t in timeline) - min(t.start for t in timeline)
    busy = [0.0] * p
    for t in timeline:
        busy[t.stage] += t.end - t.start
    return [span - b for b in busy]


def bubble_fractions(timeline: Sequence[Timed], p: int) -> list[float]:
    """Each stage's idle share of the step (lesson 07's bubble)."""
    span = max(t.end for t in timeline) - min(t.start for t in timeline)
    return [idle / span for idle in idle_times(timeline, p)]




# -- the closed forms --------------------------------------------------------------------------
# Costs per micro-batch through a whole stage, hand-offs free; idle time per stage (every stage
# idles the same) within the step's span; bubble = idle / (m (F + B + W) + idle).
def idle_time(name: str, p: int, m: int, costs: Costs, v: int = 2) -> float | None:
    """Each stage's idle time in one step of schedule `name`; None where no closed form
    holds (ZBV with unequal costs: it is built for F = B = W)."""
    f, b, w = costs.F, costs.B, costs.W
    if name in ("gpipe", "1f1b"):
        return (p - 1) * (f + b + w)
    if name == "interleaved":
        return (p - 1 + (v - 1) * max(p - m, 0)) * (f + b + w) / v
    if name == "zb-h1":
        return (p - 1) * (f + b) - (min(m, p) - 1) * min(f, b, w)
    if name == "zbv" and f == b == w:
        return max(2 * (p - 1) - (m - 1), (p - 1) / 2) * f
    return None


def bubble(name: str, p: int, m: int, costs: Costs, v: int = 2) -> float | None:
    """The idle share of the step: idle / (m (F + B + W) + idle)."""
    idle = idle_time(name, p, m, costs, v)
    if idle is None:
        return None
    return idle / (m * (costs.F + costs.B + costs.W) + idle)


def first_group(p: int, m: int) -> int:
    """Interleaved 1F1B's first (largest) group of micro-batches."""
    rounds = max(m // p, 1)
    return math.ceil(m / rounds)


def peak_formula(name: str, p: int, m: int, v: int = 2) -> list[float] | None:
    """Each stage's most micro-batches stored at once (whole-stage units); None where no
    closed form is given (ZBV with m < 2p - 1)."""
    if name == "gpipe":
        return [float(m)] * p
    if name == "1f1b":
        return [float(min(p - s, m)) for s in range(p)]
    if name == "interleaved":
        g = first_group(p, m)
        return [min((v - 1) * g + 2 * (p - 1 - s) + 1, v * m) / v for s in range(p)]
    if name == "zb-h1":
        return [float(min(p, m))] * p
    if name == "zbv" and m >= 2 * p - 1:
        return [float(p)] * p
    return None
