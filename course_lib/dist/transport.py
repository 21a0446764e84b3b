"""The mesh of connections: a listening socket per rank, one authenticated link per pair.

Lower ranks connect to higher ones; every connection proves the cluster secret both ways
(`handshake.client_handshake` / `server_handshake`) before it becomes a `Peer`. Anything else
that reaches the listener is logged and closed, and the listener keeps accepting. Once the mesh
is up, an authenticated connection is a flight-record query (`query_record`): the listener's
thread answers it with this rank's record as JSON, whatever the rank's main thread is doing.
"""

from __future__ import annotations

import collections
import json
import logging
import os
import socket
import threading
import time
from typing import Any, Callable

import torch

from course_lib.dist import shm
from course_lib.dist.errors import DistError, DistTimeoutError, ProtocolError
from course_lib.dist.peer import Peer
from course_lib.dist.handshake import client_handshake, server_handshake
from course_lib.dist.stream import send_frame
from course_lib.dist.wire import (ABORT_TAG, HEADER, byte_view, decode_header, encode_header,
                                  recv_exact)
from course_lib.i18n import _

log = logging.getLogger("course_lib.dist")
SOCKET_BUFFER = 4 << 20  # bytes; Linux doubles it, capped by net.core.[rw]mem_max
HANDSHAKE_TIMEOUT = 10.0  # an intruder that sends nothing holds one handshake thread this long
RECORD_TAG = ABORT_TAG + 1  # the frame answering a flight-record query: JSON bytes
MAX_RECORD_BYTES = 16 << 20
PING = b"CDSTPING"  # "is this rank still listening?": answered by closing, not logged
PORTS_ENV = "COURSE_DIST_PORTS"  # "29500-29599": listen within this range (a firewall's hole)


def port_range() -> range | None:
    """The ports `COURSE_DIST_PORTS` allows ("lo-hi", inclusive), or None for any free port."""
    spec = os.environ.get(PORTS_ENV, "").strip()
    if not spec:
        return None
    try:
        lo, hi = (int(p) for p in spec.split("-"))
    except ValueError:
        lo = hi = -1
    if not 0 < lo <= hi < 65536:
        raise ValueError(_("{env} must be two ports 'lo-hi', got {spec!r}", env=PORTS_ENV,
                           spec=spec))
    return range(lo, hi + 1)


def _listening_socket(host: str, port: int) -> socket.socket:
    """A socket listening on `port`, or (port 0) on a free port of `COURSE_DIST_PORTS` if set."""
    ports = port_range() if port == 0 else None
    for candidate in ports or [port]:
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, candidate))
            sock.listen(128)  # with SO_REUSEADDR, two binds can race: listen is the test
            return sock
        except OSError:
            sock.close()
            if ports is None:
                raise
    raise OSError(_("no free port in {env}={ports} on {host}", env=PORTS_ENV,
                    ports=os.environ[PORTS_ENV], host=host))


def _tune(sock: socket.socket) -> socket.socket:
    """No Nagle delay; socket buffers big enough to hold a whole 1 MiB segment and more."""
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    for option in (socket.SO_SNDBUF, socket.SO_RCVBUF):
        sock.setsockopt(socket.SOL_SOCKET, option, SOCKET_BUFFER)
    return sock


class Listener:
    """This rank's listening socket (opened by `dist.listen` before the addresses are shared)."""

    def __init__(self, host: str = "127.0.0.1", port: int = 0):
        self.sock = _listening_socket(host, port)
        self.address: tuple[str, int] = self.sock.getsockname()[:2]
        self._thread: threading.Thread | None = None
        self._closed = False
        # the last connections turned away, "host:port: why" (the flight record shows them)
        self.rejected: collections.deque[str] = collections.deque(maxlen=16)

    def start(self, secret: bytes, rank: int, world_size: int, timeout: float,
              on_peer: Callable[[int, socket.socket, float], None]) -> None:
        """Accept in a background thread; each connection is authenticated in its own thread."""
        def handshake(conn: socket.socket, addr) -> None:
            try:
                conn.settimeout(min(timeout, HANDSHAKE_TIMEOUT))
                if conn.recv(len(PING), socket.MSG_PEEK) == PING:  # `is_listening`: no rank
                    conn.close()
                    return
                conn.settimeout(None)
                deadline = time.monotonic() + min(timeout, HANDSHAKE_TIMEOUT)
                peer_rank = server_handshake(conn, secret, rank, world_size, deadline)
                on_peer(peer_rank, _tune(conn), deadline)
            except (ProtocolError, OSError) as exc:
                self.reject(addr, str(exc) or type(exc).__name__, rank)
                conn.close()

        def accept_loop() -> None:
            while not self._closed:
                try:
                    conn, addr = self.sock.accept()
                except OSError:
                    if self._closed:
                        return
                    time.sleep(0.01)
                    continue
                threading.Thread(target=handshake, args=(conn, addr), daemon=True,
                                 name=f"dist-handshake-{rank}").start()

        self._thread = threading.Thread(target=accept_loop, daemon=True,
                                        name=f"dist-listener-{rank}")
        self._thread.start()

    def reject(self, addr: tuple, why: object, rank: int) -> None:
        """Note and log a connection turned away."""
        self.rejected.append(f"{addr[0]}:{addr[1]}: {why}")
        log.warning("rank %d: rejected a connection from %s:%s: %s", rank, *addr[:2], why)

    def close(self) -> None:
        self._closed = True
        try:
            self.sock.shutdown(socket.SHUT_RDWR)  # wakes accept()
        except OSError:
            pass
        self.sock.close()
        if self._thread is not None:
            self._thread.join(2.0)


def _connect(address: tuple[str, int], deadline: float) -> socket.socket:
    """Connect, retrying while the peer's listener is not up yet."""
    while True:
        try:
            return socket.create_connection(tuple(address),
                                            timeout=max(0.01, deadline - time.monotonic()))
        except (ConnectionRefusedError, socket.timeout):
            if time.monotonic() >= deadline:
                raise
            time.sleep(0.02)


def is_listening(address: tuple[str, int], timeout: float = 1.0) -> bool:
    """False when `address` refuses connections: the rank that listened there is gone (its
    host answered for it). Unreachable or slow is not proof of death: True."""
    try:
        with socket.create_connection(tuple(address), timeout=timeout) as sock:
            sock.sendall(PING)
    except ConnectionRefusedError:
        return False
    except OSError:
        pass
    return True


def query_record(address: tuple[str, int], secret: bytes, as_rank: int, peer_rank: int,
                 timeout: float) -> Any:
    """Ask the rank listening at `address` for its flight record (JSON, never pickled),
    proving the cluster secret as `as_rank`; None if it does not answer within `timeout`."""
    deadline = time.monotonic() + timeout
    try:
        with _connect(address, deadline) as sock:
            client_handshake(sock, secret, as_rank, peer_rank, deadline)
            header = bytearray(HEADER.size)
            recv_exact(sock, memoryview(header), deadline)
            tag, dtype, shape, nbytes = decode_header(header)
            if tag != RECORD_TAG or dtype != torch.uint8 or nbytes > MAX_RECORD_BYTES:
                raise ProtocolError(_("not a flight record (tag {tag}, {nbytes} bytes)",
                                      tag=tag, nbytes=nbytes))
            data = bytearray(nbytes)
            recv_exact(sock, memoryview(data), deadline)
            return json.loads(data)
    except (OSError, TimeoutError, ProtocolError, ValueError) as exc:
        log.info("flight record of rank %d at %s: no answer (%s)", peer_rank, address, exc)
        return None


class Transport:
    """All of this rank's peers; a fatal error on one link aborts the whole group."""

    def __init__(self, rank: int, world_size: int, addresses: list, secret: bytes,
                 timeout: float, listener: Listener):
        self.rank, self.world_size, self.timeout = rank, world_size, timeout
        self.listener, self.addresses = listener, [tuple(a) for a in addresses]
        self.peers: dict[int, Peer] = {}
        self.aborted: str | None = None
        self.secret = secret
        self.on_query: Callable[[], bytes] | None = None  # this rank's record, as JSON bytes
        self._cond = threading.Condition()
        self._ready = False
        listener.start(secret, rank, world_size, timeout, self._accepted)
        deadline = time.monotonic() + timeout
        try:
            for peer_rank in range(rank + 1, world_size):
                try:
                    sock = _connect(addresses[peer_rank], deadline)
                    client_handshake(sock, secret, rank, peer_rank, deadline)
                    self._add(peer_rank, _tune(sock), deadline)
                except (OSError, ProtocolError) as exc:
                    raise DistError(_("rank {rank}: init_process_group connect to rank "
                                      "{peer_rank} at {address} failed: {error}", rank=rank,
                                      peer_rank=peer_rank, address=addresses[peer_rank],
                                      error=str(exc) or type(exc).__name__), rank=rank,
                                    peer_rank=peer_rank, operation="init_process_group") from None
            with self._cond:
                if not self._cond.wait_for(lambda: len(self.peers) == world_size - 1,
                                           max(0.0, deadline - time.monotonic())):
                    missing = sorted(set(range(world_size)) - set(self.peers) - {rank})
                    raise DistTimeoutError(_(
                        "rank {rank}: init_process_group failed: timed out after {timeout:g}s "
                        "waiting for rank(s) {missing} to connect", rank=rank, timeout=timeout,
                        missing=missing), rank=rank,
                        peer_rank=missing[0], operation="init_process_group")
                self._ready = True
        except BaseException:
            self.close()
            raise

    def _add(self, peer_rank: int, sock: socket.socket, deadline: float) -> None:
        regions = shm.negotiate(sock, deadline)  # before the Peer's threads touch the socket
        with self._cond:
            self.peers[peer_rank] = Peer(self.rank, peer_rank, sock, self.timeout, self.abort,
                                         regions)
            self._cond.notify_all()

    def _accepted(self, peer_rank: int, sock: socket.socket, deadline: float) -> None:
        """A connection that passed the handshake: keep it if it is one we are waiting for."""
        with self._cond:
            ready = self._ready
            expected = (not ready and peer_rank < self.rank and peer_rank not in self.peers)
        if ready and self.on_query is not None:
            self._answer(sock, deadline)
            return
        if not expected:
            try:
                addr = sock.getpeername()
            except OSError:
                addr = ("?", "?")
            self.listener.reject(addr, "authenticated but unexpected, claiming "
                                 f"rank {peer_rank}", self.rank)
            sock.close()
            return
        self._add(peer_rank, sock, deadline)

    def _answer(self, sock: socket.socket, deadline: float) -> None:
        """Send this rank's flight record on a query connection, then close it."""
        try:
            data = torch.frombuffer(bytearray(self.on_query()), dtype=torch.uint8)
            send_frame(sock, encode_header(RECORD_TAG, data), byte_view(data), deadline)
        except (OSError, TimeoutError) as exc:
            log.info("rank %d: a flight-record query went unanswered: %s", self.rank, exc)
        finally:
            sock.close()

    def query(self, peer_rank: int, timeout: float) -> Any:
        """`peer_rank`'s flight record (see `query_record`), or None."""
        return query_record(self.addresses[peer_rank], self.secret, self.rank, peer_rank,
                            timeout)

    def peer(self, peer_rank: int) -> Peer:
        """The link to global rank `peer_rank`."""
        return self.peers[peer_rank]

    def abort(self, origin: int, message: str) -> None:
        """Link to `origin` broke: tell every other peer the group is dead, then fail them."""
        with self._cond:
            if self.aborted is not None:
                return
            self.aborted = message
        others = [p for r, p in self.peers.items() if r != origin and p.dead is None]
        for p in others:
            p.send_abort(message)
        for p in others:
            p.fail(f"group aborted: {message}")

    def close(self) -> None:
        self.listener.close()
        for p in list(self.peers.values()):
            p.close()
