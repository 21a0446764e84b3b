"""Reading one link's frames, for its `Receiver`: a frame's header (an abort frame raised as the
peer's reason), then its payload, from the socket or the shared-memory region, straight into a
buffer, reduced into it with `combine`, or read and dropped; a frame that does not fit the
buffer named, and a broken stream made the link's (and the group's) end.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Callable

import torch

from course_lib.dist import ring, shm
from course_lib.dist.errors import DistError, ProtocolError
from course_lib.dist.wire import (ABORT_TAG, FLAG_SHM, HEADER, PeerClosed, WireTimeout,
                                  byte_view, decode_header, flags_of)
from course_lib.i18n import _

if TYPE_CHECKING:
    from course_lib.dist.peer import Peer

log = logging.getLogger("course_lib.dist")


class FrameReader:
    """Reads one peer's frames from its stream: the socket, or a ring in shared memory."""

    def __init__(self, peer: "Peer", sock, region: shm.Region | None):
        self.peer, self.sock, self.region = peer, sock, region
        self.stream = (region.ring_stream(sock) if region is not None and region.ring
                       else ring.SocketStream(sock))
        self._header = memoryview(bytearray(HEADER.size))

    def _read_header(self, deadline: float) -> tuple | None:
        """The next frame's (tag, dtype, shape, nbytes, via_shm, payload deadline); None if
        nothing came by `deadline`. An abort frame is read whole and raised as PeerClosed."""
        try:
            tag, dtype, shape, nbytes, via_shm = self.stream.recv_parsed(
                self._header, _parse_header, deadline)
        except WireTimeout as exc:
            if exc.received:
                raise
            return None
        if via_shm and self.region is None:
            raise ProtocolError(_("shared-memory frame on a link without shared memory"))
        # The sender has started this frame: allow it time to finish (a full timeout if the
        # reader's own deadline is close; the same deadline saves re-arming it).
        now = time.monotonic()
        payload_deadline = deadline if deadline - now > 1.0 else now + self.peer.timeout
        if tag == ABORT_TAG:
            text = bytearray(nbytes)
            self.stream.recv_exact(memoryview(text), payload_deadline)
            raise PeerClosed("group aborted: " + text.decode("utf-8", "replace"))
        return tag, dtype, shape, nbytes, via_shm, payload_deadline

    def _read_payload(self, buffer: torch.Tensor | None, nbytes: int, via_shm: bool,
                      deadline: float, combine: Callable | None = None) -> None:
        """Read a frame's payload into `buffer` (contiguous), combined into it with `combine`,
        or drop it if None."""
        if via_shm:
            shm.receive(self.region, self.stream, buffer, nbytes, deadline, combine)
        elif buffer is None:
            self._drain(nbytes, deadline)
        elif combine is not None:
            self.stream.recv_reduce(buffer if buffer.dim() == 1 else buffer.view(-1), combine,
                                    deadline)
        else:
            self.stream.recv_exact(byte_view(buffer), deadline, soon=True)

    def _drain(self, nbytes: int, deadline: float) -> None:
        """Read and drop a payload nobody can take, so the stream stays in step."""
        scratch = memoryview(bytearray(min(nbytes, 1 << 20)))
        while nbytes:
            n = min(nbytes, len(scratch))
            self.stream.recv_exact(scratch[:n], deadline, soon=True)
            nbytes -= n

    def _mismatch(self, name: str, buffer: torch.Tensor, dtype: torch.dtype, shape: tuple,
                  tag: int) -> DistError | None:
        if buffer.dtype == dtype and buffer.shape == shape:
            return None
        peer = self.peer
        return peer.error(name, "recv from", _(
            "message mismatch (tag {tag}): rank {peer} sent {dtype} {shape}, rank {rank} expects "
            "{want_dtype} {want_shape}", tag=tag, peer=peer.peer_rank, dtype=dtype,
            shape=list(shape), rank=peer.rank, want_dtype=buffer.dtype,
            want_shape=list(buffer.shape)))

    def _broken(self, name: str, exc: Exception) -> None:
        """The stream broke while `name` read it: the link is dead, and the group with it."""
        if isinstance(exc, WireTimeout):
            reason = _("timed out in the middle of a message")
        elif isinstance(exc, PeerClosed):
            reason = self.peer.dead or str(exc)
        elif isinstance(exc, ProtocolError):
            log.warning("rank %d: closing the connection to rank %d: malformed frame (%s)",
                        self.peer.rank, self.peer.peer_rank, exc)
            reason = _("malformed frame ({error})", error=exc)
        else:
            reason = self.peer.dead or _("connection lost ({error})",
                                         error=exc.strerror or exc)
        self.peer.fatal(name, "recv from", reason)


def _parse_header(header: memoryview) -> tuple[int, torch.dtype, tuple, int, bool]:
    """decode_header's (tag, dtype, shape, nbytes), and whether the payload comes through
    shared memory."""
    return (*decode_header(header), bool(flags_of(header) & FLAG_SHM))
