"""MPI as a `dist`: torch.distributed's calls on mpi4py's buffer interface, for processes that
mpiexec started.

    from course_lib import mpi
    mpi.init_process_group()        # under mpiexec (or a cluster started with engines="mpi")
    ddp = DistributedDataParallel(model, dist=mpi)

Tensors travel as buffers (uppercase mpi4py calls: no pickling), collectives in place with
`MPI_IN_PLACE`. Every call is non-blocking underneath (`Iallreduce`, `Isend`...) and waited
for with a deadline, so a peer that never arrives is an error naming the rank, the operation
and the peer, not a hang; MPI cannot cancel a collective, so after such an error the
communicator is unusable. 16-bit floats, which MPI has no standard type for, reduce through
a user-defined MPI operation.
"""

from __future__ import annotations

import importlib.util
import os
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable, Sequence

import torch

from course_lib.dist.collectives import check_list, check_op
from course_lib.dist.errors import DistTimeoutError
from course_lib.dist.group import ReduceOp
from course_lib.dist.work import seconds
from course_lib.processes import run_session

__all__ = ["DEFAULT_TIMEOUT", "unavailable", "launch", "Group", "init_process_group",
    "is_initialized", "destroy_process_group", "get_backend", "get_rank", "get_world_size",
    "get_global_rank", "get_process_group_ranks", "new_group", "Work", "all_reduce", "broadcast",
    "reduce", "all_gather", "reduce_scatter", "gather", "scatter", "barrier", "isend", "irecv",
    "send", "recv"]


DEFAULT_TIMEOUT = 300.0


_state: dict[str, Any] = {}


def unavailable() -> str | None:
    """None if MPI programs can run here, else why not (what to install)."""
    if importlib.util.find_spec("mpi4py") is None:
        return "mpi4py is not importable (pip install mpi4py mpich)"
    if not (Path(sys.executable).parent / "mpiexec").exists():
        return f"no mpiexec next to {sys.executable} (pip install mpich)"
    return None


def launch(world_size: int, args: Sequence[str], timeout: float,
           env: dict[str, str] | None = None) -> str:
    """Run `python ARGS` on `world_size` processes under the mpiexec next to this Python and
    return its stdout (`env`: extra variables, e.g. MPICH's MPIR_CVAR_* to force an
    algorithm), in its own process group, ended if it outlives `timeout` (`run_session`)."""
    why = unavailable()
    if why:
        raise RuntimeError(f"course_lib.mpi: cannot run mpiexec: {why}")
    cmd = [str(Path(sys.executable).parent / "mpiexec"), "-n", str(world_size), sys.executable,
           *args]
    return run_session(cmd, timeout, f"mpiexec -n {world_size}", env).stdout


def _MPI():
    from mpi4py import MPI

    return MPI


class Group:
    """A communicator and its members' global ranks (what `new_group` returns)."""

    def __init__(self, comm: Any, ranks: list[int]):
        self.comm, self.ranks = comm, ranks

    def __repr__(self) -> str:
        return f"mpi.Group(ranks={self.ranks})"


def init_process_group(backend: str = "mpi", *, timeout: float | timedelta = DEFAULT_TIMEOUT,
                       **_: Any) -> None:
    """Use MPI_COMM_WORLD as the world. Needs processes started by mpiexec."""
    if backend != "mpi":
        raise ValueError(f"course_lib.mpi runs the 'mpi' backend, got {backend!r}")
    if not any(k in os.environ for k in ("PMI_RANK", "PMIX_RANK", "OMPI_COMM_WORLD_RANK",
                                        "PMI_FD", "PMI_PORT", "HYDI_CONTROL_FD")):
        raise RuntimeError("course_lib.mpi: this process was not started by mpiexec; run "
                           "`mpiexec -n N python ...` or course_lib.cluster.start(engines='mpi')")
    MPI = _MPI()
    world = MPI.COMM_WORLD
    _state.update(world=Group(world, list(range(world.Get_size()))), timeout=seconds(timeout))


def is_initialized() -> bool:
    return "world" in _state


def destroy_process_group() -> None:
    _state.clear()


def get_backend(group: Group | None = None) -> str:
    return "mpi"


def _group(group: Group | None, name: str) -> Group:
    if not _state:
        raise RuntimeError(f"course_lib.mpi.{name}: call init_process_group() first")
    g = _state["world"] if group is None else group
    if g.comm == _MPI().COMM_NULL:
        raise RuntimeError(f"rank {_state['world'].comm.Get_rank()}: {name}: this rank is not "
                           f"a member of group {g.ranks}")
    return g


def get_rank(group: Group | None = None) -> int:
    return _group(group, "get_rank").comm.Get_rank()


def get_world_size(group: Group | None = None) -> int:
    return _group(group, "get_world_size").comm.Get_size()


def get_global_rank(group: Group, group_rank: int) -> int:
    return _group(group, "get_global_rank").ranks[group_rank]


def get_process_group_ranks(group: Group | None) -> list[int]:
    return list(_group(group, "get_process_group_ranks").ranks)


def new_group(ranks: Sequence[int] | None = None, **_: Any) -> Group:
    """A communicator of `ranks` (collective over the world, as torch's new_group is)."""
    world = _group(None, "new_group")
    ranks = sorted(ranks) if ranks is not None else list(world.ranks)
    comm = world.comm.Create(world.comm.Get_group().Incl(ranks))
    return Group(comm, ranks)


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
                peer = f" with rank {self.peer_rank}" if self.peer_rank is not None else ""
                raise DistTimeoutError(
                    f"rank {self.rank}: {self.name}{peer} (mpi) timed out after "
                    f"{time.monotonic() - self.started:.1f}s; MPI cannot cancel it, so this "
                    "communicator is unusable now", rank=self.rank, peer_rank=self.peer_rank,
                    operation=self.name)
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


def _buffer(t: torch.Tensor) -> list:
    """[memory, MPI datatype] for a contiguous tensor; 16-bit floats as their raw 16 bits."""
    MPI = _MPI()
    types = {torch.float64: MPI.DOUBLE, torch.float32: MPI.FLOAT, torch.int64: MPI.INT64_T,
             torch.int32: MPI.INT32_T, torch.int16: MPI.INT16_T, torch.int8: MPI.INT8_T,
             torch.uint8: MPI.UINT8_T, torch.bool: MPI.C_BOOL}
    if t.dtype in (torch.float16, torch.bfloat16):
        return [t.view(torch.int16).numpy(), MPI.INT16_T]
    if t.dtype not in types:
        raise TypeError(f"course_lib.mpi: no MPI datatype for {t.dtype}")
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


def all_reduce(tensor: torch.Tensor, op: Any = ReduceOp.SUM, group: Group | None = None,
               async_op: bool = False) -> Work | None:
    """MPI_Iallreduce in place (MPI_IN_PLACE)."""
    op, g = check_op(op), _group(group, "all_reduce")
    buf, copy_back = _contiguous(tensor)
    request = g.comm.Iallreduce(_MPI().IN_PLACE, _buffer(buf), _mpi_op(buf, op))
    then = _steps(lambda: _average(buf, g.comm.Get_size(), op), copy_back)
    return _issue(Work(request, "all_reduce", then=then, result=[tensor], keep=(buf,)), async_op)


def broadcast(tensor: torch.Tensor, src: int, group: Group | None = None,
              async_op: bool = False) -> Work | None:
    g = _group(group, "broadcast")
    buf, copy_back = _contiguous(tensor)
    request = g.comm.Ibcast(_buffer(buf), root=g.ranks.index(src))
    return _issue(Work(request, "broadcast", src, copy_back, [tensor], keep=(buf,)), async_op)


def reduce(tensor: torch.Tensor, dst: int, op: Any = ReduceOp.SUM, group: Group | None = None,
           async_op: bool = False) -> Work | None:
    """MPI_Ireduce onto `dst` (in place there); other ranks' tensors stay as they are."""
    op, g = check_op(op), _group(group, "reduce")
    root = g.ranks.index(dst)
    if g.comm.Get_rank() == root:
        buf, copy_back = _contiguous(tensor)
        request = g.comm.Ireduce(_MPI().IN_PLACE, _buffer(buf), _mpi_op(buf, op), root=root)
        then = _steps(lambda: _average(buf, g.comm.Get_size(), op), copy_back)
    else:
        buf = tensor.detach().contiguous()
        request = g.comm.Ireduce(_buffer(buf), None, _mpi_op(buf, op), root=root)
        then = None
    return _issue(Work(request, "reduce", dst, then, [tensor], keep=(buf,)), async_op)


def _scatter_into(flat: torch.Tensor, tensors: Sequence[torch.Tensor]) -> Callable[[], None]:
    def copy_out() -> None:
        for t, piece in zip(tensors, flat.chunk(len(tensors))):
            t.copy_(piece.view(t.shape))
    return copy_out


def all_gather(tensor_list: list[torch.Tensor], tensor: torch.Tensor,
               group: Group | None = None, async_op: bool = False) -> Work | None:
    g = _group(group, "all_gather")
    p = g.comm.Get_size()
    check_list(tensor_list, tensor, p, "tensor_list")
    out = torch.empty(p * tensor.numel(), dtype=tensor.dtype)
    send = tensor.detach().contiguous()
    request = g.comm.Iallgather(_buffer(send), _buffer(out))
    return _issue(Work(request, "all_gather", then=_scatter_into(out, tensor_list),
                       result=tensor_list, keep=(send, out)), async_op)


def reduce_scatter(output: torch.Tensor, input_list: list[torch.Tensor],
                   op: Any = ReduceOp.SUM, group: Group | None = None,
                   async_op: bool = False) -> Work | None:
    """MPI_Ireduce_scatter_block: output on rank i = input_list[i] reduced over all ranks."""
    op, g = check_op(op), _group(group, "reduce_scatter")
    check_list(input_list, output, g.comm.Get_size(), "input_list")
    send = torch.cat([t.detach().reshape(-1) for t in input_list])
    recv, copy_back = _contiguous(output)
    request = g.comm.Ireduce_scatter_block(_buffer(send), _buffer(recv), _mpi_op(send, op))
    then = _steps(lambda: _average(recv, g.comm.Get_size(), op), copy_back)
    return _issue(Work(request, "reduce_scatter", then=then, result=[output],
                       keep=(send, recv)), async_op)


def gather(tensor: torch.Tensor, gather_list: list[torch.Tensor] | None = None, dst: int = 0,
           group: Group | None = None, async_op: bool = False) -> Work | None:
    g = _group(group, "gather")
    root, p = g.ranks.index(dst), g.comm.Get_size()
    send = tensor.detach().contiguous()
    out = None
    if g.comm.Get_rank() == root:
        check_list(gather_list, tensor, p, "gather_list")
        out = torch.empty(p * tensor.numel(), dtype=tensor.dtype)
        request = g.comm.Igather(_buffer(send), _buffer(out), root=root)
        then = _scatter_into(out, gather_list)
    else:
        request, then = g.comm.Igather(_buffer(send), None, root=root), None
    return _issue(Work(request, "gather", dst, then, keep=(send, out)), async_op)


def scatter(tensor: torch.Tensor, scatter_list: list[torch.Tensor] | None = None, src: int = 0,
            group: Group | None = None, async_op: bool = False) -> Work | None:
    g = _group(group, "scatter")
    root = g.ranks.index(src)
    recv, copy_back = _contiguous(tensor)
    send = None
    if g.comm.Get_rank() == root:
        check_list(scatter_list, tensor, g.comm.Get_size(), "scatter_list")
        send = torch.cat([t.detach().reshape(-1) for t in scatter_list])
    request = g.comm.Iscatter(None if send is None else _buffer(send), _buffer(recv), root=root)
    return _issue(Work(request, "scatter", src, copy_back, [tensor], keep=(send, recv)),
                  async_op)


def barrier(group: Group | None = None, async_op: bool = False) -> Work | None:
    return _issue(Work(_group(group, "barrier").comm.Ibarrier(), "barrier"), async_op)


def _check_tag(tag: int) -> int:
    upper = _MPI().COMM_WORLD.Get_attr(_MPI().TAG_UB)
    if not isinstance(tag, int) or not 0 <= tag <= upper:
        raise ValueError(f"tag must be an int in [0, {upper}], got {tag!r}")
    return tag


def isend(tensor: torch.Tensor, dst: int, group: Group | None = None, tag: int = 0) -> Work:
    g = _group(group, "isend")
    send = tensor.detach().contiguous()
    request = g.comm.Isend(_buffer(send), dest=g.ranks.index(dst), tag=_check_tag(tag))
    return Work(request, "send to", dst, keep=(send,))


def irecv(tensor: torch.Tensor, src: int, group: Group | None = None, tag: int = 0) -> Work:
    g = _group(group, "irecv")
    recv, copy_back = _contiguous(tensor)
    request = g.comm.Irecv(_buffer(recv), source=g.ranks.index(src), tag=_check_tag(tag))
    return Work(request, "recv from", src, copy_back, [tensor], keep=(recv,))


def send(tensor: torch.Tensor, dst: int, group: Group | None = None, tag: int = 0) -> None:
    isend(tensor, dst, group, tag).wait()


def recv(tensor: torch.Tensor, src: int, group: Group | None = None, tag: int = 0) -> int:
    irecv(tensor, src, group, tag).wait()
    return src
