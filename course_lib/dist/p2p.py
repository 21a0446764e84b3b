"""Point-to-point: `send`/`recv` block, `isend`/`irecv` return a `Work` to `.wait()` on.

Ranks are global (as in torch.distributed); messages are matched by (peer, tag) in order.
"""

from __future__ import annotations

import torch

from course_lib.dist.collective_parts import check_host
from course_lib.dist.group import ProcessGroup, resolve
from course_lib.dist.work import Work
from course_lib.i18n import _


def _check(tensor: torch.Tensor, name: str) -> None:
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(_("{name}: expected a torch.Tensor, got {type}", name=name,
                          type=type(tensor).__name__))
    check_host([tensor], name)


def send(tensor: torch.Tensor, dst: int, group: ProcessGroup | None = None, tag: int = 0) -> None:
    """Send `tensor` to rank `dst`; returns once its bytes are handed to the network."""
    _check(tensor, "send")
    g = resolve(group, "send")
    g.send(tensor, g.group_rank(dst, "dst"), g.p2p_tag(tag), "send")


def recv(tensor: torch.Tensor, src: int, group: ProcessGroup | None = None, tag: int = 0) -> int:
    """Receive into `tensor` (same shape and dtype as sent) from rank `src`; returns `src`."""
    _check(tensor, "recv")
    g = resolve(group, "recv")
    g.recv(tensor, g.group_rank(src, "src"), g.p2p_tag(tag), "recv")
    return src


def isend(tensor: torch.Tensor, dst: int, group: ProcessGroup | None = None,
          tag: int = 0) -> Work:
    """Start sending `tensor`; do not modify it until `.wait()` returns."""
    _check(tensor, "isend")
    g = resolve(group, "isend")
    return g.isend(tensor, g.group_rank(dst, "dst"), g.p2p_tag(tag), "isend")


def irecv(tensor: torch.Tensor, src: int, group: ProcessGroup | None = None,
          tag: int = 0) -> Work:
    """Start receiving into `tensor`; its contents are valid once `.wait()` returns."""
    _check(tensor, "irecv")
    g = resolve(group, "irecv")
    return g.irecv(tensor, g.group_rank(src, "src"), g.p2p_tag(tag), "irecv")
