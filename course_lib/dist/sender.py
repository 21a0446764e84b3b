"""The sending half of a link: frames go out in call order, never blocking a small send.

A small message is written at once on the caller's thread, as far as the socket buffer takes
it (no thread hop on the latency path), and so is a large one whose shared-memory slots are
free now; the rest, and large messages that would have to wait, queue for the link's sender
thread, so sending overlaps the caller's receives. A payload going to a rank on
this machine through shared memory says so explicitly (its `SlotWriter`), never guessed.
For an exchange (`Peer.sendrecv`) there are two shorter paths: `send_now`, a small frame that
the link's ring takes whole right now, written with no request object; and an `Exchange`, a
large payload that the receiving thread writes into the slots whenever its receive waits.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from course_lib.dist import ring, shm
from course_lib.dist.waiting import CountedCondition
from course_lib.dist.wire import ABORT_TAG, HEADER, WireTimeout, byte_view, encode_header
from course_lib.dist.work import What, Work
from course_lib.i18n import _

if TYPE_CHECKING:
    from course_lib.dist.peer import Peer

INLINE_MAX = shm.MIN_BYTES  # an isend up to this size tries the socket at once


@dataclass
class Outgoing:
    """One frame on its way out: what is left of it, and whether its payload uses shm."""

    work: Work
    parts: list          # header and payload bytes still to write (both, until it starts)
    tensor: torch.Tensor  # kept referenced until its bytes are out
    slots: shm.SlotWriter | None  # how the payload goes through shared memory, if it does


class Sender:
    """Writes frames to one peer in order; the lock guards the queue and the `writing` flag."""

    def __init__(self, peer: "Peer", sock, region: shm.Region | None):
        self.peer, self.sock, self.region = peer, sock, region
        # Frames travel on the ring in shared memory when the peer reads it, else the socket.
        self.stream = (region.ring_stream(sock) if region is not None and region.ring
                       else ring.SocketStream(sock))
        self.lock = threading.Lock()  # the send lock
        self.ready = threading.Condition(self.lock)  # the sender thread waits for a queued frame
        self.idle = CountedCondition(self.lock)  # an abort waits for the writer to finish
        self.queue: deque[Outgoing] = deque()
        self.writing = False  # one writer at a time: the caller's thread or the sender thread
        self._thread: threading.Thread | None = None

    def isend(self, tensor: torch.Tensor, tag: int, name: str, deadline: float,
              blocking: bool = False) -> Work:
        """Send `tensor` after earlier sends to this peer; `blocking` writes it all here."""
        if not tensor.is_contiguous():
            tensor = tensor.contiguous()
        item = self._outgoing(tensor, tag, name, deadline)
        header, payload = item.parts
        with self.lock:
            self.peer.check_alive(name, "send to")
            if self.queue or self.writing or not (
                    blocking or len(payload) <= INLINE_MAX or item.slots is not None
                    and shm.fits_now(self.region, self.stream, len(header), len(payload))):
                return self._enqueue(item)
            self.writing = True
        try:
            self._write(item, wait=blocking)
        finally:
            self._release(item)
        return item.work

    def start_exchange(self, tensor: torch.Tensor, tag: int, name: str,
                       deadline: float) -> Exchange | None:
        """Claim the link for a contiguous `tensor` that goes through the shared-memory slots
        and write what they take now; the caller writes the rest while it receives (see
        `Exchange`). None, with nothing written, if the link is busy, the payload is not for
        the slots, or the ring has no room now for its header and doorbells (so that writing
        them never waits)."""
        if not (tensor.is_contiguous() and self._via_slots(tensor)):
            return None
        with self.lock:
            self.peer.check_alive(name, "send to")
            if self.queue or self.writing or not shm.stream_takes(self.stream, HEADER.size,
                                                                  tensor.nbytes):
                return None
            self.writing = True
        exchange = Exchange(self, self._outgoing(tensor, tag, name, deadline))
        try:
            exchange.pump()
        except BaseException:
            exchange.hand_off()
            raise
        return exchange

    def _outgoing(self, tensor: torch.Tensor, tag: int, name: str, deadline: float) -> Outgoing:
        header = encode_header(tag, tensor)
        slots = (shm.SlotWriter(self.region, self.stream, header, tensor)
                 if self._via_slots(tensor) else None)
        work = Work(deadline, What(self.peer.rank, name, "send to", self.peer.peer_rank))
        return Outgoing(work, [header, byte_view(tensor)], tensor, slots)

    def _via_slots(self, tensor: torch.Tensor) -> bool:
        return self.region is not None and tensor.nbytes > shm.MIN_BYTES

    def _release(self, item: Outgoing) -> None:
        """End the caller's turn as the writer; what is left of `item` (the socket buffer was
        full, or the slots were) goes to the sender thread, ahead of what is queued."""
        with self.lock:
            if item.parts:
                self._enqueue(item, first=True)
            self._done_writing()

    def send_now(self, tensor: torch.Tensor, tag: int, name: str) -> bool:
        """Write a small contiguous `tensor`'s frame whole on the caller's thread, with no
        request object, if the link is idle and its ring has room for the frame now; False
        (nothing written) otherwise, or on a socket, which cannot promise to take it all."""
        with self.lock:
            self.peer.check_alive(name, "send to")
            if (self.queue or self.writing or tensor.nbytes > INLINE_MAX
                    or self.stream.room() < HEADER.size + tensor.nbytes):
                return False
            self.writing = True
        try:  # all of it goes in: only this end fills the ring
            self.stream.put_frame(encode_header(tag, tensor), tensor)
        finally:
            with self.lock:
                self._done_writing()
        return True

    def _done_writing(self) -> None:
        """(send lock held) Let the next writer in: the thread if frames are queued, an abort.
        Nobody is woken when nobody needs to be: this runs after every message."""
        self.writing = False
        if self.queue:
            self.ready.notify()
        self.idle.wake()

    def _enqueue(self, item: Outgoing, first: bool = False) -> Work:
        """Queue for the sender thread (call with the send lock held)."""
        self.queue.appendleft(item) if first else self.queue.append(item)
        self.ready.notify()
        if self._thread is None:
            self._thread = self.peer.start_thread("sender", self._loop)
        return item.work

    def _write(self, item: Outgoing, wait: bool) -> None:
        """Write `item` (with wait=False only what fits now, leaving the rest in item.parts)."""
        work, name = item.work, item.work.what.name
        try:
            if item.slots is not None:
                if item.slots.write(work.deadline, wait):
                    item.parts = []
            elif wait:
                self.stream.send(item.parts, work.deadline)
                item.parts = []
            else:
                item.parts = self.stream.try_send(item.parts)
        except WireTimeout:
            # Part of a frame may be out: the stream is no longer in step, so the link is dead.
            reason = _("timed out after {seconds}s (the peer is not receiving)",
                       seconds=f"{time.monotonic() - work.started:.1f}")
            self.peer.fatal(name, "send to", reason)
            item.parts = []
            work.finish(self.peer.error(name, "send to", reason, timeout=True))
            return
        except OSError as exc:
            reason = self.peer.dead or _("connection lost ({error})",
                                         error=exc.strerror or exc)
            self.peer.fatal(name, "send to", reason)
            item.parts = []
            work.finish(self.peer.error(name, "send to", reason))
            return
        if not item.parts:
            work.finish()

    def _loop(self) -> None:
        while True:
            with self.lock:
                while (not self.queue or self.writing) and self.peer.dead is None:
                    self.ready.wait()
                if self.peer.dead is not None:
                    return
                item = self.queue.popleft()
                self.writing = True
            try:
                self._write(item, wait=True)
            finally:
                with self.lock:
                    self._done_writing()

    def send_abort(self, reason: str) -> None:
        """Best effort: tell the peer the group is dead, unless a send is stuck mid-frame."""
        payload = torch.tensor(list(reason.encode()[:4096]), dtype=torch.uint8)
        with self.lock:
            if self.peer.dead is not None or not self.idle.wait_for(
                    lambda: not self.writing, timeout=0.5):
                return
            self.writing = True
        try:
            self.stream.send([encode_header(ABORT_TAG, payload), byte_view(payload)],
                             time.monotonic() + 1.0)
        except (OSError, WireTimeout):
            pass
        finally:
            with self.lock:
                self._done_writing()

    def fail(self, reason: str) -> None:
        """Fail every queued send with `reason` and let the thread end."""
        with self.lock:
            for item in self.queue:
                item.work.finish(self.peer.error(item.work.what.name, "send to", reason))
            self.queue.clear()
            self.ready.notify_all()
            self.idle.notify_all()

    def join(self, timeout: float) -> None:
        if self._thread is not None:
            self._thread.join(timeout)


class Exchange:
    """A large send written by the thread that receives meanwhile (`Peer.sendrecv`): each time
    its receive waits, it fills whichever slots the peer has emptied. With one core per rank,
    a sender thread would compete with that receive for the core; here the two sides' copies
    take turns on it (MPI's progress engine works the same way)."""

    def __init__(self, sender: Sender, item: Outgoing):
        self.sender, self.item = sender, item
        self.pending = True  # this thread holds the link's writer role, with bytes to write

    def pump(self) -> None:
        """Write what the free slots take now, without waiting; once all is out, give the
        link back at once (another send may be waiting for it)."""
        if self.pending:
            if self.item.parts:
                self.sender._write(self.item, wait=False)
            if not self.item.parts:
                self.hand_off()

    def hand_off(self) -> None:
        """Give the link back; the sender thread writes what is left, if anything (the
        receive is about to sleep, and the peer may be waiting for this data before it sends
        its own)."""
        if self.pending:
            self.pending = False
            self.sender._release(self.item)

    def finish(self) -> None:
        """After the receive: write the rest here, waiting for slots, then wait for the send."""
        if self.pending:
            try:
                if self.item.parts:
                    self.sender._write(self.item, wait=True)
            finally:
                self.hand_off()
        self.item.work.wait()
