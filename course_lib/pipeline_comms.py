"""The messages of a schedule, and the order each rank issues them in (its program).

A schedule's actions say what each stage computes; the hand-offs between ranks follow from them:
F j@c sends its output to the stage of chunk c+1, B j@c sends its input's gradient to the stage
of chunk c-1 (nothing travels where both chunks share a rank, as at the V's turn). What the
action lists leave open is *when* each rank posts each send and receive, and that is what NCCL
cares about: per pair of ranks it matches operations in the order each side issues them, so two
ranks that issue their operations with each other in different orders hang.

A `Program` is one rank's steps: `Compute(action)`, `Post(ops)` (a batch, issued together as by
`batch_isend_irecv`; a single operation is a batch of one) and `Wait(ops)` (the host blocks until
those operations are done). Three ways to write them:

- `add_comms(schedule, timeline)`: every rank issues its operations in one global order, that of
  the messages' send times on a simulated timeline, each as early as that order allows (a
  receive is posted before it is needed, a send right after its compute). Both ends of every
  pair then issue their operations in the same order, so it cannot deadlock (the proof: lesson
  07d, "Deadlock-free by construction").
- `lesson07_programs(schedule, prefetch)`: what lesson 07c's executor issues (a blocking
  receive, then the next activation's receive posted at once, then compute, then the send);
  with gradients in `prefetch` too, the order that hangs 1F1B.
- `plain_programs(schedule)`: receive just before use, send just after; no prefetch.
- `paired_programs(schedule)`: the plain order with each send batched with the receive that
  follows it (Megatron's send_forward_recv_backward): enough for GPipe and 1F1B.
"""

from __future__ import annotations

from collections import defaultdict
from typing import NamedTuple, Sequence, Union

from course_lib.i18n import _
from course_lib.pipeline_actions import Action, Schedule


class Message(NamedTuple):
    """One hand-off: an activation ("act") or gradient ("grad") of micro-batch `mb` from chunk
    `src` to chunk `dst`."""
    what: str
    mb: int
    src: int
    dst: int

    def __str__(self) -> str:
        return f"{self.what} {self.mb} c{self.src}>c{self.dst}"


class Op(NamedTuple):
    """A send (`send=True`) to, or a receive from, rank `peer` of `message`."""
    send: bool
    peer: int
    message: Message

    def __str__(self) -> str:
        return f"{'send' if self.send else 'recv'} {self.message} " \
               f"{'to' if self.send else 'from'} {self.peer}"


class Compute(NamedTuple):
    """Run one action."""
    action: Action


class Post(NamedTuple):
    """Issue these operations together (one batch_isend_irecv)."""
    ops: tuple[Op, ...]


class Wait(NamedTuple):
    """Block until these operations are done."""
    ops: tuple[Op, ...]


Step = Union[Compute, Post, Wait]
Program = list[Step]


# -- the messages ------------------------------------------------------------------------------

def output_message(action: Action, schedule: Schedule) -> Message | None:
    """What `action` hands to another rank: F's output, B's input gradient, or None."""
    c, last = action.chunk, schedule.n_chunks - 1
    if action.kind == "F" and c < last:
        msg = Message("act", action.mb, c, c + 1)
    elif action.kind == "B" and c > 0:
        msg = Message("grad", action.mb, c, c - 1)
    else:
        return None
    return msg if schedule.placement[msg.src] != schedule.placement[msg.dst] else None


def input_message(action: Action, schedule: Schedule) -> Message | None:
    """What `action` receives from another rank before it can run, or None."""
    c, last = action.chunk, schedule.n_chunks - 1
    if action.kind == "F" and c > 0:
        msg = Message("act", action.mb, c - 1, c)
    elif action.kind == "B" and c < last:
        msg = Message("grad", action.mb, c + 1, c)
    else:
        return None
    return msg if schedule.placement[msg.src] != schedule.placement[msg.dst] else None


def send_op(msg: Message, schedule: Schedule) -> Op:
    """The sender's side of `msg`."""
    return Op(True, schedule.placement[msg.dst], msg)


def recv_op(msg: Message, schedule: Schedule) -> Op:
    """The receiver's side of `msg`."""
    return Op(False, schedule.placement[msg.src], msg)


# -- deadlock-free by construction -------------------------------------------------------------

def add_comms(schedule: Schedule, timeline: Sequence) -> list[Program]:
    """Programs in which every rank issues its operations in the messages' global order (send
    time on `timeline`, then sender, then message), each as early as that order allows."""
    owner = {t.action: t.stage for t in timeline}
    order: dict[Message, tuple] = {}
    for t in timeline:
        msg = output_message(t.action, schedule)
        if msg is not None:
            order[msg] = (t.end, owner[t.action], t.action.kind, t.action.chunk, t.action.mb)
    programs = []
    for s, actions in enumerate(schedule.stages):
        earliest = {}  # op -> the number of this rank's actions that must run before it
        for i, a in enumerate(actions):
            out = output_message(a, schedule)
            if out is not None:
                earliest[send_op(out, schedule)] = i + 1
            inp = input_message(a, schedule)
            if inp is not None:
                earliest[recv_op(inp, schedule)] = 0
        slots: dict[int, list[Op]] = defaultdict(list)
        position = 0
        for op in sorted(earliest, key=lambda op: order[op.message]):
            position = max(position, earliest[op])
            slots[position].append(op)
        programs.append(_assemble(actions, slots, schedule))
    return programs


def _assemble(actions: Sequence[Action], slots: dict[int, list[Op]],
              schedule: Schedule) -> Program:
    """A program: slot i's batch before action i, each action waiting for its input."""
    program: Program = []
    sends = []
    for i in range(len(actions) + 1):
        if slots.get(i):
            program.append(Post(tuple(slots[i])))
            sends += [op for op in slots[i] if op.send]
        if i < len(actions):
            inp = input_message(actions[i], schedule)
            if inp is not None:
                program.append(Wait((recv_op(inp, schedule),)))
            program.append(Compute(actions[i]))
    if sends:
        program.append(Wait(tuple(sends)))
    return program


# -- lesson 07c's order, the naive order, the paired order -------------------------------------

def plain_programs(schedule: Schedule) -> list[Program]:
    """Receive (post and wait) right before the action that needs it; post the send right
    after the action that produces it; wait for the sends at the end."""
    programs = []
    for actions in schedule.stages:
        program: Program = []
        sends = []
        for a in actions:
            inp = input_message(a, schedule)
            if inp is not None:
                op = recv_op(inp, schedule)
                program += [Post((op,)), Wait((op,))]
            program.append(Compute(a))
            out = output_message(a, schedule)
            if out is not None:
                sends.append(send_op(out, schedule))
                program.append(Post((sends[-1],)))
        programs.append(program + ([Wait(tuple(sends))] if sends else []))
    return programs


def paired_programs(schedule: Schedule) -> list[Program]:
    """`plain_programs` with each send issued in one batch with the receive that follows it
    (no compute between): Megatron's send_forward_recv_backward and its mirror."""
    return [merge_adjacent_posts(program) for program in plain_programs(schedule)]


def merge_adjacent_posts(program: Program) -> Program:
    """Posts with nothing between them become one batch."""
    out: Program = []
    for step in program:
        if isinstance(step, Post) and out and isinstance(out[-1], Post):
            out[-1] = Post(out[-1].ops + step.ops)
        else:
            out.append(step)
    return out


def lesson07_programs(schedule: Schedule, prefetch: tuple[str, ...] = ("act",)) -> list[Program]:
    """Lesson 07c's executor (one chunk per stage): take the input (waiting for a posted
    receive, else receiving), post the receive of the next micro-batch at once where its kind
    is in `prefetch`, compute, post the send; wait for the sends at the end. 07c prefetches
    activations only; `prefetch=("act", "grad")`, gradients too, hangs 1F1B from m = 3."""
    if schedule.chunks_per_stage != 1:
        raise ValueError(_("lesson 07c's executor runs one chunk per stage"))
    m, programs = schedule.n_microbatches, []
    for actions in schedule.stages:
        program: Program = []
        posted: dict[str, Op] = {}
        sends = []
        for a in actions:
            inp = input_message(a, schedule)
            if inp is not None:
                op = recv_op(inp, schedule)
                if posted.get(inp.what) == op:
                    del posted[inp.what]
                else:
                    program.append(Post((op,)))
                program.append(Wait((op,)))
                if a.mb + 1 < m and inp.what in prefetch:
                    ahead = recv_op(inp._replace(mb=a.mb + 1), schedule)
                    posted[inp.what] = ahead
                    program.append(Post((ahead,)))
            program.append(Compute(a))
            out = output_message(a, schedule)
            if out is not None:
                sends.append(send_op(out, schedule))
                program.append(Post((sends[-1],)))
        programs.append(program + ([Wait(tuple(sends))] if sends else []))
    return programs


# -- reading programs --------------------------------------------------------------------------

def ops_in_order(program: Program) -> list[Op]:
    """The operations of a program in the order it issues them."""
    return [op for step in program if isinstance(step, Post) for op in step.ops]


def partners(programs: Sequence[Program]) -> dict[tuple[int, Op], tuple[int, Op]]:
    """Each (rank, operation) -> the (rank, operation) at the other end of its message."""
    out = {}
    for rank, program in enumerate(programs):
        for op in ops_in_order(program):
            mate = Op(not op.send, rank, op.message)
            out[(rank, op)] = (op.peer, mate)
    return out


def pair_sequence(programs: Sequence[Program], a: int, b: int) -> list[Op]:
    """Rank a's operations with rank b, in issue order (the queue NCCL matches in order)."""
    return [op for op in ops_in_order(programs[a]) if op.peer == b]
