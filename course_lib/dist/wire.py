"""What goes on the wire: the tensor frame header, exact reads and writes, the HMAC handshake.

A frame is a fixed 88-byte header (magic, tag, dtype code, ndim, nbytes, shape) followed by the
tensor's raw bytes, sent from and received into the tensor's own memory. Nothing is pickled.
"""

from __future__ import annotations

import hmac
import os
import socket
import struct
import time
import weakref
from hashlib import sha256

import torch

from course_lib.dist.errors import ProtocolError

MAGIC = 0x54534443  # "CDST"
MAX_DIMS = 8
HEADER = struct.Struct("<IqBBHQ8q")  # magic, tag, dtype, ndim, reserved, nbytes, shape[8]
ABORT_TAG = -(2 ** 63)  # a frame that says "this group is dead", its payload the reason (utf-8)

DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.uint8, torch.int8,
          torch.int16, torch.int32, torch.int64, torch.bool, torch.complex64, torch.complex128]
DTYPE_CODE = {dt: i for i, dt in enumerate(DTYPES)}


class PeerClosed(ConnectionError):
    """The other end closed the connection (EOF)."""


class WireTimeout(TimeoutError):
    """A read or write ran past its deadline; `received` bytes of it had arrived."""

    def __init__(self, received: int = 0):
        super().__init__("timed out")
        self.received = received


def encode_header(tag: int, tensor: torch.Tensor) -> bytes:
    """The header announcing `tensor` under `tag`."""
    if tensor.dtype not in DTYPE_CODE:
        raise TypeError(f"dtype {tensor.dtype} cannot be sent; supported: {DTYPES}")
    if tensor.dim() > MAX_DIMS:
        raise ValueError(f"tensors of at most {MAX_DIMS} dims can be sent, got {tensor.dim()}")
    shape = list(tensor.shape) + [0] * (MAX_DIMS - tensor.dim())
    return HEADER.pack(MAGIC, tag, DTYPE_CODE[tensor.dtype], tensor.dim(), 0,
                       tensor.numel() * tensor.element_size(), *shape)


def decode_header(data: bytes | bytearray | memoryview) -> tuple[int, torch.dtype, tuple, int]:
    """(tag, dtype, shape, nbytes) from a header; ProtocolError if it is not a valid one."""
    magic, tag, code, ndim, _, nbytes, *shape = HEADER.unpack(data)
    if magic != MAGIC:
        raise ProtocolError(f"bad magic 0x{magic:08x}")
    if tag == ABORT_TAG:
        if code != DTYPE_CODE[torch.uint8] or ndim != 1 or shape[0] != nbytes or nbytes > 4096:
            raise ProtocolError("malformed abort frame")
        return tag, torch.uint8, (nbytes,), nbytes
    if code >= len(DTYPES) or ndim > MAX_DIMS or any(s < 0 for s in shape) \
            or any(shape[ndim:]):
        raise ProtocolError(f"bad dtype code {code}, ndim {ndim} or shape {shape}")
    dtype, shape = DTYPES[code], tuple(shape[:ndim])
    numel = 1
    for s in shape:
        numel *= s
    if nbytes != numel * dtype.itemsize:
        raise ProtocolError(f"nbytes {nbytes} does not match shape {shape} of {dtype}")
    return tag, dtype, shape, nbytes


def byte_view(tensor: torch.Tensor) -> memoryview:
    """The contiguous tensor's memory as writable bytes (no copy)."""
    assert tensor.is_contiguous(), "byte_view needs a contiguous tensor"
    if tensor.numel() == 0:
        return memoryview(bytearray(0))
    return memoryview(tensor.detach().reshape(-1).view(torch.uint8).numpy())


_armed: "weakref.WeakKeyDictionary[socket.socket, dict[int, float]]" = weakref.WeakKeyDictionary()


def _set_timeout(sock: socket.socket, option: int, deadline: float) -> None:
    """Arm the kernel's SO_RCVTIMEO/SO_SNDTIMEO so a blocking call ends by `deadline`.

    The syscall is skipped while the armed value is within 10% of the time left (so a wait
    may end up to 10% early or late; `recv_exact` retries an early expiry).
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


def recv_exact(sock: socket.socket, view: memoryview, deadline: float) -> None:
    """Fill `view` from `sock` (one MSG_WAITALL call when the data flows) or raise."""
    n, got = len(view), 0
    while got < n:
        _set_timeout(sock, socket.SO_RCVTIMEO, deadline)  # WireTimeout once the deadline is past
        try:
            k = sock.recv_into(view[got:] if got else view, n - got, socket.MSG_WAITALL)
        except (BlockingIOError, TimeoutError):
            if time.monotonic() >= deadline:
                raise WireTimeout(got) from None
            continue  # the kernel's timeout was armed for an earlier, longer wait
        if k == 0:
            raise PeerClosed("peer closed the connection")
        got += k


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
            _set_timeout(sock, socket.SO_SNDTIMEO, deadline)
            parts = _skip(parts, sock.sendmsg(parts))
    except (BlockingIOError, TimeoutError):
        raise WireTimeout() from None


def send_frame(sock: socket.socket, header: bytes, view: memoryview, deadline: float) -> None:
    """Send a header and its payload."""
    send_parts(sock, [header, view], deadline)


# --- handshake: both ends prove they know the cluster's secret before any tensor moves -------

HELLO = struct.Struct("<8sII32s")  # magic, connecting rank, rank it expects to reach, nonce
HELLO_MAGIC = b"CDSTHI01"
ACK = b"\x01"


def _mac(secret: bytes, role: bytes, hello: bytes, nonce: bytes) -> bytes:
    return hmac.new(secret, role + hello + nonce, sha256).digest()


def _read(sock: socket.socket, n: int, deadline: float) -> bytes:
    buf = bytearray(n)
    recv_exact(sock, memoryview(buf), deadline)
    return bytes(buf)


def client_handshake(sock: socket.socket, secret: bytes, rank: int, peer: int,
                     deadline: float) -> None:
    """Connecting side: send hello, check the listener's proof, send ours, wait for the ack."""
    hello = HELLO.pack(HELLO_MAGIC, rank, peer, os.urandom(32))
    send_frame(sock, hello, memoryview(b""), deadline)
    reply = _read(sock, 64, deadline)
    nonce, proof = reply[:32], reply[32:]
    if not hmac.compare_digest(proof, _mac(secret, b"listener", hello, nonce)):
        raise ProtocolError(f"rank {peer} did not prove it knows the cluster secret")
    send_frame(sock, _mac(secret, b"connector", hello, nonce), memoryview(b""), deadline)
    if _read(sock, 1, deadline) != ACK:
        raise ProtocolError(f"rank {peer} did not acknowledge the handshake")


def server_handshake(sock: socket.socket, secret: bytes, rank: int, world_size: int,
                     deadline: float) -> int:
    """Listening side: check the hello and the connector's proof; return the connector's rank."""
    hello = _read(sock, HELLO.size, deadline)
    magic, peer, expected, _ = HELLO.unpack(hello)
    if magic != HELLO_MAGIC:
        raise ProtocolError(f"not a course_lib.dist hello (first bytes {hello[:8]!r})")
    if expected != rank or not 0 <= peer < world_size or peer == rank:
        raise ProtocolError(f"hello claims rank {peer} -> {expected}; this is rank {rank} "
                            f"of {world_size}")
    nonce = os.urandom(32)
    send_frame(sock, nonce + _mac(secret, b"listener", hello, nonce), memoryview(b""), deadline)
    proof = _read(sock, 32, deadline)
    if not hmac.compare_digest(proof, _mac(secret, b"connector", hello, nonce)):
        raise ProtocolError(f"connection claiming rank {peer} failed the HMAC challenge")
    send_frame(sock, ACK, memoryview(b""), deadline)
    return peer
