"""The checker (course_lib.pipeline_check, pipeline_nccl) catches planted errors, naming the
first conflicting pair, and models NCCL's per-pair order: lesson 07c's GPipe and 1F1B pass it,
the order that also prefetches gradients hangs 1F1B from 3 micro-batches, and the real 07c
executor, recorded on the scratch backend (p = 2, 3; m = 2, 3, 5, 8), issues exactly the
modelled order, posts each gradient's two receives together, and passes. Everything here is
simulated except that recording (two spawns).
"""

from __future__ import annotations

from typing import Any

import pytest

from course_lib import pipeline_actions as sch
from course_lib import pipeline_comms as comms
from course_lib import pipeline_schedules
from course_lib.pipeline_actions import Action, Schedule
from course_lib.pipeline_check import ScheduleError, simulate, validate
from course_lib.pipeline_comms import Message, Op, Post, Program, Wait
from course_lib.pipeline_nccl import check, check_nccl, check_pairs

STAGES, MICROBATCHES = (2, 3, 4), range(1, 9)
BOTH = ("act", "grad")  # prefetching both kinds of receive: the order that hangs 1F1B
def replace_stage(s: Schedule, stage: int, actions: list[Action]) -> Schedule:
    """`s` with stage `stage`'s list replaced."""
    stages = list(s.stages)
    stages[stage] = tuple(actions)
    return Schedule(s.name + " (planted)", s.n_microbatches, s.placement, tuple(stages))


def one_at_a_time(program: comms.Program) -> comms.Program:
    """The program with each batch issued as single operations, in the same order."""
    out = []
    for step in program:
        out += [Post((op,)) for op in step.ops] if isinstance(step, Post) else [step]
    return out


# -- planted errors in the action lists -------------------------------------------------------

def test_w_before_its_b():
    s = sch.zb_h1(3, 4)
    acts = list(s.stages[1])
    b, w = acts.index(Action("B", 1, 1)), acts.index(Action("W", 1, 1))
    acts.insert(b, acts.pop(w))
    with pytest.raises(ScheduleError) as err:
        validate(replace_stage(s, 1, acts))
    assert err.value.pair == ((1, "W1@c1"), (1, "B1@c1"))
    assert "W1@c1 comes before B1@c1" in str(err.value)


def test_missing_action():
    s = sch.one_f_one_b(3, 5)
    acts = [a for a in s.stages[2] if a != Action("B", 3, 2)]
    with pytest.raises(ScheduleError) as err:
        check(replace_stage(s, 2, acts))
    assert str(err.value) == "stage 2 is missing B3@c2"


def test_action_on_another_stage_and_twice():
    s = sch.one_f_one_b(2, 2)
    with pytest.raises(ScheduleError, match="chunk 0 is on stage 0"):
        validate(replace_stage(s, 1, list(s.stages[1]) + [Action("F", 1, 0)]))
    with pytest.raises(ScheduleError, match="runs F1@c1 twice"):
        validate(replace_stage(s, 1, list(s.stages[1]) + [Action("F", 1, 1)]))


def test_chunks_in_the_wrong_order_wait_on_themselves():
    s = pipeline_schedules.interleaved_1f1b(2, 4)
    acts = list(s.stages[0])
    i, j = acts.index(Action("F", 0, 0)), acts.index(Action("F", 0, 2))
    acts[i], acts[j] = acts[j], acts[i]
    with pytest.raises(ScheduleError) as err:
        simulate(replace_stage(s, 0, acts))
    assert err.value.pair == ((0, "F0@c2"), (1, "F0@c1"))
    assert str(err.value) == ("deadlock: stage 0 waits on itself through stage 1: stage 0: "
                              "F0@c2 waits for F0@c1 -> stage 1: F0@c1 waits for F0@c0, which "
                              "stage 0 runs later")


def test_a_stage_waiting_on_its_own_chunk():
    """At the V's turn both chunks are on one stage: the up chunk first waits on itself."""
    s = sch.zbv(3, 5)
    acts = list(s.stages[2])
    i, j = acts.index(Action("F", 0, 2)), acts.index(Action("F", 0, 3))
    acts[i], acts[j] = acts[j], acts[i]
    with pytest.raises(ScheduleError) as err:
        simulate(replace_stage(s, 2, acts))
    assert err.value.pair == ((2, "F0@c3"), (2, "F0@c2"))
    assert "stage 2 waits on itself: its next action F0@c3 needs F0@c2" in str(err.value)


def test_a_cycle_between_stages():
    s = sch.one_f_one_b(2, 2)
    bad = Schedule("bad", 2, s.placement, (
        (Action("F", 0, 0), Action("B", 0, 0), Action("F", 1, 0), Action("B", 1, 0)),
        (Action("F", 0, 1), Action("F", 1, 1), Action("B", 0, 1), Action("B", 1, 1))))
    with pytest.raises(ScheduleError) as err:
        simulate(bad)
    assert err.value.pair == ((0, "B0@c0"), (1, "B0@c1"))
    assert "stage 1: F1@c1 waits for F1@c0" in str(err.value)
    assert "stage 0 waits on itself through stage 1" in str(err.value)


# -- planted errors in the messages ------------------------------------------------------------

def test_swapped_send_and_receive():
    """Stage 1 of 1F1B receives its next gradient before sending its activation: the two
    neighbours block in two receives, each waiting for a send the other issues later."""
    s = sch.one_f_one_b(3, 4)
    programs = [one_at_a_time(p) for p in check(s).programs]
    check_nccl(programs)
    ops = [(i, st.ops[0]) for i, st in enumerate(programs[1]) if isinstance(st, Post)]
    (i, send), (j, recv) = next((a, b) for a, b in zip(ops, ops[1:])
                                if a[1].send and not b[1].send and a[1].peer == b[1].peer)
    programs[1][i], programs[1][j] = programs[1][j], programs[1][i]
    with pytest.raises(ScheduleError) as err:
        check_nccl(programs)
    assert err.value.pair == ((1, str(recv)), (2, str(comms.Op(False, 1, send.message))))
    assert "deadlock under NCCL's order" in str(err.value)
    with pytest.raises(ScheduleError):
        check_pairs(programs)


def test_two_sends_swapped_deliver_the_wrong_tensor():
    s = sch.gpipe(2, 3)
    programs = [one_at_a_time(p) for p in check(s).programs]
    posts = [i for i, st in enumerate(programs[0]) if isinstance(st, Post)]
    a, b = posts[0], posts[1]
    programs[0][a], programs[0][b] = programs[0][b], programs[0][a]
    with pytest.raises(ScheduleError) as err:
        check_nccl(programs, sends="eager")  # wrong even where sends never block
    assert "its send #1 is act 1 c0>c1, stage 1's receive #1 expects act 0 c0>c1" in \
        str(err.value)


def test_a_receive_never_posted():
    s = sch.one_f_one_b(2, 3)
    programs = [one_at_a_time(p) for p in check(s).programs]
    k = next(i for i, st in enumerate(programs[1]) if isinstance(st, Post) and not st.ops[0].send)
    lost = programs[1].pop(k).ops[0]
    programs[1] = [st for st in programs[1] if not (isinstance(st, Wait) and lost in st.ops)]
    with pytest.raises(ScheduleError) as err:
        check_nccl(programs)
    assert err.value.pair == ((0, "send act 0 c0>c1 to 1"), (1, "recv act 1 c0>c1 from 0"))
    assert str(lost.message) == "act 0 c0>c1"


# -- NCCL's order and lesson 07c's executor ----------------------------------------------------

def test_lesson07_gpipe_and_1f1b_pass_nccls_order():
    """07c's executor prefetches activations only: GPipe and 1F1B pass for p = 2..4,
    m = 1..8, with sends that block until received and with eager ones."""
    for p in STAGES:
        for m in MICROBATCHES:
            for s in (sch.gpipe(p, m), sch.one_f_one_b(p, m)):
                programs = comms.lesson07_programs(s)
                for sends in ("rendezvous", "eager"):
                    check_nccl(programs, sends)
                check_pairs(programs)


def test_prefetching_gradients_too_hangs_1f1b_from_three_microbatches():
    for p in STAGES:
        for m in MICROBATCHES:
            programs = comms.lesson07_programs(sch.one_f_one_b(p, m), BOTH)
            check_nccl(comms.lesson07_programs(sch.gpipe(p, m), BOTH))  # GPipe does not care
            if m <= 2:
                check_nccl(programs)
                continue
            for sends in ("rendezvous", "eager"):  # a hang even where sends never block
                with pytest.raises(ScheduleError, match="deadlock under NCCL's order"):
                    check_nccl(programs, sends)


def test_the_hang_at_p2_m3():
    """p=2, m=3, the posting order on the (0, 1) pair with both receives prefetched."""
    programs = comms.lesson07_programs(sch.one_f_one_b(2, 3), BOTH)
    short = [[("s " if op.send else "r ") + op.message.what[0] + str(op.message.mb)
              for op in comms.pair_sequence(programs, a, b)] for a, b in ((0, 1), (1, 0))]
    assert short[0] == ["s a0", "s a1", "r g0", "r g1", "s a2", "r g2"]
    assert short[1] == ["r a0", "r a1", "s g0", "r a2", "s g1", "s g2"]
    with pytest.raises(ScheduleError) as err:
        check_nccl(programs)
    assert err.value.pair == ((0, "recv grad 1 c1>c0 from 1"), (1, "recv act 2 c0>c1 from 0"))
    fixed = comms.lesson07_programs(sch.one_f_one_b(2, 3))
    assert [str(op.message) for op in comms.pair_sequence(fixed, 0, 1)][3] == "act 2 c0>c1"


def test_what_else_fixes_1f1b():
    """Without any prefetch it still hangs where a send blocks until received (two sends
    facing each other); batching each send with the receive that follows it, or issuing
    every operation in the messages' global order, passes."""
    for p in STAGES:
        for m in range(2, 9):
            s = sch.one_f_one_b(p, m)
            check_nccl(comms.plain_programs(s), sends="eager")
            with pytest.raises(ScheduleError, match="blocked in send"):
                check_nccl(comms.plain_programs(s))
            check_nccl(comms.paired_programs(s))
            check_pairs(check(s).programs)


def test_batching_neighbours_is_not_enough_for_chunks():
    """With several chunks per rank, one direction carries activations and gradients: the
    plain order sends them in another order than the neighbour receives them."""
    for name in ("interleaved", "zbv"):
        with pytest.raises(ScheduleError, match="messages out of order"):
            check_nccl(comms.paired_programs(pipeline_schedules.make(name, 2, 5)), sends="eager")
        check_nccl(check(pipeline_schedules.make(name, 2, 5)).programs)


# -- the real lesson 07c executor, recorded and replayed under NCCL's rule ----------------------

TAG_NAMES = {1: "act", 2: "grad"}  # lesson 07b's ACTIVATION_TAG, GRADIENT_TAG


class RecordingWork:
    """A Work whose wait() is written down."""

    def __init__(self, work: Any, log: list, index: int):
        self.work, self.log, self.index = work, log, index

    def wait(self, *args: Any, **kwargs: Any) -> Any:
        self.log.append(("wait", self.index))
        return self.work.wait(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.work, name)


class RecordingDist:
    """`dist` with isend/irecv/send/recv recorded as (call, peer, tag), in order."""

    def __init__(self, dist: Any):
        self.dist, self.log = dist, []

    def __getattr__(self, name: str) -> Any:
        return getattr(self.dist, name)

    def _record(self, call: str, peer: int, tag: int) -> int:
        self.log.append((call, peer, tag))
        return len(self.log) - 1

    def isend(self, tensor, dst, group=None, tag=0):
        index = self._record("isend", dst, tag)
        return RecordingWork(self.dist.isend(tensor, dst, group=group, tag=tag), self.log, index)

    def irecv(self, tensor, src, group=None, tag=0):
        index = self._record("irecv", src, tag)
        return RecordingWork(self.dist.irecv(tensor, src, group=group, tag=tag), self.log, index)

    def send(self, tensor, dst, group=None, tag=0):
        self._record("send", dst, tag)
        return self.dist.send(tensor, dst, group=group, tag=tag)

    def recv(self, tensor, src, group=None, tag=0):
        self._record("recv", src, tag)
        return self.dist.recv(tensor, src, group=group, tag=tag)


def programs_from(log: list, rank: int) -> Program:
    """One rank's record as a program: each header+tensor pair is one operation on the k-th
    message of its direction and tag; a blocking call is a post and a wait; a wait on either
    half of a message waits for the operation."""
    program: Program = []
    count: dict[tuple, int] = {}
    op_of_call: dict[int, Op] = {}
    half: dict[tuple, int] = {}
    for index, entry in enumerate(log):
        if entry[0] == "wait":
            op = op_of_call[entry[1]]
            if not program or program[-1] != Wait((op,)):
                program.append(Wait((op,)))
            continue
        call, peer, tag = entry
        sending = call in ("isend", "send")
        key = (sending, peer, tag)
        half[key] = half.get(key, 0) + 1
        if half[key] % 2 == 1:  # the header: a new message
            k = count.get(key, 0)
            count[key] = k + 1
            src, dst = (rank, peer) if sending else (peer, rank)
            op = Op(sending, peer, Message(TAG_NAMES.get(tag, str(tag)), k, src, dst))
            program.append(Post((op,)))
        else:
            op = next(o for o in reversed([s.ops[0] for s in program if isinstance(s, Post)])
                      if (o.send, o.peer) == (sending, peer))
        op_of_call[index] = op
        if call in ("send", "recv") and half[key] % 2 == 0:
            program.append(Wait((op,)))
    return program


def lesson07_step_logs(rank: int, world: int, runs: tuple) -> list:
    """Steps of course_lib.pipeline's schedules through a recording dist: what each issued."""
    import torch
    from torch import nn

    from course_lib import pipeline
    from course_lib.backend import default_dist

    logs = []
    for kind, m in runs:
        torch.manual_seed(0)
        model = nn.Sequential(*[nn.Linear(4, 4, dtype=torch.float64) for _ in range(2 * world)])
        dist = RecordingDist(default_dist())
        stage = pipeline.PipelineStage(pipeline.split_sequential(model, world)[rank], rank,
                                       world, dist=dist)
        cls = {"gpipe": pipeline.ScheduleGPipe, "1f1b": pipeline.Schedule1F1B}[kind]
        schedule = cls(stage, m, loss_fn=nn.functional.mse_loss)
        x = torch.randn(2 * m, 4, dtype=torch.float64)
        schedule.step(*([x] if rank == 0 else []), target=x if rank == world - 1 else None)
        stage.wait_sends()
        logs.append(dist.log)
    return logs


@pytest.mark.parametrize("p", [2, 3])
def test_recorded_lesson07_executor_is_the_model_and_passes(p):
    """The real executor issues the modelled order on every pair and passes NCCL's rule; a
    stage before the last posts a gradient's header and tensor receives back to back, just
    before its backward takes them (one wait per gradient, not a header's and then a tensor's)."""
    from course_lib.spawn import spawn

    runs = (("gpipe", 4), ("1f1b", 2), ("1f1b", 3), ("1f1b", 5), ("1f1b", 8))
    per_rank = spawn(lesson07_step_logs, p, runs, backend="scratch", timeout=60)
    for i, (kind, m) in enumerate(runs):
        for rank in range(p - 1):  # a gradient's header and tensor receives, back to back
            log = per_rank[rank][i]
            grads = [k for k, entry in enumerate(log) if entry[0] in ("recv", "irecv")
                     and entry[2] == 2]
            assert grads and all(log[k][0] == "irecv" for k in grads), (kind, m, rank)
            assert all(tensor == header + 1 for header, tensor in zip(grads[::2], grads[1::2]))
        recorded = [programs_from(logs[i], rank) for rank, logs in enumerate(per_rank)]
        model = comms.lesson07_programs(pipeline_schedules.make(kind, p, m))
        for a in range(p):
            for b in range(p):
                if a != b:
                    assert comms.pair_sequence(recorded, a, b) == \
                        comms.pair_sequence(model, a, b), (kind, m, a, b)
        check_nccl(recorded)

