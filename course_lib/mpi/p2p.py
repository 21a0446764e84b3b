"""Point to point on MPI: tagged `Isend` / `Irecv`, waited for with a deadline."""

from __future__ import annotations

import torch

from course_lib.i18n import _
from course_lib.mpi.group import Group, _MPI, _group
from course_lib.mpi.work import Work, _buffer, _contiguous, _host

def _check_tag(tag: int) -> int:
    upper = _MPI().COMM_WORLD.Get_attr(_MPI().TAG_UB)
    if not isinstance(tag, int) or not 0 <= tag <= upper:
        raise ValueError(_("tag must be an int in [0, {max_tag}], got {tag!r}", max_tag=upper,
                           tag=tag))
    return tag


def isend(tensor: torch.Tensor, dst: int, group: Group | None = None, tag: int = 0) -> Work:
    _host("isend", tensor)
    g = _group(group, "isend")
    send = tensor.detach().contiguous()
    request = g.comm.Isend(_buffer(send), dest=g.ranks.index(dst), tag=_check_tag(tag))
    return Work(request, "send to", dst, keep=(send,))


def irecv(tensor: torch.Tensor, src: int, group: Group | None = None, tag: int = 0) -> Work:
    _host("irecv", tensor)
    g = _group(group, "irecv")
    recv, copy_back = _contiguous(tensor)
    request = g.comm.Irecv(_buffer(recv), source=g.ranks.index(src), tag=_check_tag(tag))
    return Work(request, "recv from", src, copy_back, [tensor], keep=(recv,))


def send(tensor: torch.Tensor, dst: int, group: Group | None = None, tag: int = 0) -> None:
    isend(tensor, dst, group, tag).wait()


def recv(tensor: torch.Tensor, src: int, group: Group | None = None, tag: int = 0) -> int:
    irecv(tensor, src, group, tag).wait()
    return src
