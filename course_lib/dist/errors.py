"""The errors `course_lib.dist` raises: each names this rank, the peer and the operation."""

from __future__ import annotations

from course_lib.i18n import _


class DistError(RuntimeError):
    """A distributed operation failed: a dead or misbehaving peer, a mismatch, a closed group.

    `rank` is this rank, `peer_rank` the other end (None for a whole collective), `operation`
    the operation's name (e.g. "all_reduce(ring)").
    """

    def __init__(self, message: str, *, rank: int | None = None, peer_rank: int | None = None,
                 operation: str | None = None):
        super().__init__(message)
        self.rank, self.peer_rank, self.operation = rank, peer_rank, operation


class DistTimeoutError(DistError, TimeoutError):
    """A blocking wait ran past its timeout (the group's, unless the call gave its own)."""


class ProtocolError(Exception):
    """Bytes on a connection that are not our protocol: the connection is closed, never trusted."""


def describe(rank: int, name: str, direction: str, peer_rank: int, reason: str) -> str:
    """The one message format: 'rank 1: all_reduce(ring) recv from rank 0 failed: <reason>'.

    A point-to-point call already names the direction: 'rank 1: irecv from rank 0 failed: ...'.
    """
    if name in ("send", "isend", "recv", "irecv"):
        direction = direction.split()[-1]
    direction = {"recv from": _("recv from"), "send to": _("send to"),
                 "from": _("from"), "to": _("to")}.get(direction, direction)
    return _("rank {rank}: {name} {direction} rank {peer} failed: {reason}", rank=rank, name=name,
             direction=direction, peer=peer_rank, reason=reason)
