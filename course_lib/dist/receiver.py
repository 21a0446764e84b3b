"""The receiving half of a link: read frames and hand each to the receive it matches.

Whichever thread waits for a receive reads the socket itself (no thread hop on the latency
path), one reader at a time; the link's receiver thread only drives `irecv`s nobody waits on
yet. A frame's payload goes straight into the posted receive's memory, from the socket or from
the shared-memory region; a frame nobody asked for is kept by the `TagMatcher`. The common
case, a blocking receive on a link nobody else reads, whose frame is the next to come, skips
the request and the matcher altogether (`recv_direct`).

Reading a frame's header and payload off the stream is `FrameReader`'s (`frame_reader`).
"""

from __future__ import annotations

import threading
import time
from collections import deque
from typing import TYPE_CHECKING, Callable

import torch

from course_lib.dist import shm
from course_lib.dist.errors import DistError, ProtocolError
from course_lib.dist.frame_reader import FrameReader
from course_lib.dist.frame_reader import log  # noqa: F401 - the link's logger, known by this name
from course_lib.dist.matching import DONE, FILLING, POSTED, RecvRequest, TagMatcher
from course_lib.dist.waiting import CountedCondition
from course_lib.dist.wire import PeerClosed, WireTimeout
from course_lib.dist.work import What
from course_lib.i18n import _

if TYPE_CHECKING:
    from course_lib.dist.peer import Peer
    from course_lib.dist.sender import Exchange


class Receiver(FrameReader):
    """Reads one peer's frames; the lock guards the matcher, `reading` and the thread's queue."""

    def __init__(self, peer: "Peer", sock, region: shm.Region | None):
        super().__init__(peer, sock, region)
        self.lock = threading.Lock()  # the receive lock
        self.cond = CountedCondition(self.lock)  # receives waiting for the reader to finish
        self.queued = threading.Condition(self.lock)  # the receiver thread waits for an irecv
        self.matcher = TagMatcher()
        self.reading = False  # one reader of the socket at a time
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
                                                self.peer.dead or _("link lost")))


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
