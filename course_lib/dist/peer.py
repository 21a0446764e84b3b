"""One authenticated connection to one peer: tagged sends and receives with timeouts.

Receives are matched by tag, in posting order per tag; a message nobody has asked for yet is
kept until someone does. Whichever thread waits for a receive reads the socket itself (no
thread hop on the latency path); a background thread only drives `irecv` and queued `isend`.
Between ranks on one machine, large payloads go through shared memory (`shm`), headers still
through the socket.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from collections import deque
from datetime import timedelta
from typing import Callable

import torch

from course_lib.dist import shm
from course_lib.dist.errors import DistError, DistTimeoutError, ProtocolError, describe
from course_lib.dist.wire import (ABORT_TAG, HEADER, PeerClosed, WireTimeout, byte_view,
                                  decode_header, encode_header, recv_exact, send_frame,
                                  send_parts, try_send)

log = logging.getLogger("course_lib.dist")
INLINE_MAX = shm.MIN_BYTES  # an isend up to this size tries the socket at once, on the caller's
# thread; larger payloads go to the sender thread (and, to a rank on this machine, through shm)


def seconds(timeout: float | timedelta) -> float:
    """A timeout given as seconds or as a timedelta (torch's convention), in seconds."""
    return timeout.total_seconds() if isinstance(timeout, timedelta) else float(timeout)


_EVENT_LOCK = threading.Lock()


class Work:
    """An operation in flight; `wait()` blocks until it is done, bounded by its deadline."""

    def __init__(self, deadline: float, what: tuple[int, str, str, int | None]):
        self.deadline, self.started = deadline, time.monotonic()
        self._what = what  # (rank, op, direction, peer) for error messages
        self._done = False
        self._event: threading.Event | None = None  # made only if someone has to wait
        self._error: BaseException | None = None

    def _finish(self, error: BaseException | None = None) -> None:
        self._error = error
        with _EVENT_LOCK:
            self._done, event = True, self._event
        if event is not None:
            event.set()

    def _timeout_error(self) -> DistTimeoutError:
        rank, op, direction, peer = self._what
        reason = f"timed out after {time.monotonic() - self.started:.1f}s"
        message = (describe(rank, op, direction, peer, reason) if peer is not None
                   else f"rank {rank}: {op} failed: {reason}")
        return DistTimeoutError(message, rank=rank, peer=peer, op=op)

    def is_completed(self) -> bool:
        return self._done

    def exception(self) -> BaseException | None:
        return self._error

    def wait(self, timeout: float | timedelta | None = None) -> bool:
        """Block until done; raise the operation's error, or DistTimeoutError on expiry."""
        deadline = self.deadline if timeout is None else time.monotonic() + seconds(timeout)
        with _EVENT_LOCK:
            if not self._done and self._event is None:
                self._event = threading.Event()
            event = None if self._done else self._event
        if event is not None and not event.wait(max(0.0, deadline - time.monotonic())):
            raise self._timeout_error()
        if self._error is not None:
            raise self._error
        return True


POSTED, FILLING, DONE = range(3)


class RecvRequest(Work):
    """A posted receive: where the bytes go, and the tag they must carry."""

    def __init__(self, peer: "Peer", target: torch.Tensor, tag: int, op: str, deadline: float):
        super().__init__(deadline, (peer.rank, op, "recv from", peer.peer))
        self.peer, self.target, self.tag, self.op = peer, target, tag, op
        self.buffer = target if target.is_contiguous() else torch.empty_like(
            target, memory_format=torch.contiguous_format)
        self.state = POSTED

    def _complete(self, error: BaseException | None = None) -> None:
        if error is None and self.buffer is not self.target:
            self.target.copy_(self.buffer)
        self.state = DONE
        self._finish(error)

    def wait(self, timeout: float | timedelta | None = None) -> bool:
        deadline = self.deadline if timeout is None else time.monotonic() + seconds(timeout)
        self.peer.progress(self, deadline)
        return True


class Peer:
    """The connection from this rank to rank `peer` (global ranks)."""

    def __init__(self, rank: int, peer: int, sock: socket.socket, timeout: float,
                 on_fatal: Callable[[int, str], None],
                 regions: tuple[shm.Region | None, shm.Region | None] = (None, None)):
        self.rank, self.peer, self.timeout = rank, peer, timeout
        self._shm_out, self._shm_in = regions  # shared memory to and from this peer, if any
        sock.settimeout(None)  # blocking; deadlines are armed per call with SO_RCVTIMEO/SNDTIMEO
        self._rsock, self._wsock = sock, sock.dup()  # reader and writer each own a timeout
        self._on_fatal = on_fatal
        self.dead: str | None = None
        self._cond = threading.Condition()
        self._reading = False
        self._posted: dict[int, deque[RecvRequest]] = {}
        self._unexpected: dict[int, deque[torch.Tensor]] = {}
        self._header = memoryview(bytearray(HEADER.size))
        self._send_cond = threading.Condition()
        self._send_queue: deque = deque()
        self._writing = False
        self._recv_queue: deque[RecvRequest] = deque()
        self._threads: dict[str, threading.Thread] = {}

    # --- errors -------------------------------------------------------------------------

    def _error(self, op: str, direction: str, reason: str, timeout: bool = False) -> DistError:
        cls = DistTimeoutError if timeout else DistError
        return cls(describe(self.rank, op, direction, self.peer, reason), rank=self.rank,
                   peer=self.peer, op=op)

    def _check_alive(self, op: str, direction: str) -> None:
        if self.dead is not None:
            raise self._error(op, direction, self.dead)

    def fail(self, reason: str) -> None:
        """Mark the connection dead: every pending and later operation raises with `reason`."""
        with self._cond:
            if self.dead is not None:
                return
            self.dead = reason
            for queue in self._posted.values():
                for req in queue:
                    req._complete(self._error(req.op, "recv from", reason))
            self._posted.clear()
            self._cond.notify_all()
        with self._send_cond:
            for work, *_ in self._send_queue:
                work._finish(self._error(work._what[1], "send to", reason))
            self._send_queue.clear()
            self._send_cond.notify_all()
        try:
            self._rsock.shutdown(socket.SHUT_RDWR)  # wakes a thread blocked on this socket
        except OSError:
            pass

    def _fatal(self, op: str, direction: str, reason: str) -> None:
        """A broken connection poisons the whole group (peers are told, see Transport.abort)."""
        if self.dead is None:
            self.fail(reason)
            self._on_fatal(self.peer, describe(self.rank, op, direction, self.peer, reason))

    # --- sending ------------------------------------------------------------------------

    def isend(self, tensor: torch.Tensor, tag: int, op: str, deadline: float,
              blocking: bool = False) -> Work:
        """Send `tensor` after earlier sends to this peer.

        A small message goes out at once on this thread, as far as the socket buffer takes it
        (no thread hop on the latency path, and never a wait); the rest, and large messages,
        go to the sender thread, so that sending overlaps the caller's receives. A `blocking`
        send writes everything on this thread.
        """
        tensor = tensor.detach().contiguous()
        parts: list = [encode_header(tag, tensor), byte_view(tensor)]
        if self._shm_out is not None and len(parts[1]) > shm.MIN_BYTES:
            parts[1] = tensor  # a tensor payload: via shared memory
        work = Work(deadline, (self.rank, op, "send to", self.peer))
        with self._send_cond:
            self._check_alive(op, "send to")
            large = len(parts[1]) > INLINE_MAX and not blocking
            if self._send_queue or self._writing or large:
                return self._enqueue(work, parts, tensor)
            self._writing = True
        rest: list = []
        try:
            rest = self._write(work, parts, wait=blocking)
        finally:
            with self._send_cond:
                if rest:
                    self._enqueue(work, rest, tensor, first=True)
                self._writing = False
                self._send_cond.notify_all()
        return work

    def _enqueue(self, work: Work, parts: list, tensor: torch.Tensor,
                 first: bool = False) -> Work:
        """Queue for the sender thread (call with _send_cond held)."""
        item = (work, parts, tensor)  # the tensor stays referenced until its bytes are out
        self._send_queue.appendleft(item) if first else self._send_queue.append(item)
        self._send_cond.notify_all()
        self._ensure_thread("sender", self._sender_loop)
        return work

    def _write(self, work: Work, parts: list, wait: bool) -> list:
        """Send `parts` (with wait=False only what fits now); returns what is left.
        A payload given as a tensor rather than bytes goes through shared memory."""
        op = work._what[1]
        try:
            if isinstance(parts[-1], torch.Tensor):
                shm.send(self._shm_out, self._wsock, parts[0], parts[1], work.deadline)
                rest = []
            elif wait:
                send_parts(self._wsock, parts, work.deadline)
                rest = []
            else:
                rest = try_send(self._wsock, parts)
        except WireTimeout:
            # Part of a frame may be out: the stream is no longer in step, so the link is dead.
            reason = (f"timed out after {time.monotonic() - work.started:.1f}s "
                      "(the peer is not receiving)")
            self._fatal(op, "send to", reason)
            work._finish(self._error(op, "send to", reason, timeout=True))
            return []
        except OSError as exc:
            reason = self.dead or f"connection lost ({exc.strerror or exc})"
            self._fatal(op, "send to", reason)
            work._finish(self._error(op, "send to", reason))
            return []
        if not rest:
            work._finish()
        return rest

    def _sender_loop(self) -> None:
        while True:
            with self._send_cond:
                while (not self._send_queue or self._writing) and self.dead is None:
                    self._send_cond.wait()
                if self.dead is not None:
                    return
                work, parts, _ = self._send_queue.popleft()
                self._writing = True
            try:
                self._write(work, parts, wait=True)
            finally:
                with self._send_cond:
                    self._writing = False
                    self._send_cond.notify_all()

    def send_abort(self, reason: str) -> None:
        """Best effort: tell the peer the group is dead, unless a send is stuck mid-frame."""
        payload = torch.tensor(list(reason.encode()[:4096]), dtype=torch.uint8)
        header = bytearray(encode_header(0, payload))
        header[4:12] = ABORT_TAG.to_bytes(8, "little", signed=True)
        with self._send_cond:
            if self.dead is not None or not self._send_cond.wait_for(
                    lambda: not self._writing, timeout=0.5):
                return
            self._writing = True
        try:
            send_frame(self._wsock, bytes(header), byte_view(payload), time.monotonic() + 1.0)
        except (OSError, WireTimeout):
            pass
        finally:
            with self._send_cond:
                self._writing = False

    # --- receiving ----------------------------------------------------------------------

    def post(self, tensor: torch.Tensor, tag: int, op: str, deadline: float) -> RecvRequest:
        """Register a receive; it completes at once if the message is already here."""
        req = RecvRequest(self, tensor, tag, op, deadline)
        with self._cond:
            self._check_alive(op, "recv from")
            waiting = self._unexpected.get(tag)
            if waiting:
                msg = waiting.popleft()
                if not waiting:
                    del self._unexpected[tag]
                self._deliver(req, msg)
            else:
                self._posted.setdefault(tag, deque()).append(req)
        return req

    def irecv(self, tensor: torch.Tensor, tag: int, op: str, deadline: float) -> RecvRequest:
        """Post a receive that a background thread drives while the caller does other work."""
        req = self.post(tensor, tag, op, deadline)
        if not req.is_completed():
            with self._cond:
                self._recv_queue.append(req)
                self._cond.notify_all()
                self._ensure_thread("receiver", self._receiver_loop)
        return req

    def recv(self, tensor: torch.Tensor, tag: int, op: str, deadline: float) -> None:
        """Blocking receive on the caller's thread."""
        self.progress(self.post(tensor, tag, op, deadline), deadline)

    def _receiver_loop(self) -> None:
        while True:
            with self._cond:
                while not self._recv_queue and self.dead is None:
                    self._cond.wait()
                if self.dead is not None:
                    return
                req = self._recv_queue.popleft()
            try:
                self.progress(req, req.deadline)
            except DistError:
                pass  # the request holds the error for whoever waits on it

    def _deliver(self, req: RecvRequest, msg: torch.Tensor) -> None:
        """Complete `req` with a message that was buffered before it was posted."""
        error = self._mismatch(req, msg.dtype, tuple(msg.shape), req.tag)
        if error is None:
            req.buffer.copy_(msg)
        req._complete(error)

    def _mismatch(self, req: RecvRequest, dtype: torch.dtype, shape: tuple,
                  tag: int) -> DistError | None:
        if req.buffer.dtype == dtype and tuple(req.buffer.shape) == shape:
            return None
        return self._error(req.op, "recv from", (
            f"message mismatch (tag {tag}): rank {self.peer} sent {dtype} {list(shape)}, "
            f"rank {self.rank} expects {req.buffer.dtype} {list(req.buffer.shape)}"))

    def progress(self, req: RecvRequest, deadline: float) -> None:
        """Read messages until `req` is complete (another thread may complete it for us)."""
        while True:
            with self._cond:
                while self._reading and req.state != DONE:
                    remaining = deadline - time.monotonic()
                    if remaining <= 0 and req.state == POSTED:
                        self._expire(req)
                        break
                    self._cond.wait(remaining if remaining > 0 else 0.05)
                if req.state == DONE:
                    break
                self._reading = True
            try:
                self._read_one(req, deadline)
            finally:
                with self._cond:
                    self._reading = False
                    self._cond.notify_all()
        if req._error is not None:
            raise req._error

    def _expire(self, req: RecvRequest) -> None:
        self._posted[req.tag].remove(req)
        if not self._posted[req.tag]:
            del self._posted[req.tag]
        req._complete(self._error(req.op, "recv from", "timed out after "
                                  f"{time.monotonic() - req.started:.1f}s", timeout=True))

    def _read_one(self, req: RecvRequest, deadline: float) -> None:
        """Read one frame and hand it to its receive (or buffer it); a broken stream is fatal."""
        op, target = req.op, None
        try:
            try:
                recv_exact(self._rsock, self._header, deadline)
            except WireTimeout as exc:
                if exc.received:
                    raise
                with self._cond:
                    if req.state == POSTED:
                        self._expire(req)
                return
            tag, dtype, shape, nbytes = decode_header(self._header)
            via_shm = shm.is_marked(self._header)
            if via_shm and self._shm_in is None:
                raise ProtocolError("shared-memory frame on a link without shared memory")
            # The sender has started this frame: allow it time to finish (a full timeout if
            # the reader's own deadline is close; the same deadline saves re-arming it).
            now = time.monotonic()
            payload_deadline = deadline if deadline - now > 1.0 else now + self.timeout
            if tag == ABORT_TAG:
                text = bytearray(nbytes)
                recv_exact(self._rsock, memoryview(text), payload_deadline)
                return self._fatal(op, "recv from", "group aborted: " +
                                   text.decode("utf-8", "replace"))
            with self._cond:
                target = self._pop(tag)
                if target is not None:
                    target.state = FILLING
            if target is None:
                msg = torch.empty(shape, dtype=dtype)
                self._read_payload(msg, nbytes, via_shm, payload_deadline)
                with self._cond:
                    late = self._pop(tag)
                    if late is not None:
                        self._deliver(late, msg)
                    else:
                        self._unexpected.setdefault(tag, deque()).append(msg)
                return
            error = self._mismatch(target, dtype, shape, tag)
            self._read_payload(target.buffer if error is None else None, nbytes, via_shm,
                               payload_deadline)
            with self._cond:
                target._complete(error)
        except WireTimeout:
            self._fatal(op, "recv from", "timed out in the middle of a message")
        except PeerClosed as exc:
            self._fatal(op, "recv from", self.dead or str(exc))
        except ProtocolError as exc:
            log.warning("rank %d: closing the connection to rank %d: malformed frame (%s)",
                        self.rank, self.peer, exc)
            self._fatal(op, "recv from", f"malformed frame ({exc})")
        except OSError as exc:
            self._fatal(op, "recv from", self.dead or f"connection lost ({exc.strerror or exc})")
        if target is not None and target.state != DONE:  # it was being filled when the link died
            with self._cond:
                target._complete(self._error(target.op, "recv from", self.dead or "link lost"))

    def _pop(self, tag: int) -> RecvRequest | None:
        """The oldest receive posted for `tag`, taken off the list (None if there is none)."""
        queue = self._posted.get(tag)
        if not queue:
            return None
        req = queue.popleft()
        if not queue:
            del self._posted[tag]
        return req

    def _read_payload(self, buffer: torch.Tensor | None, nbytes: int, via_shm: bool,
                      deadline: float) -> None:
        """Read a frame's payload into `buffer` (contiguous), or drop it if None."""
        if via_shm:
            shm.receive(self._shm_in, self._rsock, buffer, nbytes, deadline)
        elif buffer is None:
            self._drain(nbytes, deadline)
        else:
            recv_exact(self._rsock, byte_view(buffer), deadline)

    def _drain(self, nbytes: int, deadline: float) -> None:
        """Read and drop a payload nobody can take, so the stream stays in step."""
        scratch = memoryview(bytearray(min(nbytes, 1 << 20)))
        while nbytes:
            n = min(nbytes, len(scratch))
            recv_exact(self._rsock, scratch[:n], deadline)
            nbytes -= n

    # --- lifecycle ----------------------------------------------------------------------

    def _ensure_thread(self, name: str, target: Callable[[], None]) -> None:
        if name not in self._threads:
            t = threading.Thread(target=target, name=f"dist-{name}-{self.rank}-{self.peer}",
                                 daemon=True)
            self._threads[name] = t
            t.start()

    def close(self) -> None:
        """Close the connection and let the background threads end."""
        self.fail("process group destroyed")
        for t in self._threads.values():
            t.join(1.0)
        for s in (self._rsock, self._wsock):
            try:
                s.close()
            except OSError:
                pass
