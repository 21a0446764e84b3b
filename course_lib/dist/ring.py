"""The byte stream a link's frames travel on: its socket, or a ring in shared memory.

Over loopback TCP a 4 KiB message pays two system calls and a wake-up by the scheduler before
any of our code runs; MPI, between processes of one host, writes into shared memory and the
receiver, polling a flag, sees it at once. `RingStream` does the same for one direction of a
link on one machine: the writer copies bytes into a ring in its shared-memory region and
advances `head`; the reader copies them out, or uses them where they lie (a header it decodes,
a payload it adds into a tensor), and only then advances `tail`. A reader waiting for `head`
spins for `SPIN_SECONDS`; waiting for the rest of a frame already begun, it then polls between
yields of its core (and of the GIL, to our own sender thread) until `YIELD_SECONDS`, and only
then sleeps: a large message's doorbells come a slot copy apart, longer than the spin, and a
reader that slept through each gap paid a wake-up for every slot (16 MiB all_reduces took
8-9 ms instead of 3 in some process pairs).
A sleeping reader is woken by one byte on the socket;
as the flag that says it sleeps and `head` are written by different processes without an
atomic instruction, a wake-up can be missed, so the reader also looks again every few
milliseconds. The socket stays what tells a dead peer (it closes) and what a shut-down link
wakes. Frames keep one order because every frame of that direction takes the ring.

`SocketStream` is the same interface over the socket alone (another machine, or no shm).
"""

from __future__ import annotations

import ctypes
import os
import platform
import select
import socket
import time
from typing import Callable, TypeVar

import torch

from course_lib.dist.errors import ProtocolError
from course_lib.dist.stream import PeerClosed, WireTimeout, byte_view, send_parts, try_send
from course_lib.dist.wire import recv_exact
from course_lib.i18n import _

T = TypeVar("T")  # what a header parser returns
SPIN_SECONDS = 50e-6  # spinning holds the GIL: long enough for a reply on its way, no more
YIELD_SECONDS = 1e-3  # then poll between yields: longer than the gap between slot doorbells
NAP_SECONDS = (0.001, 0.02)  # the sleeping reader's first and longest look-again interval


def supported() -> bool:
    """The ring relies on stores becoming visible in program order (x86's TSO), with no fences."""
    return platform.machine().lower() in ("x86_64", "amd64")


class SocketStream:
    """A link direction's frames on its socket."""

    sending = None  # an exchange's send is only ever driven from a ring's waits

    def __init__(self, sock: socket.socket):
        self.sock = sock

    def send(self, parts: list, deadline: float) -> None:
        send_parts(self.sock, parts, deadline)

    def try_send(self, parts: list) -> list:
        return try_send(self.sock, parts)

    def room(self) -> int:
        """Bytes a send is sure to take without blocking: unknown for a socket, so none."""
        return 0

    def recv_exact(self, view: memoryview, deadline: float, soon: bool = False) -> None:
        recv_exact(self.sock, view, deadline)

    def recv_parsed(self, scratch: memoryview, parse: Callable[[memoryview], T],
                    deadline: float) -> T:
        """`parse` of the next len(scratch) bytes, read into `scratch`."""
        recv_exact(self.sock, scratch, deadline)
        return parse(scratch)

    def recv_reduce(self, target: torch.Tensor, combine: Callable, deadline: float) -> None:
        reduce_through_copy(self, target, combine, deadline)


class RingStream:
    """One direction of a link through a ring in shared memory (`ctrl`: the 8-byte head, the
    8-byte tail and the reader's sleeping byte, each on its own cache line; `data`: the ring).
    The writer end writes `head`, the reader end `tail` and `sleeping`."""

    def __init__(self, sock: socket.socket, ctrl: memoryview, data: memoryview):
        self.sock, self.data, self.size = sock, data, len(data)
        self.address = ctypes.addressof(ctypes.c_char.from_buffer(data))  # for put_frame
        self.head = ctrl[0:8].cast("Q")
        self.tail = ctrl[64:72].cast("Q")
        self.sleeping = ctrl[128:129]
        # The reader's own send in an exchange (`sender.Exchange`), written while it waits.
        self.sending = None

    # --- the writer end -------------------------------------------------------------------

    def _put(self, parts: list) -> list:
        """Copy what fits now; return what is left (`parts` are bytes-like, one byte per item)."""
        head, size = self.head[0], self.size
        free = size - (head - self.tail[0])
        left = []
        for part in parts:
            n, pos = len(part), head % size
            if n <= free and pos + n <= size:  # the usual case: all of it, in one piece
                self.data[pos:pos + n] = part
                head, free = head + n, free - n
                continue
            part = memoryview(part).cast("B")
            while len(part) and free:
                pos = head % size
                n = min(len(part), free, size - pos)
                self.data[pos:pos + n] = part[:n]
                head, free, part = head + n, free - n, part[n:]
            if len(part):
                left.append(part)
        self._publish(head)
        return left

    def put_frame(self, header: bytes, tensor: torch.Tensor) -> None:
        """Write a whole frame that `room()` said fits, the payload copied straight from the
        (contiguous) tensor's memory: a small message's shortest path (no byte view)."""
        head, size, n = self.head[0], self.size, len(header)
        pos = head % size
        if pos + n + tensor.nbytes > size:  # it wraps around the ring's end
            self._put([header, byte_view(tensor)])
            return
        self.data[pos:pos + n] = header
        ctypes.memmove(self.address + pos + n, tensor.data_ptr(), tensor.nbytes)
        self._publish(head + n + tensor.nbytes)

    def _publish(self, head: int) -> None:
        self.head[0] = head  # after the bytes: the reader never sees a head ahead of them
        if self.sleeping[0]:
            self._wake()

    def _wake(self) -> None:
        try:
            self.sock.send(b"\x01", socket.MSG_DONTWAIT)
        except (BlockingIOError, InterruptedError):
            pass  # the socket is full of wake-ups already
        except OSError:
            pass  # a dead link shows when the reader reads

    def try_send(self, parts: list) -> list:
        return self._put(parts)

    def room(self) -> int:
        """Bytes a send is sure to take without blocking (only this end adds to the ring)."""
        return self.size - (self.head[0] - self.tail[0])

    def send(self, parts: list, deadline: float) -> None:
        delay = 1e-6
        parts = self._put(parts)
        while parts:
            delay = pause(self.sock, deadline, delay)
            parts = self._put(parts)

    # --- the reader end -------------------------------------------------------------------

    def recv_exact(self, view: memoryview, deadline: float, soon: bool = False) -> None:
        """Fill `view`; `soon`: the bytes are part of a frame already begun (see `_wait`)."""
        n, got = len(view), 0
        if view.format != "B":
            view = view.cast("B")
        while got < n:
            tail = self.tail[0]
            avail = self.head[0] - tail
            if not avail:
                self._wait(deadline, got, tail, soon)
                continue
            pos = tail % self.size
            k = min(n - got, avail, self.size - pos)
            view[got:got + k] = self.data[pos:pos + k]
            self.tail[0] = tail + k
            got += k

    def recv_parsed(self, scratch: memoryview, parse: Callable[[memoryview], T],
                    deadline: float) -> T:
        """`parse` of the next len(scratch) bytes (a header), read where they lie in the ring
        and only then given back to the writer; copied into `scratch` if they wrap."""
        view = self._in_place(len(scratch), deadline, soon=False)
        if view is None:
            self.recv_exact(scratch, deadline)
            return parse(scratch)
        result = parse(view)
        self.tail[0] += len(view)
        return result

    def recv_reduce(self, target: torch.Tensor, combine: Callable, deadline: float) -> None:
        """Receive a payload of `target`'s size and dtype, reduced into `target` (contiguous,
        1-D) with `combine(target, message)`: straight from the ring when the payload lies there
        in one piece, else through a temporary."""
        if target.nbytes == 0:
            return
        view = self._in_place(target.nbytes, deadline, soon=True)
        if view is None:
            return reduce_through_copy(self, target, combine, deadline)
        combine(target, torch.frombuffer(view, dtype=target.dtype))
        self.tail[0] += len(view)

    def _in_place(self, n: int, deadline: float, soon: bool) -> memoryview | None:
        """The next `n` bytes where they lie in the ring, once they have all come (None if
        they wrap around its end); the caller advances `tail` past them when done with them."""
        tail = self.tail[0]
        pos = tail % self.size
        if pos + n > self.size:
            return None
        while (head := self.head[0]) - tail < n:
            self._wait(deadline, head - tail, head, soon)
        return self.data[pos:pos + n]

    def _wait(self, deadline: float, got: int, head: int, soon: bool = False) -> None:
        """Until the writer moves `head` on from the value seen: spin briefly; if the bytes
        are `soon` to come (the rest of a frame whose writer is at work), poll while yielding
        the core (and the GIL) to whatever else runs; then sleep on the socket, looking again
        often. A reader waiting for a new frame sleeps after the spin: its peer may be busy
        for long, and a polling reader would take the core from it where cores are few.
        A reader with a send of its own in hand (`sending`) writes it while it polls, and hands
        it to the link's sender thread before it sleeps: the peer may be waiting for it."""
        start, sending = time.perf_counter(), self.sending
        while time.perf_counter() - start < SPIN_SECONDS:
            if self.head[0] != head:
                return
            if sending is not None:
                sending.pump()
        while ((soon or sending is not None and sending.pending)
               and time.perf_counter() - start < YIELD_SECONDS):
            os.sched_yield()
            if self.head[0] != head:
                return
            if sending is not None:
                sending.pump()
        if sending is not None:
            sending.hand_off()
            self.sending = None
        nap = NAP_SECONDS[0]
        self.sleeping[0] = 1
        try:
            while self.head[0] == head:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise WireTimeout(got)
                ready, _, _ = select.select([self.sock], [], [], min(nap, remaining))
                if ready:
                    self._drain_wakeups()
                nap = min(2 * nap, NAP_SECONDS[1])
        finally:
            self.sleeping[0] = 0

    def _drain_wakeups(self) -> None:
        """Read the wake-up bytes; anything else on this socket is a peer breaking protocol."""
        data = recv_now(self.sock, 4096)
        if data is not None and data.strip(b"\x01"):
            raise ProtocolError(_("bytes other than wake-ups on a shared-memory link's "
                                  "socket"))


def pause(sock: socket.socket, deadline: float, delay: float,
          poll_since: float | None = None) -> float:
    """One pause of a writer waiting for room: a yield of the core while within
    YIELD_SECONDS of `poll_since` (if given), else a sleep of `delay`, after checking the
    deadline and the peer. Returns the next delay (doubling, at most 1 ms)."""
    if poll_since is not None and time.perf_counter() - poll_since < YIELD_SECONDS:
        os.sched_yield()
        return delay
    if time.monotonic() >= deadline:
        raise WireTimeout()
    check_peer(sock)
    time.sleep(delay)
    return min(2 * delay, 1e-3)


def recv_now(sock: socket.socket, size: int, flags: int = 0) -> bytes | None:
    """Up to `size` bytes `sock` holds now (left there with MSG_PEEK in `flags`), None if it
    holds none; PeerClosed if the peer has closed it, with an end of stream or with a reset
    (a process that dies with bytes unread on its side resets the connection)."""
    try:
        data = sock.recv(size, flags | socket.MSG_DONTWAIT)
    except (BlockingIOError, InterruptedError):
        return None
    except ConnectionResetError as exc:
        raise PeerClosed(_("peer closed the connection")) from exc
    if not data:
        raise PeerClosed(_("peer closed the connection"))
    return data


def check_peer(sock: socket.socket) -> None:
    """Raise PeerClosed if the peer has closed the socket (without consuming anything)."""
    recv_now(sock, 1, socket.MSG_PEEK)


def reduce_through_copy(stream: SocketStream | RingStream, target: torch.Tensor,
                        combine: Callable[[torch.Tensor, torch.Tensor], object],
                        deadline: float) -> None:
    """Receive a payload into a temporary, then reduce it into `target`."""
    incoming = torch.empty_like(target)
    stream.recv_exact(byte_view(incoming), deadline, soon=True)
    combine(target, incoming)
