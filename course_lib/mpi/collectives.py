"""The collectives on MPI's non-blocking calls (`Iallreduce`, `Ibcast`...), in place with
`MPI_IN_PLACE` where torch.distributed's are."""

from __future__ import annotations

from typing import Any, Callable, Sequence

import torch

from course_lib.dist.collectives import check_list, check_op
from course_lib.dist.group import ReduceOp
from course_lib.mpi.group import Group, _MPI, _group
from course_lib.mpi.work import (Work, _average, _buffer, _contiguous, _host, _issue, _mpi_op,
                                 _steps)

def all_reduce(tensor: torch.Tensor, op: Any = ReduceOp.SUM, group: Group | None = None,
               async_op: bool = False) -> Work | None:
    """MPI_Iallreduce in place (MPI_IN_PLACE)."""
    _host("all_reduce", tensor)
    op, g = check_op(op), _group(group, "all_reduce")
    buf, copy_back = _contiguous(tensor)
    request = g.comm.Iallreduce(_MPI().IN_PLACE, _buffer(buf), _mpi_op(buf, op))
    then = _steps(lambda: _average(buf, g.comm.Get_size(), op), copy_back)
    return _issue(Work(request, "all_reduce", then=then, result=[tensor], keep=(buf,)), async_op)


def broadcast(tensor: torch.Tensor, src: int, group: Group | None = None,
              async_op: bool = False) -> Work | None:
    _host("broadcast", tensor)
    g = _group(group, "broadcast")
    buf, copy_back = _contiguous(tensor)
    request = g.comm.Ibcast(_buffer(buf), root=g.ranks.index(src))
    return _issue(Work(request, "broadcast", src, copy_back, [tensor], keep=(buf,)), async_op)


def reduce(tensor: torch.Tensor, dst: int, op: Any = ReduceOp.SUM, group: Group | None = None,
           async_op: bool = False) -> Work | None:
    """MPI_Ireduce onto `dst` (in place there); other ranks' tensors stay as they are."""
    _host("reduce", tensor)
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
    _host("all_gather", tensor, *tensor_list)
    g = _group(group, "all_gather")
    p = g.comm.Get_size()
    check_list(tensor_list, tensor, p, "tensor_list")
    out = torch.empty(p * tensor.numel(), dtype=tensor.dtype, device=tensor.device)
    send = tensor.detach().contiguous()
    request = g.comm.Iallgather(_buffer(send), _buffer(out))
    return _issue(Work(request, "all_gather", then=_scatter_into(out, tensor_list),
                       result=tensor_list, keep=(send, out)), async_op)


def reduce_scatter(output: torch.Tensor, input_list: list[torch.Tensor],
                   op: Any = ReduceOp.SUM, group: Group | None = None,
                   async_op: bool = False) -> Work | None:
    """MPI_Ireduce_scatter_block: output on rank i = input_list[i] reduced over all ranks."""
    _host("reduce_scatter", output, *input_list)
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
    _host("gather", tensor, *(gather_list or ()))
    g = _group(group, "gather")
    root, p = g.ranks.index(dst), g.comm.Get_size()
    send = tensor.detach().contiguous()
    out = None
    if g.comm.Get_rank() == root:
        check_list(gather_list, tensor, p, "gather_list")
        out = torch.empty(p * tensor.numel(), dtype=tensor.dtype, device=tensor.device)
        request = g.comm.Igather(_buffer(send), _buffer(out), root=root)
        then = _scatter_into(out, gather_list)
    else:
        request, then = g.comm.Igather(_buffer(send), None, root=root), None
    return _issue(Work(request, "gather", dst, then, keep=(send, out)), async_op)


def scatter(tensor: torch.Tensor, scatter_list: list[torch.Tensor] | None = None, src: int = 0,
            group: Group | None = None, async_op: bool = False) -> Work | None:
    _host("scatter", tensor, *(scatter_list or ()))
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
