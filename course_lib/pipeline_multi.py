"""Run any schedule of F, B and W actions on real ranks, recording a timeline (lesson 07d).

Rank s runs stage s: the model chunks `schedule.placement` gives it, and the program of its
sends, receives and actions (`course_lib.pipeline_comms.add_comms` by default, so every pair of
ranks issues its operations in the same order). Every message travels as a small header (kind,
micro-batch, source and destination chunk) and then the tensor, all with one tag, as NCCL would
match them: by order alone; a receiver that gets another message than it expects stops with an
error that names both. Works on `course_lib.dist` (backend "scratch") and `torch.distributed`
(gloo).

`B` computes the input gradient only (`pipeline_schedules.backward_input`) when the schedule
has a W of the same micro-batch and chunk, which then computes the weight gradients
(`pipeline_schedules.backward_weight`); otherwise B does both, as in lesson 07c.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch
from torch import nn

from course_lib import pipeline_comms as comms
from course_lib import pipeline_schedules as sch
from course_lib.pipeline_actions import Action, Schedule
from course_lib.pipeline_check import Costs, simulate
from course_lib.pipeline_comms import Message, Op, Post, Program, Wait
from course_lib.backend import comm_device, default_dist
from course_lib.i18n import _
from course_lib.pipeline_split import split_sequential

WHAT = ("act", "grad")


# -- the model ---------------------------------------------------------------------------------

def build_model(seed: int, width: int = 4, blocks: int = 8) -> nn.Sequential:
    """The float64 model every check cuts: `blocks` x (Linear(width, width), Tanh)."""
    torch.manual_seed(seed)
    layers: list[nn.Module] = []
    for _block in range(blocks):
        layers += [nn.Linear(width, width, dtype=torch.float64), nn.Tanh()]
    return nn.Sequential(*layers)


def make_batch(seed: int, rows: int, width: int = 4, device: Any = "cpu"
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs and targets, float64, on `device`: drawn on the CPU from a seeded generator (the
    same numbers on any device), then moved."""
    g = torch.Generator().manual_seed(seed + 1000)
    return tuple(torch.randn(rows, width, generator=g, dtype=torch.float64, device="cpu"
                             ).to(device) for _ in range(2))


def cut(model: nn.Sequential, n_chunks: int) -> list[nn.Sequential]:
    """The model in `n_chunks` balanced chunks (lesson 07's split_sequential)."""
    return split_sequential(model, n_chunks)


def boundary_shapes(chunks: Sequence[nn.Module], x: torch.Tensor) -> list[torch.Size]:
    """The shape of each chunk's output for one micro-batch `x` (a dry run, no autograd)."""
    shapes, h = [], x
    with torch.no_grad():
        for chunk in chunks:
            h = chunk(h)
            shapes.append(h.shape)
    return shapes


# -- one rank's step ---------------------------------------------------------------------------

@dataclass
class StepRecord:
    """What one rank saw in a step: its timeline (stage, kind, mb, chunk, start, end), its
    peak of autograd-saved activation bytes, the bytes one micro-batch stores through the
    whole stage, and how many weight gradients a B accumulated before its send left."""
    timeline: list[tuple] = field(default_factory=list)
    peak_bytes: int = 0
    bytes_per_microbatch: int = 0
    weights_in_b: int = 0
    losses: list[float] = field(default_factory=list)
    stored: dict = field(default_factory=dict)


class Executor:
    """One rank's runner: its chunks, its program, the messages in flight."""

    def __init__(self, schedule: Schedule, chunks: dict[int, nn.Module],
                 shapes: Sequence[torch.Size], loss_fn: Callable, *, program: Program,
                 dist: Any = None, backward_input: Callable = sch.backward_input,
                 backward_weight: Callable = sch.backward_weight):
        self.schedule, self.chunks, self.shapes, self.loss_fn = schedule, chunks, shapes, loss_fn
        self.program, self.dist = program, default_dist(dist)
        self.stage = self.dist.get_rank()
        first = next((q for c in chunks.values() for q in c.parameters()), None)
        self.dtype = torch.get_default_dtype() if first is None else first.dtype
        # data (activations, gradients) on the parameters' device; headers on the
        # communicator's (course_lib.backend.comm_device: CUDA under NCCL, else the CPU)
        self.device = torch.device("cpu") if first is None else first.device
        self.control = comm_device(self.dist)
        self.backward_input, self.backward_weight = backward_input, backward_weight
        self._counting_hooks()

    def _counting_hooks(self) -> None:
        """Count weight-gradient accumulations (to see W run inside B)."""
        self.accumulated = 0

        def bump(_: torch.Tensor) -> None:
            self.accumulated += 1

        for chunk in self.chunks.values():
            for q in chunk.parameters():
                q.register_post_accumulate_grad_hook(bump)

    def step(self, x: torch.Tensor | None = None, y: torch.Tensor | None = None) -> StepRecord:
        """One training step: the batch on the stage of chunk 0, the targets on that of the
        last chunk; gradients accumulate in .grad."""
        m = self.schedule.n_microbatches
        self.inputs = x.chunk(m) if x is not None else None
        self.targets = y.chunk(m) if y is not None else None
        self.inbox: dict[Message, torch.Tensor] = {}
        self.outbox: dict[Message, torch.Tensor] = {}
        self.works: dict[Op, list] = {}
        self.segments: dict[tuple[int, int], list] = {}
        self.stored: dict[tuple[int, int], int] = {}
        self.record = StepRecord()
        self.live = 0
        for step in self.program:
            if isinstance(step, Post):
                self.post(step.ops)
            elif isinstance(step, Wait):
                self.wait(step.ops)
            else:
                self.compute(step.action)
        return self.record

    # -- messages

    def post(self, ops: Sequence[Op]) -> None:
        """Issue a batch: for each send its header and tensor, for each receive two buffers."""
        for op in ops:
            if op.send:
                tensor = self.outbox.pop(op.message)
                pair = [self.header(op.message), tensor]
                self.works[op] = [self.dist.isend(t, op.peer, tag=0) for t in pair] + [pair]
            else:
                shape = self.shapes[op.message.src if op.message.what == "act"
                                    else op.message.dst]
                pair = [torch.empty(4, dtype=torch.int64, device=self.control),
                        torch.empty(shape, dtype=self.dtype, device=self.device)]
                self.works[op] = [self.dist.irecv(t, op.peer, tag=0) for t in pair] + [pair]

    def wait(self, ops: Sequence[Op]) -> None:
        """Wait for each operation; a receive's header must name the message expected."""
        for op in ops:
            *works, (header, tensor) = self.works.pop(op)
            for w in works:
                w.wait()
            if not op.send:
                got = self.message_of(header)
                if got != op.message:
                    raise RuntimeError(_("stage {stage}: expected {message} from stage {peer}, "
                                         "got {got} (programs out of order)", stage=self.stage,
                                         message=op.message, peer=op.peer, got=got))
                self.inbox[op.message] = tensor

    def header(self, msg: Message) -> torch.Tensor:
        """[kind, micro-batch, source chunk, destination chunk], int64, on the control device."""
        return torch.tensor([WHAT.index(msg.what), msg.mb, msg.src, msg.dst], dtype=torch.int64,
                            device=self.control)

    @staticmethod
    def message_of(header: torch.Tensor) -> Message:
        """The message a received header names."""
        what, mb, src, dst = (int(v) for v in header)
        return Message(WHAT[what], mb, src, dst)

    def hand_off(self, action: Action, tensor: torch.Tensor) -> None:
        """Keep `action`'s output for its send, or for the next chunk here (the V's turn)."""
        c = action.chunk
        to = c + 1 if action.kind == "F" else c - 1
        msg = Message("act" if action.kind == "F" else "grad", action.mb, c, to)
        here = self.schedule.placement[to] == self.stage
        (self.inbox if here else self.outbox)[msg] = tensor.detach()

    def take(self, action: Action) -> torch.Tensor:
        """The input `action` receives (arrived, or handed over on this rank)."""
        c = action.chunk
        msg = (Message("act", action.mb, c - 1, c) if action.kind == "F"
               else Message("grad", action.mb, c + 1, c))
        return self.inbox.pop(msg)

    # -- compute

    def compute(self, action: Action) -> None:
        """Run F, B or W, timed; F's saved activations counted until they are freed."""
        start, before = time.perf_counter(), self.accumulated
        getattr(self, f"run_{action.kind}")(action)
        end = time.perf_counter()
        if action.kind == "B" and self.schedule.split_backward(action.mb, action.chunk):
            self.record.weights_in_b += self.accumulated - before
        self.record.timeline.append((self.stage, action.kind, action.mb, action.chunk,
                                     start, end))

    def run_F(self, a: Action) -> None:
        last = a.chunk == self.schedule.n_chunks - 1
        x = self.inputs[a.mb] if a.chunk == 0 else self.take(a).requires_grad_()
        loss = (lambda h: self.loss_fn(h, self.targets[a.mb]) / self.schedule.n_microbatches
                ) if last else None
        nbytes, seen = [0], set()
        params = {q.untyped_storage().data_ptr() for q in self.chunks[a.chunk].parameters()}

        def count(t: torch.Tensor) -> torch.Tensor:
            key = (t.data_ptr(), t.numel())  # a tensor saved twice is stored once
            if t.untyped_storage().data_ptr() not in params and key not in seen:
                seen.add(key)
                nbytes[0] += t.numel() * t.element_size()
            return t

        with torch.autograd.graph.saved_tensors_hooks(count, lambda t: t):
            out, self.segments[(a.mb, a.chunk)] = sch.forward_segments(
                self.chunks[a.chunk], x, loss)
        self.stored[(a.mb, a.chunk)] = self.record.stored[(a.mb, a.chunk)] = nbytes[0]
        self.live += nbytes[0]
        self.record.peak_bytes = max(self.record.peak_bytes, self.live)
        per_mb = sum(v for (j, _), v in self.stored.items() if j == a.mb)
        self.record.bytes_per_microbatch = max(self.record.bytes_per_microbatch, per_mb)
        if last:
            self.record.losses.append(float(out.detach()) * self.schedule.n_microbatches)
        else:
            self.hand_off(a, out)

    def run_B(self, a: Action) -> None:
        last = a.chunk == self.schedule.n_chunks - 1
        grad = None if last else self.take(a)
        segments = self.segments[(a.mb, a.chunk)]
        g_in = self.backward_input(segments, grad)
        if not self.schedule.split_backward(a.mb, a.chunk):
            self.backward_weight(segments)
            self.free(a)
        if a.chunk > 0:
            self.hand_off(a, g_in)

    def run_W(self, a: Action) -> None:
        self.backward_weight(self.segments[(a.mb, a.chunk)])
        self.free(a)

    def free(self, a: Action) -> None:
        """The activations of (mb, chunk) are gone."""
        del self.segments[(a.mb, a.chunk)]
        self.live -= self.stored[(a.mb, a.chunk)]


# -- on every rank -----------------------------------------------------------------------------

def programs_for(schedule: Schedule, how: str = "ordered", costs: Costs = Costs()
                 ) -> list[Program]:
    """Each rank's program: "ordered" (comms.add_comms, NCCL-safe), "plain", "paired" or
    "lesson07"."""
    if how == "ordered":
        return comms.add_comms(schedule, simulate(schedule, costs))
    return getattr(comms, f"{how}_programs")(schedule)


def make_executor(rank: int, schedule: Schedule, model: nn.Sequential, microbatch: torch.Tensor,
                  program: Program, dist: Any = None,
                  loss_fn: Callable = nn.functional.mse_loss, **split: Callable
                  ) -> tuple[Executor, list[nn.Module]]:
    """Stage `rank`'s executor for `schedule` on `model` (cut into chunks; shapes from one
    `microbatch`), and this rank's chunks in model order."""
    chunks = cut(model, schedule.n_chunks)
    mine = {c: chunks[c] for c in schedule.chunks_of(rank)}
    shapes = boundary_shapes(chunks, microbatch)
    ex = Executor(schedule, mine, shapes, loss_fn, program=program, dist=dist, **split)
    return ex, [mine[c] for c in sorted(mine)]


def run_step(rank: int, schedule: Schedule, model: nn.Sequential, x: torch.Tensor,
             y: torch.Tensor, program: Program, dist: Any = None,
             loss_fn: Callable = nn.functional.mse_loss, **split: Callable
             ) -> tuple[StepRecord, list[nn.Module]]:
    """Stage `rank`'s part of one step of `schedule` on `model`; returns the record and this
    rank's chunks (their .grad filled)."""
    ex, mine = make_executor(rank, schedule, model, x.chunk(schedule.n_microbatches)[0],
                             program, dist, loss_fn, **split)
    return ex.step(*feed(rank, schedule, x, y)), mine


def feed(rank: int, schedule: Schedule, x: torch.Tensor, y: torch.Tensor
         ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """The batch for the stage of chunk 0, the targets for the stage of the last chunk."""
    return (x if schedule.placement[0] == rank else None,
            y if schedule.placement[-1] == rank else None)


def reference_grads(model: nn.Sequential, x: torch.Tensor, y: torch.Tensor,
                    n_chunks: int, loss_fn: Callable = nn.functional.mse_loss
                    ) -> list[list[torch.Tensor]]:
    """One process, the whole batch: each chunk's parameter gradients."""
    loss_fn(model(x), y).backward()
    return [[q.grad.clone() for q in chunk.parameters()] for chunk in cut(model, n_chunks)]
