"""Buckets of gradients: what `DistributedDataParallel` (course_lib.ddp) reduces in one message,
and what it hands a communication hook (torch's `GradBucket`).

A `Bucket` holds the gradients of a few parameters in one flat buffer. Each parameter's slice of
it, shaped like the parameter, becomes its `.grad` (torch's `gradient_as_bucket_view=True`), so
the all_reduce averages the gradients where they already are. With `find_unused_parameters`, one
slot per parameter after the gradients travels in the same message and counts the ranks that
used it. `check_same_tensors` makes every rank fail, naming the ranks, when they would lay their
buckets out differently (ZeRO, course_lib.zero, uses it for its own buckets too).

`DistributedDataParallel.register_comm_hook(state, hook)` replaces a bucket's all_reduce by
`hook(state, bucket)`, with torch's signature: the hook gets a `GradBucket` (its flat
`buffer()`, `gradients()`, `parameters()`, `index()`, `is_last()`) and returns a
`torch.futures.Future` whose value is the reduced buffer. The buffer then holds this rank's
gradients undivided, and the hook averages, as in torch (`run_comm_hook`). Lesson 10 writes
compression hooks with it (course_lib.comm_hooks).
"""

from __future__ import annotations

import functools
import inspect
import threading
import time
from typing import Any, Callable, Sequence

import torch

from course_lib.backend import comm_device
from course_lib.i18n import _

COMM_HOOK_TIMEOUT = 300.0  # seconds a bucket's hook future may take before it is an error


class Bucket:
    """Parameters whose gradients travel together in one flat buffer and one all_reduce.

    `params`, `numel` (the gradient elements in `flat`), `flat`, `views` (each parameter's slice
    of `flat`, shaped like it), `ready` (the `id`s of the parameters whose gradient arrived in
    this backward), `work` (the reduction in flight), and when it was launched and collected.
    """

    def __init__(self, params: list[torch.Tensor], with_flags: bool,
                 zeros: Callable[..., torch.Tensor] | None = None):
        self.params = params
        self.numel = sum(p.numel() for p in params)
        # The buffer lives where the parameters do (their gradients are views of it).
        zeros = zeros or functools.partial(torch.zeros, device=params[0].device)
        # With find_unused_parameters, one slot per parameter counts the ranks that used it.
        self.flat = zeros(self.numel + (len(params) if with_flags else 0), dtype=params[0].dtype)
        self.views = [v.view_as(p) for v, p in
                      zip(self.flat[:self.numel].split([p.numel() for p in params]), params)]
        self.ready: set[int] = set()
        self.work: Any = None
        self.launched_at = self.collected_at = 0.0


def is_view_of(grad: torch.Tensor, view: torch.Tensor) -> bool:
    """Whether `grad` is `view` itself (same memory, shape and strides), not a copy of it: a
    gradient accumulated straight into its bucket."""
    return (grad.data_ptr() == view.data_ptr() and grad.shape == view.shape
            and grad.stride() == view.stride())


_reciprocals: dict[tuple[int, torch.dtype], torch.Tensor] = {}


def reciprocal(divisor: int, dtype: torch.dtype) -> torch.Tensor:
    """1 / divisor as a CPU scalar tensor in `dtype`'s compute precision (float32 at least),
    made once: a product by it is what torch's DDP computes, and it costs less than a division
    or a product by a Python number."""
    key = (divisor, dtype)
    if key not in _reciprocals:
        _reciprocals[key] = torch.tensor(1.0 / divisor, device="cpu",
                                         dtype=torch.promote_types(dtype, torch.float32))
    return _reciprocals[key]


def bucket_zeros(dist: Any, group: Any = None,
                 device: torch.device | str = "cpu") -> Callable[..., torch.Tensor]:
    """How to allocate a bucket's flat buffer on `device` (its parameters'): where every rank
    of the group maps it, when the dist can and the device is the CPU (the scratch backend's
    `shared_zeros`, lesson 10: its all_reduce then reads the peers' buckets in place), else an
    ordinary tensor on `device`."""
    shared_zeros = getattr(dist, "shared_zeros", None)
    if shared_zeros and torch.device(device).type == "cpu":
        return functools.partial(shared_zeros, group=group)
    return functools.partial(torch.zeros, device=device)


class TimedWork:
    """A bucket's Work that notes when its result was collected (DDP's timeline)."""

    def __init__(self, work: Any, bucket: Bucket):
        if not callable(getattr(work, "wait", None)):
            raise TypeError(_("launch_bucket must return the Work of its asynchronous "
                              "all_reduce (it has a wait() method), got {kind}",
                              kind=type(work).__name__))
        self.work, self.bucket = work, bucket

    def wait(self) -> bool:
        self.work.wait()
        self.bucket.collected_at = time.perf_counter()
        return True


_DTYPES = (torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.int64,
           torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool)


def check_same_tensors(tensors: Sequence[torch.Tensor], what: str, *, dist: Any, group: Any = None,
                       extra: Sequence[int] = ()) -> None:
    """Fail on every rank, naming the ranks, if the group's ranks hold tensors of different
    counts, shapes or dtypes (or different `extra` numbers): they would hang or mix data later."""
    shapes = [tuple(t.shape) for t in tensors]
    codes = [_DTYPES.index(t.dtype) + 1 if t.dtype in _DTYPES else 99 for t in tensors]
    sig = torch.tensor([len(shapes), sum(t.numel() for t in tensors),
                        sum((i + 1) * t.numel() for i, t in enumerate(tensors)),
                        sum((i + 1) * len(s) + sum(s) for i, s in enumerate(shapes)),
                        sum((i + 1) * c for i, c in enumerate(codes)), *extra],
                       dtype=torch.float64, device=comm_device(dist, group))
    world = dist.get_world_size(group)
    sigs = [torch.empty_like(sig) for _ in range(world)]
    dist.all_gather(sigs, sig, group=group)
    sigs = [s.cpu() for s in sigs]
    differ = [r for r in range(1, world) if not torch.equal(sigs[r], sigs[0])]
    if differ:
        ranks = ", ".join(str(r) for r in differ)
        raise RuntimeError(_("{what}: rank(s) {ranks} of the group hold parameters whose "
                             "count, shapes or dtypes differ from rank 0's (seen on rank "
                             "{rank}); every rank must wrap the same model", what=what,
                             ranks=ranks, rank=dist.get_rank(group)))


# -- communication hooks --------------------------------------------------------------------


class GradBucket:
    """What a communication hook sees of a bucket (torch.distributed.GradBucket's methods)."""

    def __init__(self, index: int, bucket: Bucket, last: bool):
        self._index, self._bucket, self._last = index, bucket, last
        self._buffer = bucket.flat[:bucket.numel]

    def index(self) -> int:
        return self._index

    def buffer(self) -> torch.Tensor:
        return self._buffer

    def set_buffer(self, tensor: torch.Tensor) -> None:
        self._buffer.copy_(tensor)

    def gradients(self) -> list[torch.Tensor]:
        return list(self._bucket.views)

    def parameters(self) -> list[torch.Tensor]:
        return list(self._bucket.params)

    def is_last(self) -> bool:
        """Whether this is the last bucket reduced in a backward (the first layers)."""
        return self._last


def check_comm_hook(hook: Callable) -> None:
    """A clear error now, not in the middle of backward, for a hook that is not
    hook(state, bucket)."""
    if not callable(hook):
        raise TypeError(_("register_comm_hook: hook must be callable, got {kind}",
                          kind=type(hook).__name__))
    try:
        inspect.signature(hook).bind(None, None)
    except (TypeError, ValueError) as exc:
        raise TypeError(_("register_comm_hook: hook must take (state, bucket), as torch's "
                          "hooks do: {name} {exc}", name=repr(getattr(hook, "__name__", hook)),
                          exc=exc)) from None


class _HookWork:
    """Waits, bounded, for a hook's future and puts its value (the reduced buffer) in place."""

    def __init__(self, future: Any, buffer: torch.Tensor, what: str):
        if not callable(getattr(future, "wait", None)) or not hasattr(future, "add_done_callback"):
            raise TypeError(_("{what} must return a torch.futures.Future, got {kind}",
                              what=what, kind=type(future).__name__))
        self.future, self.buffer, self.what = future, buffer, what
        self.event = threading.Event()
        future.add_done_callback(lambda _: self.event.set())

    def wait(self) -> bool:
        if not self.event.wait(COMM_HOOK_TIMEOUT):
            raise TimeoutError(_("{what} did not complete within {seconds}s", what=self.what,
                                 seconds=f"{COMM_HOOK_TIMEOUT:g}"))
        value = self.future.wait()
        if isinstance(value, (list, tuple)) and len(value) == 1:
            value = value[0]
        if not isinstance(value, torch.Tensor) or value.numel() != self.buffer.numel():
            raise RuntimeError(_("{what} returned {kind} {shape}; expected the reduced buffer "
                                 "of {n} elements", what=self.what, kind=type(value).__name__,
                                 shape=list(getattr(value, "shape", [])),
                                 n=self.buffer.numel()))
        if value.dtype != self.buffer.dtype:
            raise RuntimeError(_("{what} returned {dtype} values; cast them back to the "
                                 "gradients' {want}", what=self.what, dtype=value.dtype,
                                 want=self.buffer.dtype))
        if value.data_ptr() != self.buffer.data_ptr():
            self.buffer.copy_(value.reshape(-1))
        return True


def run_comm_hook(ddp: Any, bucket: Bucket) -> _HookWork:
    """Call `ddp`'s registered hook on `bucket`; its Work-like result waits for the hook's
    future."""
    state, hook = ddp.comm_hook
    index = ddp.buckets.index(bucket)
    what = (f"rank {ddp.dist.get_rank()}: DistributedDataParallel: communication hook "
            f"{getattr(hook, '__name__', 'hook')} on bucket {index}")
    grad_bucket = GradBucket(index, bucket, index == len(ddp.buckets) - 1)
    return _HookWork(hook(state, grad_bucket), grad_bucket.buffer(), what)


def register_comm_hook(ddp: Any, state: object, hook: Callable) -> None:
    """`ddp.register_comm_hook`'s checks, then the hook in place of the all_reduce: the bucket
    then holds the sum of this rank's gradients, not divided by the world size."""
    check_comm_hook(hook)
    if ddp.comm_hook is not None:
        raise RuntimeError(_("DistributedDataParallel.register_comm_hook can be called only "
                             "once"))
    if ddp.find_unused_parameters:
        raise NotImplementedError(_("DistributedDataParallel: communication hooks with "
                                    "find_unused_parameters=True are not supported"))
    if ddp.in_backward:
        raise RuntimeError(_("DistributedDataParallel.register_comm_hook: register the hook "
                             "before training, not during a backward"))
    ddp.comm_hook, ddp.grad_divisor = (state, hook), 1
