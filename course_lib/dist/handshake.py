"""The handshake that opens every connection: both ends prove they know the cluster's secret.

Before a single tensor moves, the connecting rank and the listening rank each show an HMAC (a
keyed hash: only a holder of the secret can compute it) over the connection's hello and two
nonces (random numbers used once, one from each end), so a recorded handshake cannot be
replayed, and the secret itself never crosses the wire:

    connector a ── hello: magic, a, b, nonce_a ──────────────────> listener b (is it for me?)
                <── nonce_b, HMAC(secret, "listener" + hello + nonce_b)
    (checks it) ── HMAC(secret, "connector" + hello + nonce_b) ──>   (checks it)
                <── ack: the link is now a peer

Proofs are compared with `hmac.compare_digest`, in constant time, so the timing of a rejection
leaks nothing. Any failure raises `ProtocolError` and the caller closes the connection. Only
the handshake is authenticated: the frames after it are neither encrypted nor checked.
"""

from __future__ import annotations

import hmac
import os
import socket
import struct
from hashlib import sha256

from course_lib.dist.errors import ProtocolError
from course_lib.dist.stream import send_frame
from course_lib.dist.wire import recv_exact
from course_lib.i18n import _

HELLO = struct.Struct("<8sII32s")  # magic, connecting rank, rank it expects to reach, nonce
HELLO_MAGIC = b"CDSTHI01"
ACK = b"\x01"


def _mac(secret: bytes, role: bytes, hello: bytes, nonce: bytes) -> bytes:
    return hmac.new(secret, role + hello + nonce, sha256).digest()


def _read(sock: socket.socket, n: int, deadline: float) -> bytes:
    buf = bytearray(n)
    recv_exact(sock, memoryview(buf), deadline)
    return bytes(buf)


def _send(sock: socket.socket, data: bytes, deadline: float) -> None:
    send_frame(sock, data, memoryview(b""), deadline)


def client_handshake(sock: socket.socket, secret: bytes, rank: int, peer_rank: int,
                     deadline: float) -> None:
    """Connecting side: send hello, check the listener's proof, send ours, wait for the ack."""
    hello = HELLO.pack(HELLO_MAGIC, rank, peer_rank, os.urandom(32))
    _send(sock, hello, deadline)
    reply = _read(sock, 64, deadline)
    nonce, proof = reply[:32], reply[32:]
    if not hmac.compare_digest(proof, _mac(secret, b"listener", hello, nonce)):
        raise ProtocolError(_("rank {peer_rank} did not prove it knows the cluster secret",
                              peer_rank=peer_rank))
    _send(sock, _mac(secret, b"connector", hello, nonce), deadline)
    if _read(sock, 1, deadline) != ACK:
        raise ProtocolError(_("rank {peer_rank} did not acknowledge the handshake",
                              peer_rank=peer_rank))


def server_handshake(sock: socket.socket, secret: bytes, rank: int, world_size: int,
                     deadline: float) -> int:
    """Listening side: check the hello and the connector's proof; return the connector's rank."""
    hello = _read(sock, HELLO.size, deadline)
    magic, peer_rank, expected, _nonce = HELLO.unpack(hello)
    if magic != HELLO_MAGIC:
        raise ProtocolError(_("not a course_lib.dist hello (first bytes {first!r})",
                              first=hello[:8]))
    if expected != rank or not 0 <= peer_rank < world_size or peer_rank == rank:
        raise ProtocolError(_("hello claims rank {peer_rank} -> {expected}; this is rank "
                              "{rank} of {world_size}", peer_rank=peer_rank, expected=expected,
                              rank=rank, world_size=world_size))
    nonce = os.urandom(32)
    _send(sock, nonce + _mac(secret, b"listener", hello, nonce), deadline)
    proof = _read(sock, 32, deadline)
    if not hmac.compare_digest(proof, _mac(secret, b"connector", hello, nonce)):
        raise ProtocolError(_("connection claiming rank {peer_rank} failed the HMAC challenge",
                              peer_rank=peer_rank))
    _send(sock, ACK, deadline)
    return peer_rank
