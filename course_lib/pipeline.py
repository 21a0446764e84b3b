"""Pipeline parallelism: a sequential model cut into stages, one per rank, fed micro-batches.

Activations go forward and gradients backward with point-to-point messages; a schedule decides
the order of each stage's forwards (F) and backwards (B). `ScheduleGPipe` runs all forwards,
then all backwards; `Schedule1F1B` starts backwards as soon as it can, so a stage keeps at most
p micro-batches of activations instead of m. Both record what each stage did and when.
"""

from __future__ import annotations

import time
from typing import Any, Callable, NamedTuple, Sequence

import torch
from torch import nn

from course_lib.data import default_dist

ACTIVATION_TAG, GRADIENT_TAG = 1, 2
MAX_DIMS = 8
DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64)


# ---- splitting a model into stages ---------------------------------------------------------

def partition(costs: Sequence[float], n_stages: int) -> list[range]:
    """Split items 0..n-1 into `n_stages` non-empty contiguous ranges with the smallest largest
    stage cost, then the most even (least sum of squares; ties: the later cut)."""
    n = len(costs)
    if not 1 <= n_stages <= n:
        raise ValueError(f"cannot split {n} layers into {n_stages} non-empty stages")
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + c)
    worst = (float("inf"), float("inf"))
    # best[k][i]: (max cost, sum of squares) of items[:i] in k stages; cut[k][i]: last start.
    best = [[worst] * (n + 1) for _ in range(n_stages + 1)]
    cut = [[0] * (n + 1) for _ in range(n_stages + 1)]
    best[0][0] = (0.0, 0.0)
    for k in range(1, n_stages + 1):
        for i in range(k, n + 1):
            for j in range(k - 1, i):
                c = prefix[i] - prefix[j]
                cand = (max(best[k - 1][j][0], c), best[k - 1][j][1] + c * c)
                if cand <= best[k][i]:
                    best[k][i], cut[k][i] = cand, j
    bounds, i = [], n
    for k in range(n_stages, 0, -1):
        bounds.append(range(cut[k][i], i))
        i = cut[k][i]
    return bounds[::-1]


def split_sequential(model: nn.Sequential, n_stages: int,
                     costs: Sequence[float] | None = None) -> list[nn.Sequential]:
    """Cut `model` into `n_stages` balanced nn.Sequential stages (sharing its layers), balanced
    by parameter count unless `costs` (one per layer, e.g. measured time) is given."""
    if not isinstance(model, nn.Sequential):
        raise TypeError(f"expected nn.Sequential, got {type(model).__name__}")
    if costs is None:
        costs = [sum(p.numel() for p in layer.parameters()) for layer in model]
    elif len(costs) != len(model):
        raise ValueError(f"got {len(costs)} costs for {len(model)} layers")
    return [nn.Sequential(*(model[i] for i in r)) for r in partition(costs, n_stages)]


# ---- point-to-point with a small header (dtype, micro-batch, shape) -------------------------

def _header(tensor: torch.Tensor, microbatch: int) -> torch.Tensor:
    if tensor.dim() > MAX_DIMS or tensor.dtype not in DTYPES:
        raise ValueError(f"can only send tensors of <= {MAX_DIMS} dims and dtype in {DTYPES}, "
                         f"got {tensor.dtype} of shape {tuple(tensor.shape)}")
    dims = list(tensor.shape) + [0] * (MAX_DIMS - tensor.dim())
    return torch.tensor([DTYPES.index(tensor.dtype), microbatch, tensor.dim(), *dims],
                        dtype=torch.int64)


class PipelineStage:
    """One stage of the pipeline: `submodule` run on this rank, with its neighbours' ranks.

    `stage_index` must be this rank's rank in `group` and `num_stages` the group's size.
    """

    def __init__(self, submodule: nn.Module, stage_index: int, num_stages: int, *,
                 dist: Any = None, group: Any = None):
        self.submodule, self.dist, self.group = submodule, default_dist(dist), group
        rank, world = self.dist.get_rank(group), self.dist.get_world_size(group)
        if num_stages != world:
            raise ValueError(f"num_stages={num_stages} but the group has {world} ranks "
                             "(one stage per rank)")
        if stage_index != rank:
            raise ValueError(f"stage_index={stage_index} on group rank {rank}: run stage i on "
                             "rank i")
        self.stage_index, self.num_stages = stage_index, num_stages
        self.is_first, self.is_last = stage_index == 0, stage_index == num_stages - 1
        self.prev = None if self.is_first else self._global(stage_index - 1)
        self.next = None if self.is_last else self._global(stage_index + 1)
        self._posted: dict[tuple[int, int], tuple] = {}

    def _global(self, group_rank: int) -> int:
        if self.group is None:
            return group_rank
        if not hasattr(self.dist, "get_global_rank"):
            raise ValueError("a pipeline on a sub-group needs dist.get_global_rank")
        return self.dist.get_global_rank(self.group, group_rank)

    def _fail(self, what: str, peer: int, exc: Exception) -> RuntimeError:
        return RuntimeError(f"pipeline stage {self.stage_index}: {what} with rank {peer} "
                            f"failed: {exc}")

    def send(self, tensor: torch.Tensor, dst: int, tag: int, microbatch: int) -> list:
        """Start sending header + tensor; returns the Works (wait on them before reuse)."""
        tensor = tensor.detach().contiguous()
        try:
            return [self.dist.isend(_header(tensor, microbatch), dst, group=self.group, tag=tag),
                    self.dist.isend(tensor, dst, group=self.group, tag=tag)]
        except Exception as exc:
            raise self._fail(f"isend (tag {tag}) of micro-batch {microbatch}", dst, exc) from exc

    def irecv(self, src: int, tag: int, microbatch: int, like: torch.Tensor) -> None:
        """Post the receives of header + a tensor shaped like `like` now (the micro-batches of a
        step share one shape), so the transfer overlaps compute; `recv` collects them."""
        header = torch.empty(3 + MAX_DIMS, dtype=torch.int64)
        tensor = torch.empty_like(like, memory_format=torch.contiguous_format)
        try:
            works = [self.dist.irecv(header, src, group=self.group, tag=tag),
                     self.dist.irecv(tensor, src, group=self.group, tag=tag)]
        except Exception as exc:
            raise self._fail(f"irecv (tag {tag}) of micro-batch {microbatch}", src, exc) from exc
        self._posted[(src, tag)] = (microbatch, header, tensor, works)

    def recv(self, src: int, tag: int, microbatch: int) -> torch.Tensor:
        """Receive header + tensor from `src` (or collect what `irecv` posted); checks it is
        the micro-batch we expect."""
        what = ("activation" if tag == ACTIVATION_TAG else "gradient") + \
            f" of micro-batch {microbatch}"
        posted = self._posted.pop((src, tag), None)
        try:
            if posted is None:
                header = torch.empty(3 + MAX_DIMS, dtype=torch.int64)
                self.dist.recv(header, src, group=self.group, tag=tag)
                code, ndim = int(header[0]), int(header[2])
                tensor = torch.empty([int(v) for v in header[3:3 + ndim]], dtype=DTYPES[code])
                self.dist.recv(tensor, src, group=self.group, tag=tag)
            else:
                expected_mb, header, tensor, works = posted
                for work in works:
                    work.wait()
        except Exception as exc:
            raise self._fail(f"recv of {what}", src, exc) from exc
        got = int(header[1])
        if got != microbatch or (posted and expected_mb != microbatch):
            raise RuntimeError(f"pipeline stage {self.stage_index}: expected {what} from rank "
                               f"{src} but got micro-batch {got} (schedules out of step?)")
        if posted and not torch.equal(header, _header(tensor, microbatch)):
            raise RuntimeError(f"pipeline stage {self.stage_index}: {what} from rank {src} has "
                               "another shape or dtype than the step's first micro-batch")
        return tensor


# ---- schedules -------------------------------------------------------------------------------

class Event(NamedTuple):
    """One action of one stage: F (forward) or B (backward) of a micro-batch, perf_counter times."""
    rank: int
    action: str
    microbatch: int
    start: float
    end: float


class PipelineSchedule:
    """Runs one training step of `stage` over `n_microbatches`: the order of F and B actions is
    the subclass's `order()`. Loss is scaled by 1/m (`scale_grads`) so gradients match the batch.

    After `step`, `events` holds this stage's Events, `peak_live` the most micro-batches whose
    activations were stored at once, `peak_activation_bytes` the most bytes autograd kept for
    backward (parameters excluded).
    """

    def __init__(self, stage: PipelineStage, n_microbatches: int,
                 loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
                 scale_grads: bool = True):
        if n_microbatches < 1:
            raise ValueError(f"n_microbatches must be >= 1, got {n_microbatches}")
        self.stage, self.n_microbatches = stage, n_microbatches
        self.loss_fn, self.scale_grads = loss_fn, scale_grads
        self.events: list[Event] = []
        self.peak_live = self.peak_activation_bytes = 0

    def order(self) -> list[tuple[str, int]]:
        """This stage's actions, e.g. [("F", 0), ("F", 1), ("B", 0), ("B", 1)]."""
        raise NotImplementedError

    def step(self, *args: torch.Tensor, target: torch.Tensor | None = None,
             losses: list | None = None) -> torch.Tensor | None:
        """One step: the first stage passes the batch, the last the target (and a list that gets
        each micro-batch's loss). Gradients accumulate in .grad; returns the last stage's output."""
        st, m = self.stage, self.n_microbatches
        if args and not st.is_first:
            raise ValueError(f"stage {st.stage_index} is not the first: pass no inputs")
        if st.is_first and not args:
            raise ValueError("the first stage needs the input batch")
        if (target is not None) != st.is_last:
            raise ValueError("pass target on the last stage, and only there")
        if st.is_last and self.loss_fn is None:
            raise ValueError("the last stage needs loss_fn")
        self._inputs = [self._split(a, "input") for a in args]
        self._targets = self._split(target, "target") if st.is_last else None
        self._stash: dict[int, tuple] = {}
        self._works: list = []
        self._outputs: list[torch.Tensor] = []
        self._losses = losses
        self.events, self._live, self._live_bytes = [], 0, 0
        self.peak_live = self.peak_activation_bytes = 0
        self._params = {p.data_ptr() for p in st.submodule.parameters()}
        actions = self.order()
        if sorted(actions) != sorted([(a, i) for a in "BF" for i in range(m)]):
            raise ValueError(f"stage {st.stage_index}: order() must run F and B of each of the "
                             f"{m} micro-batches once, got {actions}")
        for action, mb in actions:
            (self._forward if action == "F" else self._backward)(mb)
        for work in self._works:
            work.wait()
        self._works, self._stash = [], {}
        return torch.cat(self._outputs) if st.is_last else None

    def _split(self, tensor: torch.Tensor, what: str) -> tuple[torch.Tensor, ...]:
        if tensor.shape[0] % self.n_microbatches:
            raise ValueError(f"{what} batch of {tensor.shape[0]} does not split into "
                             f"{self.n_microbatches} equal micro-batches")
        return tensor.chunk(self.n_microbatches)

    def _record(self, action: str, mb: int, start: float) -> None:
        self.events.append(Event(self.stage.stage_index, action, mb, start, time.perf_counter()))

    def _count_saved(self, tensor: torch.Tensor) -> torch.Tensor:
        if tensor.data_ptr() not in self._params:
            self._nbytes += tensor.numel() * tensor.element_size()
        return tensor

    def _forward(self, mb: int) -> None:
        st = self.stage
        if st.is_first:
            x = [a[mb] for a in self._inputs]
        else:
            x = [st.recv(st.prev, ACTIVATION_TAG, mb).requires_grad_()]
            if mb + 1 < self.n_microbatches:  # start the next one's transfer during compute
                st.irecv(st.prev, ACTIVATION_TAG, mb + 1, like=x[0])
        start, self._nbytes = time.perf_counter(), 0
        with torch.autograd.graph.saved_tensors_hooks(self._count_saved, lambda t: t):
            out = st.submodule(*x)
            if st.is_last:
                loss = self.loss_fn(out, self._targets[mb])
                scaled = loss / self.n_microbatches if self.scale_grads else loss
        self._record("F", mb, start)
        self._stash[mb] = (x[0], scaled if st.is_last else out, self._nbytes)
        self._live += 1
        self._live_bytes += self._nbytes
        self.peak_live = max(self.peak_live, self._live)
        self.peak_activation_bytes = max(self.peak_activation_bytes, self._live_bytes)
        if st.is_last:
            self._outputs.append(out.detach())
            if self._losses is not None:
                self._losses.append(loss.detach())
        else:
            self._works += st.send(out, st.next, ACTIVATION_TAG, mb)

    def _backward(self, mb: int) -> None:
        st = self.stage
        if mb not in self._stash:
            raise RuntimeError(f"stage {st.stage_index}: backward of micro-batch {mb} before "
                               "its forward")
        x, out, nbytes = self._stash.pop(mb)
        grad = None
        if not st.is_last:
            grad = st.recv(st.next, GRADIENT_TAG, mb)
            if mb + 1 < self.n_microbatches:
                st.irecv(st.next, GRADIENT_TAG, mb + 1, like=grad)
        start = time.perf_counter()
        torch.autograd.backward(out, grad)
        self._record("B", mb, start)
        self._live -= 1
        self._live_bytes -= nbytes
        if not st.is_first:
            self._works += st.send(x.grad, st.prev, GRADIENT_TAG, mb)


def gpipe_order(n_microbatches: int, num_stages: int, stage_index: int) -> list[tuple[str, int]]:
    """GPipe: all forwards, then all backwards, in micro-batch order on every stage."""
    m = n_microbatches
    return [("F", i) for i in range(m)] + [("B", i) for i in range(m)]


def one_f_one_b_order(n_microbatches: int, num_stages: int,
                      stage_index: int) -> list[tuple[str, int]]:
    """1F1B: warm up with (p - 1 - stage) forwards, then alternate one forward and one backward,
    then drain the remaining backwards."""
    m = n_microbatches
    warmup = min(num_stages - 1 - stage_index, m)
    actions = [("F", i) for i in range(warmup)]
    for i in range(m - warmup):
        actions += [("F", warmup + i), ("B", i)]
    return actions + [("B", i) for i in range(m - warmup, m)]


class ScheduleGPipe(PipelineSchedule):
    """All m forwards, then all m backwards: simple, but every stage keeps m activations."""

    def order(self) -> list[tuple[str, int]]:
        return gpipe_order(self.n_microbatches, self.stage.num_stages, self.stage.stage_index)


class Schedule1F1B(PipelineSchedule):
    """One forward, one backward once the pipeline is full: the same bubble as GPipe, but at
    most p micro-batches stored per stage."""

    def order(self) -> list[tuple[str, int]]:
        return one_f_one_b_order(self.n_microbatches, self.stage.num_stages,
                                 self.stage.stage_index)


def bubble_fractions(events: Sequence[Event]) -> dict[int, float]:
    """Idle share of the step for each stage: 1 - busy time / (last end - first start), the
    step's span taken over all stages (the times must share a clock: one host)."""
    if not events:
        raise ValueError("no events recorded: run step() first")
    span = max(e.end for e in events) - min(e.start for e in events)
    busy: dict[int, float] = {}
    for e in events:
        busy[e.rank] = busy.get(e.rank, 0.0) + (e.end - e.start)
    return {r: 1.0 - b / span for r, b in sorted(busy.items())}


def ideal_bubble(p: int, m: int) -> float:
    """(p - 1) / (m + p - 1): the idle share of a balanced pipeline with free communication."""
    return (p - 1) / (m + p - 1)
