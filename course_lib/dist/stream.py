"""The byte stream under the frames: tensors as bytes, deadlines on a socket, and the writes.

Lesson 01 writes the frame header and the exact read (`wire.recv_exact`); this module is the
rest of what moves a frame's bytes, which no exercise asks for:

- `byte_view(tensor)`: the tensor's own memory as a writable `memoryview`, no copy, so a
  socket reads straight into a preallocated tensor and writes straight from one.
- `set_timeout(sock, option, deadline)`: every blocking call on a link's socket ends by a
  deadline. It arms the kernel's `SO_RCVTIMEO` / `SO_SNDTIMEO` (socket options: the longest
  one blocking read, or write, may wait) to the time left, and raises `WireTimeout` once the
  deadline has passed.
- `send_parts(sock, parts, deadline)`: a frame goes out as one gathering `sendmsg`: the
  kernel takes the header and the payload from their own buffers in one system call, so
  they are never joined into one bytes object first, and the small header does not leave as
  a packet of its own. A write that the kernel takes only in part goes on with the rest.
  `try_send` is the same without blocking (what fits now), for the sender thread.
- `PeerClosed`, `WireTimeout`: how a read or a write of the stream fails.
"""

from __future__ import annotations

import ctypes
import socket
import struct
import time
import weakref

import torch


class PeerClosed(ConnectionError):
    """The other end closed the connection (EOF)."""


class WireTimeout(TimeoutError):
    """A read or write ran past its deadline; `received` bytes of it had arrived."""

    def __init__(self, received: int = 0):
        super().__init__("timed out")
        self.received = received


def byte_view(tensor: torch.Tensor) -> memoryview:
    """The contiguous tensor's memory as writable bytes, no copy.

    `ctypes` (Python's bridge to C memory) wraps the tensor's address as an array of
    `nbytes` chars; the view keeps that array alive and the array the tensor. Its cost does not
    depend on the size. Not through `.numpy()`, which would mark the storage as never
    resizable again.
    """
    assert tensor.is_contiguous(), "byte_view needs a contiguous tensor"
    nbytes = tensor.numel() * tensor.element_size()
    if nbytes == 0:
        return memoryview(bytearray(0))
    raw = (ctypes.c_char * nbytes).from_address(tensor.data_ptr())
    raw.owner = tensor  # the view keeps `raw` alive, and `raw` the tensor's memory
    return memoryview(raw).cast("B")


# The timeout each socket has armed, per option; weak keys: an entry goes with its socket.
_armed: "weakref.WeakKeyDictionary[socket.socket, dict[int, float]]" = weakref.WeakKeyDictionary()


def set_timeout(sock: socket.socket, option: int, deadline: float) -> None:
    """Arm the kernel's SO_RCVTIMEO/SO_SNDTIMEO so a blocking call ends by `deadline`.

    Raises WireTimeout once `deadline` (a `time.monotonic()` value) has passed. The system call
    is skipped while the armed value is within 10% of the time left, so a wait may end up to
    10% early or late: a read cut off before the deadline is not yet a timeout.
    """
    remaining = deadline - time.monotonic()
    if remaining <= 0:
        raise WireTimeout()
    armed = _armed.setdefault(sock, {})
    if 0.9 * remaining <= armed.get(option, -1.0) <= 1.1 * remaining:
        return
    sec = int(remaining)
    usec = max(int((remaining - sec) * 1e6), 1 if sec == 0 else 0)  # 0 would mean "forever"
    sock.setsockopt(socket.SOL_SOCKET, option, struct.pack("ll", sec, usec))
    armed[option] = remaining


def _skip(parts: list, n: int) -> list[memoryview]:
    """What is left of `parts` after the first `n` bytes went out."""
    left = []
    for part in parts:
        part = memoryview(part)
        if n >= len(part):
            n -= len(part)
        else:
            left.append(part[n:])
            n = 0
    return left


def try_send(sock: socket.socket, parts: list) -> list[memoryview]:
    """Send what fits in the socket buffer right now (never blocks); returns the rest."""
    try:
        return _skip(parts, sock.sendmsg(parts, [], socket.MSG_DONTWAIT))
    except BlockingIOError:
        return parts


def send_parts(sock: socket.socket, parts: list, deadline: float) -> None:
    """Send all of `parts` (gathering sendmsg, no copy) by `deadline` or raise WireTimeout."""
    try:
        while parts:
            set_timeout(sock, socket.SO_SNDTIMEO, deadline)
            parts = _skip(parts, sock.sendmsg(parts))
    except (BlockingIOError, TimeoutError):
        raise WireTimeout() from None


def send_frame(sock: socket.socket, header: bytes, view: memoryview, deadline: float) -> None:
    """Send a header and its payload."""
    send_parts(sock, [header, view], deadline)
