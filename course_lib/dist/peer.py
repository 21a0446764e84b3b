"""One authenticated connection to one peer: a `Sender` and a `Receiver` over one socket.

How `dist.send(t, 1)` travels: `p2p.send` -> `ProcessGroup.send` -> this rank's `Peer` for
rank 1 -> `Sender.isend` writes the frame (`wire`: header, then the tensor's own bytes; through
`shm` to a rank on this machine when large). On rank 1, `Receiver.progress` reads the header,
`TagMatcher` finds the receive posted for its tag, and the payload lands in that tensor.

Lock order. A link has two locks, the receive lock (`Receiver.lock`) and the send lock
(`Sender.lock`); no thread ever holds both (`fail` takes one, releases it, then takes the
other). `Work`'s event lock is taken last, for an instant, under either.
"""

from __future__ import annotations

import socket
import threading
from typing import Callable

import torch

from course_lib.dist import shm
from course_lib.dist.errors import DistError, DistTimeoutError, describe
from course_lib.dist.matching import RecvRequest
from course_lib.dist.receiver import Receiver
from course_lib.dist.sender import Exchange, Sender
from course_lib.dist.work import Work


class Peer:
    """The link from this rank to rank `peer_rank` (global ranks); a fatal error on it is
    reported to `on_fatal`, which aborts the group (see `Transport.abort`)."""

    def __init__(self, rank: int, peer_rank: int, sock: socket.socket, timeout: float,
                 on_fatal: Callable[[int, str], None],
                 regions: tuple[shm.Region | None, shm.Region | None] = (None, None)):
        self.rank, self.peer_rank, self.timeout = rank, peer_rank, timeout
        self.dead: str | None = None  # why the link died; set once, under the receive lock
        self._on_fatal = on_fatal
        sock.settimeout(None)  # blocking; deadlines are armed per call with SO_RCVTIMEO/SNDTIMEO
        shm_out, shm_in = regions  # shared memory to and from this peer, if on this machine
        self.receiver = Receiver(self, sock, shm_in)
        # A large exchange is written by the receiving thread while it waits on the ring.
        self._exchanges = shm_in is not None and shm_in.ring
        self.sender = Sender(self, sock.dup(), shm_out)  # reader and writer each own a timeout

    def kind(self) -> str:
        """How this link carries data: "shm+ring", "shm" (large payloads) or "tcp"."""
        region = self.sender.region
        if region is None:
            return "tcp"
        return "shm+ring" if region.ring else "shm"

    def isend(self, tensor: torch.Tensor, tag: int, name: str, deadline: float,
              blocking: bool = False) -> Work:
        return self.sender.isend(tensor, tag, name, deadline, blocking)

    def irecv(self, tensor: torch.Tensor, tag: int, name: str, deadline: float) -> RecvRequest:
        return self.receiver.irecv(tensor, tag, name, deadline)

    def recv(self, tensor: torch.Tensor, tag: int, name: str, deadline: float,
             combine: Callable | None = None) -> None:
        self.receiver.recv(tensor, tag, name, deadline, combine)

    def sendrecv(self, out: torch.Tensor, into: torch.Tensor, tag: int, name: str,
                 deadline: float, combine: Callable | None = None) -> None:
        """Send `out` and receive this peer's message for `tag` into `into` (MPI_Sendrecv),
        combined into it with `combine`. `into` may share memory with `out` (a reduction in
        place): the message then waits in a temporary until our own bytes are out."""
        if out.is_contiguous() and self.sender.send_now(out, tag, name):
            self.receiver.recv(into, tag, name, deadline, combine)
            return
        if self._exchanges and not overlaps(out, into):
            exchange = self.sender.start_exchange(out, tag, name, deadline)
            if exchange is not None:
                return self._exchange(exchange, into, tag, name, deadline, combine)
        work = self.sender.isend(out, tag, name, deadline)
        if work.is_completed():
            work.wait()  # raises if the send failed
            self.receiver.recv(into, tag, name, deadline, combine)
        elif not overlaps(out, into):
            self.receiver.recv(into, tag, name, deadline, combine)
            work.wait()
        else:
            incoming = torch.empty_like(into)
            self.receiver.recv(incoming, tag, name, deadline)
            work.wait()
            combine(into, incoming) if combine is not None else into.copy_(incoming)

    def _exchange(self, exchange: Exchange, into: torch.Tensor, tag: int, name: str,
                  deadline: float, combine: Callable | None) -> None:
        """Receive on this thread while it writes `exchange`'s send (see `Exchange`)."""
        try:
            done = self.receiver.recv_direct(into, tag, name, deadline, combine, exchange)
        except BaseException:
            exchange.hand_off()
            raise
        if not done:  # someone else reads this link, or another frame came first
            exchange.hand_off()
            self.receiver.recv(into, tag, name, deadline, combine)
        exchange.finish()

    def send_abort(self, reason: str) -> None:
        self.sender.send_abort(reason)

    def start_thread(self, role: str, target: Callable[[], None]) -> threading.Thread:
        """Start this link's `role` ("sender" or "receiver") thread."""
        thread = threading.Thread(target=target, daemon=True,
                                  name=f"dist-{role}-{self.rank}-{self.peer_rank}")
        thread.start()
        return thread

    # --- errors and death ---------------------------------------------------------------

    def error(self, name: str, direction: str, reason: str, timeout: bool = False) -> DistError:
        cls = DistTimeoutError if timeout else DistError
        return cls(describe(self.rank, name, direction, self.peer_rank, reason), rank=self.rank,
                   peer_rank=self.peer_rank, operation=name)

    def check_alive(self, name: str, direction: str) -> None:
        if self.dead is not None:
            raise self.error(name, direction, self.dead)

    def fail(self, reason: str) -> None:
        """Mark the link dead: every pending and later operation raises with `reason`."""
        with self.receiver.lock:
            if self.dead is not None:
                return
            self.dead = reason
        self.receiver.fail(reason)
        self.sender.fail(reason)
        try:
            self.receiver.sock.shutdown(socket.SHUT_RDWR)  # wakes a thread blocked on it
        except OSError:
            pass

    def fatal(self, name: str, direction: str, reason: str) -> None:
        """A broken connection poisons the whole group (the other peers are told)."""
        if self.dead is None:
            self.fail(reason)
            self._on_fatal(self.peer_rank, describe(self.rank, name, direction, self.peer_rank,
                                                    reason))

    def close(self) -> None:
        """Close the connection and let the background threads end."""
        self.fail("process group destroyed")
        self.receiver.join(1.0)
        self.sender.join(1.0)
        for s in (self.receiver.sock, self.sender.sock):
            try:
                s.close()
            except OSError:
                pass


def overlaps(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two tensors may share memory (conservatively, for strided views)."""
    if a.untyped_storage().data_ptr() != b.untyped_storage().data_ptr():
        return False
    if not (a.is_contiguous() and b.is_contiguous()):
        return True
    return a.data_ptr() < b.data_ptr() + b.nbytes and b.data_ptr() < a.data_ptr() + a.nbytes
