"""Shared memory between two ranks on the same machine: large payloads skip the TCP stack.

Over loopback TCP every byte is copied into the kernel and out again, with the protocol's work
in between; MPI and NCCL move data between processes of one host through shared memory instead.
Here each rank maps a small region per peer that only it writes payloads into: `SLOTS` slots of
`SLOT_BYTES`. The frame's header still goes over the (authenticated) socket, marked "payload in
shared memory", followed by one doorbell byte per slot filled, naming the slot, so frames stay
in order, every wait stays a socket read with a deadline, and a dead peer still shows as a
closed socket. The receiver copies (or reduces) a slot out and clears the slot's flag; the
sender fills the lowest slot whose flag is clear, so messages that fit reuse the same few
slots, which stay in cache.

Small frames, and with them every header and doorbell, go through a ring in the same region
when both ends can use one (`ring.RingStream`: no system call and no sleep on the latency
path); the doorbells then keep their place in the ring's stream. The region's name travels over
the authenticated socket; the file is created 0600 and unlinked as soon as the peer has mapped
it (or failed to). Linux only (`/dev/shm`); elsewhere, or with COURSE_DIST_SHM=0, links stay
plain TCP (COURSE_DIST_RING=0 keeps the slots but sends frames over the socket).
"""

from __future__ import annotations

import mmap
import os
import re
import secrets
import socket
import struct
import time
from typing import Callable

import torch

from course_lib.dist import ring
from course_lib.dist.errors import ProtocolError
from course_lib.dist.stream import send_parts
from course_lib.dist.wire import FLAG_SHM, recv_exact, with_flags
from course_lib.i18n import _

SHM_DIR = "/dev/shm"
SLOTS = 4
SLOT_BYTES = 1024 * 1024
FLAG_BYTES = 64  # one flag byte per slot, padded to a cache line
CTRL_BYTES = 192  # the ring's head, tail and sleeping flag, a cache line each
RING_BYTES = 256 * 1024
SLOTS_START = FLAG_BYTES + CTRL_BYTES + RING_BYTES
REGION_BYTES = SLOTS_START + SLOTS * SLOT_BYTES
MIN_BYTES = 64 * 1024  # payloads above this go through the slots
OFFER = struct.Struct("<8s64sB")  # magic, region name (empty: none offered), ring wanted
OFFER_MAGIC = b"CDSTSHM2"
DOORBELL = 0x10  # a doorbell is one byte: this plus the index of the slot just filled
_NAME = re.compile(rb"course_lib-dist-[0-9a-f]{32}")


def enabled() -> bool:
    return os.path.isdir(SHM_DIR) and os.environ.get("COURSE_DIST_SHM", "1") != "0"


def ring_enabled() -> bool:
    return ring.supported() and os.environ.get("COURSE_DIST_RING", "1") != "0"


class Region:
    """A file in /dev/shm mapped into this process: flag bytes, then the slots."""

    def __init__(self, name: str, create: bool):
        self.name = name
        self._map = map_file(name, REGION_BYTES, create)
        # Never unmapped by hand: a thread may still be copying; the mapping goes with the object.
        self.data = torch.frombuffer(self._map, dtype=torch.uint8)
        self.ring = False  # whether this direction's frames use the ring (set by negotiate)

    def unlink(self) -> None:
        unlink(self.name)

    def slot(self, i: int, n: int) -> torch.Tensor:
        start = SLOTS_START + i * SLOT_BYTES
        return self.data[start:start + n]

    def ring_stream(self, sock: socket.socket) -> ring.RingStream:
        view = memoryview(self._map)
        return ring.RingStream(sock, view[FLAG_BYTES:FLAG_BYTES + CTRL_BYTES],
                               view[FLAG_BYTES + CTRL_BYTES:SLOTS_START])

    def busy(self, i: int) -> bool:
        return self._map[i] != 0

    def set_busy(self, i: int, busy: bool) -> None:
        self._map[i] = 1 if busy else 0


def new_name() -> str:
    """A fresh, unguessable name for a file in SHM_DIR (what `is_name` accepts)."""
    return f"course_lib-dist-{secrets.token_hex(16)}"


def is_name(name: bytes) -> bool:
    """Whether a name a peer sent is one of ours: no path, nothing else in SHM_DIR."""
    return _NAME.fullmatch(name) is not None


def map_file(name: str, nbytes: int, create: bool, writable: bool = True) -> mmap.mmap:
    """Map SHM_DIR/name, `nbytes` long, creating it (0600, exclusively) or opening a peer's,
    which must have that size; read-only unless `writable`."""
    path = os.path.join(SHM_DIR, name)
    mode = ((os.O_RDWR if writable else os.O_RDONLY) | os.O_NOFOLLOW
            | (os.O_CREAT | os.O_EXCL if create else 0))
    fd = os.open(path, mode, 0o600)
    try:
        if create:
            # Reserve the pages now: a full /dev/shm (Docker's is 64 MiB) fails here, with
            # ENOSPC, instead of killing the process with SIGBUS on its first write.
            os.posix_fallocate(fd, 0, nbytes)
        elif os.fstat(fd).st_size != nbytes:
            raise OSError(_("shared memory file {name} has the wrong size", name=name))
        # Map every page now, on both ends: a fresh link's first messages would otherwise
        # take a page fault per 4 KiB (MPI and NCCL touch their buffers at setup too).
        flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
        prot = mmap.PROT_READ | (mmap.PROT_WRITE if writable else 0)
        return mmap.mmap(fd, nbytes, flags=flags, prot=prot)
    except BaseException:
        if create:
            unlink(name)
        raise
    finally:
        os.close(fd)


def unlink(name: str) -> None:
    try:
        os.unlink(os.path.join(SHM_DIR, name))
    except FileNotFoundError:
        pass


def negotiate(sock: socket.socket, deadline: float) -> tuple[Region | None, Region | None]:
    """Offer this side's region, map the peer's if it is on this machine; (outgoing, incoming).

    Both ends run this right after the handshake; the messages are small, so sending first on
    both ends cannot block.
    """
    out = None
    if enabled():
        try:
            out = Region(new_name(), create=True)
        except OSError:
            out = None
    try:
        send_parts(sock, [OFFER.pack(OFFER_MAGIC, out.name.encode() if out else b"",
                                     ring_enabled())], deadline)
        offer = bytearray(OFFER.size)
        recv_exact(sock, memoryview(offer), deadline)
        magic, name, ring_wanted = OFFER.unpack(offer)
        if magic != OFFER_MAGIC:
            raise ProtocolError(_("bad shared-memory offer"))
        name = name.rstrip(b"\0")
        incoming = None
        if name and is_name(name) and enabled():
            try:
                incoming = Region(name.decode(), create=False)
            except OSError:
                incoming = None  # another machine, or /dev/shm unusable: TCP
        if incoming is not None:
            incoming.ring = bool(ring_wanted) and ring_enabled()
        send_parts(sock, [b"\x00" if incoming is None else b"\x02" if incoming.ring
                          else b"\x01"], deadline)
        reply = bytearray(1)
        recv_exact(sock, memoryview(reply), deadline)
    finally:
        if out is not None:
            out.unlink()
    if out is not None:
        out.ring = reply[0] == 2
    return (out if reply[0] in (1, 2) else None), incoming


def fits_now(region: Region, stream: ring.RingStream, header_bytes: int, nbytes: int) -> bool:
    """Whether an `nbytes` payload would go through the slots without waiting: the slots it
    needs are free and the stream takes its header and doorbells. Then the caller's thread can
    send it itself instead of handing it to the sender thread (a wake-up and GIL hand-off)."""
    return (stream_takes(stream, header_bytes, nbytes)
            and sum(not region.busy(i) for i in range(SLOTS)) >= _slots_for(nbytes))


def stream_takes(stream: ring.RingStream, header_bytes: int, nbytes: int) -> bool:
    """Whether `stream` takes the header and every doorbell of an `nbytes` payload now."""
    return stream.room() >= header_bytes + _slots_for(nbytes)


def _slots_for(nbytes: int) -> int:
    return -(-nbytes // SLOT_BYTES)


def _free_slot(region: Region, sock: socket.socket, deadline: float) -> int:
    """The lowest slot the peer has emptied, waiting for one if none is; a dead peer or the
    deadline ends the wait. Lowest first: a stream of messages that fit keeps reusing the
    same few slots, whose lines stay in cache, instead of cycling through the region. Like
    the ring's reader, it polls between yields of the core before it sleeps: a slot frees a
    slot's reduction later, and a sleep overshoots that by the timer's slack."""
    start, delay = time.perf_counter(), 1e-5
    while (i := _lowest_free(region)) is None:
        delay = ring.pause(sock, deadline, delay, poll_since=start)
    return i


def _lowest_free(region: Region) -> int | None:
    for i in range(SLOTS):
        if not region.busy(i):
            return i
    return None


def _bytes_of(tensor: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor's memory as a 1-D uint8 tensor (no copy)."""
    return tensor.reshape(-1).view(torch.uint8)


class SlotWriter:
    """A frame whose payload (the contiguous `tensor`) goes slot by slot through `region`; the
    header and a doorbell per slot go on `stream` (the link's socket or ring). `write` can stop
    when no slot is free and go on later, so one thread can take turns between sending a large
    message and receiving one (`sender.Exchange`)."""

    def __init__(self, region: Region, stream, header: bytes, tensor: torch.Tensor):
        self.region, self.stream = region, stream
        self.header = with_flags(header, FLAG_SHM)
        self.payload = _bytes_of(tensor)
        self.sent = -1  # payload bytes out; -1 until the header is

    def write(self, deadline: float, wait: bool = True) -> bool:
        """Send the rest, or with wait=False only what free slots take now; True when done."""
        if self.sent < 0:
            self.stream.send([self.header], deadline)
            self.sent = 0
        region, n = self.region, self.payload.numel()
        while self.sent < n:
            i = _free_slot(region, self.stream.sock, deadline) if wait else _lowest_free(region)
            if i is None:
                return False
            piece = self.payload[self.sent:self.sent + SLOT_BYTES]
            region.slot(i, piece.numel()).copy_(piece)
            region.set_busy(i, True)
            self.stream.send([bytes((DOORBELL + i,))], deadline)
            self.sent += piece.numel()
        return True


def receive(region: Region, stream: ring.RingStream, target: torch.Tensor | None, nbytes: int,
            deadline: float, combine: Callable[[torch.Tensor, torch.Tensor], object] | None = None
            ) -> None:
    """Receive a marked frame's payload into `target` (contiguous), or drop it if None; with
    `combine(target_piece, slot_piece)`, each slot is reduced into the target where it lies
    (slots hold whole elements: SLOT_BYTES is a multiple of every element size). A send that
    this thread drives meanwhile (the stream's `sending`) fills free slots before each one."""
    flat = None if target is None else target.reshape(-1)
    raw = None if target is None else _bytes_of(target)
    size = 1 if target is None else target.element_size()
    bell = bytearray(1)
    for start in range(0, nbytes, SLOT_BYTES):
        if stream.sending is not None:
            stream.sending.pump()
        stream.recv_exact(memoryview(bell), deadline, soon=True)
        i = bell[0] - DOORBELL
        if not 0 <= i < SLOTS or not region.busy(i):
            raise ProtocolError(_("bad shared-memory doorbell"))
        n = min(SLOT_BYTES, nbytes - start)
        if target is not None and combine is not None:
            combine(flat[start // size:(start + n) // size], region.slot(i, n).view(target.dtype))
        elif target is not None:
            raw[start:start + n].copy_(region.slot(i, n))
        region.set_busy(i, False)
