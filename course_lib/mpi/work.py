"""A request waited for with a deadline (`Work`), and tensors as MPI buffers: datatypes, the
16-bit reduction, contiguous copies and the host-only rule."""

from __future__ import annotations

import time
from datetime import timedelta
from typing import Any, Callable, Sequence

import torch

from course_lib.dist.errors import DistTimeoutError
from course_lib.dist.group import ReduceOp
from course_lib.dist.work import seconds
from course_lib.i18n import _
from course_lib.mpi.group import _MPI, _state

class Work:
    """An MPI request, waited for with a deadline; `then` runs once it completes (copies out)."""

    def __init__(self, request: Any, name: str, peer_rank: int | None = None,
                 then: Callable[[], None] | None = None, result: Sequence[torch.Tensor] = (),
                 keep: Sequence[torch.Tensor] = ()):
        self.request, self.name, self.peer_rank, self.then = request, name, peer_rank, then
        self.result = list(result)
        self.keep = keep  # buffers MPI reads or writes until the request completes
        self.rank = _state["world"].comm.Get_rank()
        self.started = time.monotonic()
        self.deadline = self.started + _state["timeout"]
        self._done = False

    def is_completed(self) -> bool:
        if not self._done and self.request.Test():
            self._finish()
        return self._done

    def wait(self, timeout: float | timedelta | None = None) -> bool:
        deadline = self.deadline if timeout is None else time.monotonic() + seconds(timeout)
        pause = 0.0
        while not self._done:
            if self.request.Test():
                self._finish()
                break
            if time.monotonic() > deadline:
                fields = dict(rank=self.rank, name=self.name, peer=self.peer_rank,
                              seconds=f"{time.monotonic() - self.started:.1f}")
                raise DistTimeoutError(
                    _("rank {rank}: {name} with rank {peer} (mpi) timed out after {seconds}s; "
                      "MPI cannot cancel it, so this communicator is unusable now", **fields)
                    if self.peer_rank is not None else
                    _("rank {rank}: {name} (mpi) timed out after {seconds}s; MPI cannot cancel "
                      "it, so this communicator is unusable now", **fields),
                    rank=self.rank, peer_rank=self.peer_rank, operation=self.name)
            time.sleep(pause)
            pause = min(1e-3, pause * 2 + 1e-6)  # spin first: MPI's latency is microseconds
        return True

    def _finish(self) -> None:
        self._done = True
        if self.then is not None:
            self.then()

    def get_future(self) -> torch.futures.Future:
        """A completed future (the request waited for now): MPI progresses only when polled,
        so a hook chained on it runs synchronously."""
        self.wait()
        future = torch.futures.Future()
        future.set_result(self.result)
        return future


def _host(name: str, *tensors: Any) -> None:
    """TypeError, naming the operation and the device, for a tensor not in host memory: MPI
    here reads and writes buffers through host pointers (mpi4py on a tensor's numpy view)."""
    for t in tensors:
        if isinstance(t, torch.Tensor) and t.device.type != "cpu":
            raise TypeError(_("course_lib.mpi.{name}: MPI moves host memory, and this tensor is "
                              "on {device}: pass CPU tensors (t.cpu(), then copy the result "
                              'back), or use torch.distributed with backend "nccl" for GPU '
                              "tensors", name=name, device=t.device))


def _buffer(t: torch.Tensor) -> list:
    """[memory, MPI datatype] for a contiguous tensor; 16-bit floats as their raw 16 bits."""
    MPI = _MPI()
    types = {torch.float64: MPI.DOUBLE, torch.float32: MPI.FLOAT, torch.int64: MPI.INT64_T,
             torch.int32: MPI.INT32_T, torch.int16: MPI.INT16_T, torch.int8: MPI.INT8_T,
             torch.uint8: MPI.UINT8_T, torch.bool: MPI.C_BOOL}
    if t.dtype in (torch.float16, torch.bfloat16):
        return [t.view(torch.int16).numpy(), MPI.INT16_T]
    if t.dtype not in types:
        raise TypeError(_("course_lib.mpi: no MPI datatype for {dtype}", dtype=t.dtype))
    return [t.numpy(), types[t.dtype]]


_half_ops: dict = {}


def _half_op(dtype: torch.dtype, op: ReduceOp) -> Any:
    """A user-defined MPI operation that reduces 16-bit floats as torch does (commutative)."""
    key = (dtype, op)
    if key not in _half_ops:
        fn = {ReduceOp.SUM: torch.add, ReduceOp.AVG: torch.add, ReduceOp.PRODUCT: torch.mul,
              ReduceOp.MIN: torch.minimum, ReduceOp.MAX: torch.maximum}[op]

        def reduce(inbuf, inoutbuf, datatype):
            a = torch.frombuffer(inbuf, dtype=dtype)
            b = torch.frombuffer(inoutbuf, dtype=dtype)
            fn(a, b, out=b)

        _half_ops[key] = _MPI().Op.Create(reduce, commute=True)
    return _half_ops[key]


def _mpi_op(t: torch.Tensor, op: ReduceOp) -> Any:
    MPI = _MPI()
    if t.dtype in (torch.float16, torch.bfloat16):
        return _half_op(t.dtype, op)
    if t.dtype == torch.bool:
        return {ReduceOp.SUM: MPI.LOR, ReduceOp.AVG: MPI.LOR, ReduceOp.PRODUCT: MPI.LAND,
                ReduceOp.MIN: MPI.LAND, ReduceOp.MAX: MPI.LOR}[op]
    return {ReduceOp.SUM: MPI.SUM, ReduceOp.AVG: MPI.SUM, ReduceOp.PRODUCT: MPI.PROD,
            ReduceOp.MIN: MPI.MIN, ReduceOp.MAX: MPI.MAX}[op]


def _average(t: torch.Tensor, n: int, op: ReduceOp) -> None:
    if op is ReduceOp.AVG and t.dtype != torch.bool:
        if t.is_floating_point():
            t.div_(n)
        else:
            t.copy_(torch.div(t, n, rounding_mode="floor"))


def _contiguous(t: torch.Tensor) -> tuple[torch.Tensor, Callable[[], None]]:
    """`t` itself if contiguous, else a contiguous copy and the copy-back to run at the end."""
    if t.is_contiguous():
        return t.detach(), lambda: None
    flat = t.detach().contiguous()
    return flat, lambda: t.detach().copy_(flat)


def _issue(work: Work, async_op: bool) -> Work | None:
    if async_op:
        return work
    work.wait()
    return None


def _steps(*fns: Callable[[], None]) -> Callable[[], None]:
    def run() -> None:
        for fn in fns:
            fn()
    return run
