"""The receiving half of a link: read frames and hand each to the receive it matches.

Whichever thread waits for a receive reads the socket itself (no thread hop on the latency
path), one reader at a time; the link's receiver thread only drives `irecv`s nobody waits on
yet. A frame's payload goes straight into the posted receive's memory, from the socket or from
the shared-memory region; a frame nobody asked for is kept by the `TagMatcher`. The common
case, a blocking receive on a link nobody else reads, whose frame is the next to come, skips
the request and the matcher altogether (`recv_direct`).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from typing import TYPE_CHECKING, Callable

import torch

from course_lib.dist import ring, shm
from course_lib.dist.errors import DistError, ProtocolError
from course_lib.dist.matching import DONE, FILLING, POSTED, RecvRequest, TagMatcher
from course_lib.dist.waiting import CountedCondition
from course_lib.dist.wire import (ABORT_TAG, FLAG_SHM, HEADER, PeerClosed, WireTimeout,
                                  byte_view, decode_header, flags_of)
from course_lib.dist.work import What
from course_lib.i18n import _

if TYPE_CHECKING:
    from course_lib.dist.peer import Peer
    from course_lib.dist.sender import Exchange

log = logging.getLogger("course_lib.dist")


class Receiver:
    """Reads one peer's frames; the lock guards the matcher, `reading` and the thread's queue."""

    def __init__(self, peer: "Peer", sock, region: shm.Region | None):
        self.peer, self.sock, self.region = peer, sock, region
        self.stream = (region.ring_stream(sock) if region is not None and region.ring
                       else ring.SocketStream(sock))
        self.lock = threading.Lock()  # the receive lock
        self.cond = CountedCondition(self.lock)  # receives waiting for the reader to finish
        self.queued = threading.Condition(self.lock)  # the receiver thread waits for an irecv
        self.matcher = TagMatcher()
        self.reading = False  # one reader of the socket at a time
        self._header = memoryview(bytearray(HEADER.size))
        self._queue: deque[RecvRequest] = deque()  # irecvs for the receiver thread
        self._thread: threading.Thread | None = None

    # --- posting ------------------------------------------------------------------------

    def post(self, tensor: torch.Tensor, tag: int, name: str, deadline: float,
             combine: Callable | None = None) -> RecvRequest:
        """Register a receive; it completes at once if the message is already here."""
        what = What(self.peer.rank, name, "recv from", self.peer.peer_rank)
        req = RecvRequest(tensor, tag, what, deadline, self.progress, combine)
        with self.lock:
            self.peer.check_alive(name, "recv from")
            msg = self.matcher.post(req)
            if msg is not None:
                self._deliver(req, msg)
        return req

    def irecv(self, tensor: torch.Tensor, tag: int, name: str, deadline: float) -> RecvRequest:
        """Post a receive that the receiver thread drives while the caller does other work."""
        req = self.post(tensor, tag, name, deadline)
        if not req.is_completed():
            with self.lock:
                self._queue.append(req)
                self.queued.notify()
                if self._thread is None:
                    self._thread = self.peer.start_thread("receiver", self._loop)
        return req

    def recv(self, tensor: torch.Tensor, tag: int, name: str, deadline: float,
             combine: Callable | None = None) -> None:
        """Blocking receive on the caller's thread (combined into `tensor` with `combine`)."""
        if not self.recv_direct(tensor, tag, name, deadline, combine):
            self.progress(self.post(tensor, tag, name, deadline, combine), deadline)

    def recv_direct(self, tensor: torch.Tensor, tag: int, name: str, deadline: float,
                    combine: Callable | None, sending: Exchange | None = None) -> bool:
        """The common case without posting a request: nobody else reads this link and nothing
        has come for `tag`, so read the next frame here; True if it was ours and is done (else
        it went where it belongs, and the caller posts as usual). `sending`: a send this
        thread writes whenever the read waits (see `Exchange`)."""
        if not tensor.is_contiguous():
            return False
        started = time.monotonic()
        with self.lock:
            if self.reading or self.peer.dead is not None or self.matcher.holds(tag):
                return False
            self.reading = True
        self.stream.sending = sending
        try:
            try:
                frame = self._read_header(deadline)
                if frame is not None and frame[0] == tag:
                    dtype, shape, nbytes, via_shm, payload_deadline = frame[1:]
                    error = self._mismatch(name, tensor, dtype, shape, tag)
                    self._read_payload(tensor if error is None else None, nbytes, via_shm,
                                       payload_deadline, combine)
            except (WireTimeout, PeerClosed, ProtocolError, OSError) as exc:
                self._broken(name, exc)
                return False  # the link is dead: posting raises why
            if frame is None:
                raise self._timed_out(name, started)
            if frame[0] != tag:
                self._dispatch(frame, name)
                return False
            if error is not None:
                raise error
            return True
        finally:
            self.stream.sending = None
            self._done_reading()

    def _loop(self) -> None:
        while True:
            with self.lock:
                while not self._queue and self.peer.dead is None:
                    self.queued.wait()
                if self.peer.dead is not None:
                    return
                req = self._queue.popleft()
            try:
                self.progress(req, req.deadline)
            except DistError:
                pass  # the request holds the error for whoever waits on it

    def _deliver(self, req: RecvRequest, msg: torch.Tensor) -> None:
        """Complete `req` with a message that was kept before it was posted."""
        error = self._mismatch(req.what.name, req.buffer, msg.dtype, tuple(msg.shape), req.tag)
        if error is None:
            if req.combine is not None:
                req.combine(req.buffer, msg)
            else:
                req.buffer.copy_(msg)
        req.complete(error)

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

    # --- reading ------------------------------------------------------------------------

    def progress(self, req: RecvRequest, deadline: float) -> None:
        """Read frames until `req` is complete (another thread may complete it for us)."""
        while True:
            with self.lock:
                while self.reading and req.state != DONE:
                    remaining = deadline - time.monotonic()
                    if remaining <= 0 and req.state == POSTED:
                        self._expire(req)
                        break
                    self.cond.wait(remaining if remaining > 0 else 0.05)
                if req.state == DONE:
                    break
                self.reading = True
            try:
                self._read_one(req, deadline)
            finally:
                self._done_reading()
        if req.exception() is not None:
            raise req.exception()

    def _done_reading(self) -> None:
        """Let the next reader in, waking the receives that wait for one (if any)."""
        with self.lock:
            self.reading = False
            self.cond.wake()

    def _expire(self, req: RecvRequest) -> None:
        self.matcher.withdraw(req)
        req.complete(self._timed_out(req.what.name, req.started))

    def _timed_out(self, name: str, started: float) -> DistError:
        late = _("timed out after {seconds}s", seconds=f"{time.monotonic() - started:.1f}")
        return self.peer.error(name, "recv from", late, timeout=True)

    def _read_one(self, req: RecvRequest, deadline: float) -> None:
        """Read one frame and hand it to its receive (or keep it); a broken stream is fatal."""
        name = req.what.name
        try:
            frame = self._read_header(deadline)
        except (WireTimeout, PeerClosed, ProtocolError, OSError) as exc:
            return self._broken(name, exc)
        if frame is None:
            with self.lock:
                if req.state == POSTED:
                    self._expire(req)
            return
        self._dispatch(frame, name)

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
            raise ProtocolError("shared-memory frame on a link without shared memory")
        # The sender has started this frame: allow it time to finish (a full timeout if the
        # reader's own deadline is close; the same deadline saves re-arming it).
        now = time.monotonic()
        payload_deadline = deadline if deadline - now > 1.0 else now + self.peer.timeout
        if tag == ABORT_TAG:
            text = bytearray(nbytes)
            self.stream.recv_exact(memoryview(text), payload_deadline)
            raise PeerClosed("group aborted: " + text.decode("utf-8", "replace"))
        return tag, dtype, shape, nbytes, via_shm, payload_deadline

    def _dispatch(self, frame: tuple, name: str) -> None:
        """Read the payload of a frame whose header was read into the receive posted for its
        tag, or keep it for a receive still to come; a broken stream is fatal."""
        tag, dtype, shape, nbytes, via_shm, payload_deadline = frame
        target = None
        try:
            with self.lock:
                target = self.matcher.pop(tag)
                if target is not None:
                    target.state = FILLING
            if target is None:
                msg = torch.empty(shape, dtype=dtype)
                self._read_payload(msg, nbytes, via_shm, payload_deadline)
                with self.lock:
                    late = self.matcher.pop(tag)
                    if late is not None:
                        self._deliver(late, msg)
                    else:
                        self.matcher.keep(tag, msg)
                return
            error = self._mismatch(target.what.name, target.buffer, dtype, shape, tag)
            self._read_payload(target.buffer if error is None else None, nbytes, via_shm,
                               payload_deadline, target.combine)
            with self.lock:
                target.complete(error)
        except (WireTimeout, PeerClosed, ProtocolError, OSError) as exc:
            self._broken(name, exc)
        if target is not None and target.state != DONE:  # it was being filled when the link died
            with self.lock:
                target.complete(self.peer.error(target.what.name, "recv from",
                                                self.peer.dead or "link lost"))

    def _broken(self, name: str, exc: Exception) -> None:
        """The stream broke while `name` read it: the link is dead, and the group with it."""
        if isinstance(exc, WireTimeout):
            reason = "timed out in the middle of a message"
        elif isinstance(exc, PeerClosed):
            reason = self.peer.dead or str(exc)
        elif isinstance(exc, ProtocolError):
            log.warning("rank %d: closing the connection to rank %d: malformed frame (%s)",
                        self.peer.rank, self.peer.peer_rank, exc)
            reason = f"malformed frame ({exc})"
        else:
            reason = self.peer.dead or f"connection lost ({exc.strerror or exc})"
        self.peer.fatal(name, "recv from", reason)

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

    def fail(self, reason: str) -> None:
        """Fail every posted receive with `reason` and let the thread end."""
        with self.lock:
            for req in self.matcher.drain():
                req.complete(self.peer.error(req.what.name, "recv from", reason))
            self.cond.notify_all()
            self.queued.notify_all()

    def join(self, timeout: float) -> None:
        if self._thread is not None:
            self._thread.join(timeout)


def _parse_header(header: memoryview) -> tuple[int, torch.dtype, tuple, int, bool]:
    """decode_header's (tag, dtype, shape, nbytes), and whether the payload comes through
    shared memory."""
    return (*decode_header(header), bool(flags_of(header) & FLAG_SHM))
