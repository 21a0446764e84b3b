"""The schedule checker, part two: the messages under NCCL's order, and everything at once.

`check_nccl` runs the programs of sends and receives (`course_lib.pipeline_comms`) under NCCL's
rule for a pair of ranks: each side's operations with the other are matched in the order it
issues them, and an operation blocks until its partner is reached (a batch is issued as one).
Sends must carry what the receiver expects, in the same order; nothing may be left blocked.
`check_pairs` is the one-operation-at-a-time form of the rule, through lesson 07d's
`first_conflict`. `check` validates, simulates (`course_lib.pipeline_check`) and proves a
schedule's programs, and returns a `Report`.
"""

from __future__ import annotations

from collections import defaultdict, deque
from dataclasses import dataclass, field
from typing import Sequence

from course_lib import pipeline_comms as comms
from course_lib.i18n import _
from course_lib.pipeline_actions import Schedule
from course_lib.pipeline_check import (Costs, ScheduleError, Timed, bubble_fractions,
                                       idle_times, peak_activations, simulate)
from course_lib.pipeline_comms import Op, Post, Program, Wait
from course_lib.pipeline_schedules import first_conflict

def check_messages(programs: Sequence[Program]) -> None:
    """Per direction of every pair: the k-th send from a to b must be what b's k-th receive
    from a expects (NCCL has no tags: messages are matched by order alone)."""
    sent, expected = defaultdict(list), defaultdict(list)
    for rank, program in enumerate(programs):
        for op in comms.ops_in_order(program):
            (sent if op.send else expected)[(rank, op.peer) if op.send else (op.peer, rank)] \
                .append(op)
    for (a, b) in sorted(set(sent) | set(expected)):
        sends, recvs = sent[(a, b)], expected[(a, b)]
        for k in range(max(len(sends), len(recvs))):
            s = sends[k] if k < len(sends) else None
            r = recvs[k] if k < len(recvs) else None
            if s is None or r is None or s.message != r.message:
                raise ScheduleError(
                    _("messages out of order from stage {a} to stage {b}: its send #{k} is "
                      "{sent}, stage {b}'s receive #{k} expects {expected}", a=a, b=b, k=k + 1,
                      sent=s.message if s else _("missing"),
                      expected=r.message if r else _("nothing")),
                    ((a, str(s) if s else "none"), (b, str(r) if r else "none")))


    return None
    ### END SOLUTION


def check_pairs(programs: Sequence[Program]) -> None:
    """`first_conflict` on every pair of ranks, for programs that issue one operation at a
    time (batches need the simulation, `check_nccl`)."""
    for a in range(len(programs)):
        for b in range(a + 1, len(programs)):
            mine, theirs = comms.pair_sequence(programs, a, b), comms.pair_sequence(programs, b, a)
            k = first_conflict(mine, theirs)
            if k is not None:
                x = str(mine[k]) if k < len(mine) else _("nothing")
                y = str(theirs[k]) if k < len(theirs) else _("nothing")
                raise ScheduleError(_("stages {a} and {b} do not pair their operation #{k}: "
                                      "stage {a} issues {x}, stage {b} issues {y}", a=a, b=b,
                                      k=k + 1, x=x, y=y), ((a, x), (b, y)))


def check_nccl(programs: Sequence[Program], sends: str = "rendezvous") -> None:
    """Run the programs under NCCL's rule for each pair of ranks: operations are matched in the
    order each side issues them, each blocking until its partner is reached ("rendezvous";
    "eager" lets a send complete alone, as small messages may). A batch (batch_isend_irecv) is
    issued as one. Raises ScheduleError naming the first conflicting pair of operations."""
    check_messages(programs)
    NcclSim(programs, eager=sends == "eager").run()


class NcclSim:
    """Per rank a program counter; per (rank, peer) a queue of the batches the rank issued that
    involve the peer. A batch is active when it heads every queue it is in; an operation of an
    active batch completes when its partner is in the peer's active batch (a send alone if
    eager); a batch leaves its queues when all its operations are done; Wait blocks the host."""

    def __init__(self, programs: Sequence[Program], eager: bool = False):
        self.programs, self.eager = [list(p) for p in programs], eager
        self.pc = [0] * len(programs)
        self.queues: dict[tuple[int, int], deque] = defaultdict(deque)
        self.done: set[tuple[int, Op]] = set()
        self.partner = comms.partners(programs)

    def run(self) -> None:
        """Step until every program ends; on a stall, raise the deadlock's first pair."""
        while self.advance_hosts() | self.match():
            pass
        if any(pc < len(p) for pc, p in zip(self.pc, self.programs)) or \
                any(self.queues.values()):
            raise self.stalled()

    def advance_hosts(self) -> bool:
        """Run each host up to its next Wait on an unfinished operation."""
        moved = False
        for r, program in enumerate(self.programs):
            while self.pc[r] < len(program):
                step = program[self.pc[r]]
                if isinstance(step, Wait) and not all((r, op) in self.done for op in step.ops):
                    break
                if isinstance(step, Post):
                    for peer in sorted({op.peer for op in step.ops}):
                        self.queues[(r, peer)].append(step)
                self.pc[r] += 1
                moved = True
        return moved

    def active(self, rank: int, batch: Post) -> bool:
        """Whether `batch` heads every queue of `rank` it is in."""
        return all(self.queues[(rank, op.peer)] and self.queues[(rank, op.peer)][0] is batch
                   for op in batch.ops)

    def match(self) -> bool:
        """Complete every operation whose partner is reachable; pop finished batches."""
        moved = False
        for (r, peer), queue in list(self.queues.items()):
            if not queue or not self.active(r, queue[0]):
                continue
            for op in queue[0].ops:
                if op.peer != peer or (r, op) in self.done:
                    continue
                other = self.queues.get((peer, r))
                mate = self.partner[(r, op)]
                ready = other and self.active(peer, other[0]) and mate[1] in other[0].ops
                buffered = self.eager and (op.send or mate in self.done)
                if ready or buffered:
                    self.done.add((r, op))
                    if ready:
                        self.done.add(mate)
                    moved = True
        for (r, peer), queue in self.queues.items():
            while queue and all((r, op) in self.done for op in queue[0].ops):
                batch = queue[0]
                for p in {op.peer for op in batch.ops}:
                    if self.queues[(r, p)] and self.queues[(r, p)][0] is batch:
                        self.queues[(r, p)].popleft()
                moved = True
        return moved

    def stalled(self) -> ScheduleError:
        """The first pair (lowest ranks) whose active heads cannot meet, or the first host
        waiting on an operation nobody will match."""
        for (r, peer) in sorted(self.queues):
            queue, other = self.queues[(r, peer)], self.queues.get((peer, r))
            if r < peer and queue and other:
                mine = [op for op in queue[0].ops if op.peer == peer and (r, op) not in self.done]
                theirs = [op for op in other[0].ops if op.peer == r and (peer, op) not in
                          self.done]
                if mine and theirs:
                    return ScheduleError(
                        _("deadlock under NCCL's order: stage {r} is blocked in {mine} while "
                          "stage {peer} is blocked in {theirs}; each waits for an operation the "
                          "other issues later", r=r, mine=_ops(mine), peer=peer,
                          theirs=_ops(theirs)),
                        ((r, str(mine[0])), (peer, str(theirs[0]))))
        for r, program in enumerate(self.programs):
            if self.pc[r] < len(program):
                op = next(op for op in program[self.pc[r]].ops if (r, op) not in self.done)
                mate = self.partner[(r, op)]
                return ScheduleError(
                    _("deadlock under NCCL's order: stage {r} waits for {op}, but stage {peer} "
                      "is stuck before issuing its partner {mate}", r=r, op=op, peer=op.peer,
                      mate=mate[1]),
                    ((r, str(op)), mate[:1] + (str(mate[1]),)))
        r, peer = next(k for k, q in sorted(self.queues.items()) if q)
        op = next(op for op in self.queues[(r, peer)][0].ops if (r, op) not in self.done)
        mate = self.partner[(r, op)]
        return ScheduleError(_("deadlock under NCCL's order: stage {r}'s {op} never meets its "
                               "partner {mate} on stage {peer}", r=r, op=op, mate=mate[1],
                               peer=peer), ((r, str(op)), (peer, str(mate[1]))))


def _ops(ops: Sequence[Op]) -> str:
    return ", ".join(map(str, ops))


# -- everything at once ------------------------------------------------------------------------

@dataclass
class Report:
    """What `check` found: the simulated timeline, per-stage idle time, bubble and peak
    stored activations (whole-stage micro-batches)."""
    schedule: Schedule
    timeline: list[Timed]
    idle: list[float]
    bubble: list[float]
    peak: list[float]
    span: float
    programs: list[Program] = field(default_factory=list)

    def summary(self) -> str:
        """One line per stage."""
        rows = [f"{self.schedule.name}, p={self.schedule.n_stages}, "
                f"m={self.schedule.n_microbatches}: span {self.span:g}"]
        for s in range(self.schedule.n_stages):
            rows.append(f"  stage {s}: idle {self.idle[s]:g} ({self.bubble[s]:.3f}), "
                        f"peak stored {self.peak[s]:g}")
        return "\n".join(rows)


def check(schedule: Schedule, costs: Costs = Costs(), sends: str = "rendezvous",
          programs: Sequence[Program] | None = None) -> Report:
    """Validate, simulate and prove the schedule's messages deadlock-free under NCCL's order
    (with `programs`, else the ones `comms.add_comms` builds); raise ScheduleError if not."""
    timeline = simulate(schedule, costs)
    if programs is None:
        programs = comms.add_comms(schedule, timeline)
    check_nccl(programs, sends)
    p = schedule.n_stages
    span = max(t.end for t in timeline) - min(t.start for t in timeline)
    return Report(schedule, timeline, idle_times(timeline, p), bubble_fractions(timeline, p),
                  peak_activations(schedule), span, list(programs))
