"""Symmetric memory: a buffer every rank of a group allocates together in shared memory.

Through the links, every byte of an all_reduce is copied twice: into a slot, then out of it
(or added from it). When every rank of the group is on this machine and the buffer itself lies
in shared memory, a rank can read its peers' buffers where they are: it adds its own chunk up
from all of them (reduce-scatter), then copies each other chunk from the rank that reduced it
(all-gather), half the memory traffic and no copy on the sender's side. MPI-3's shared-memory
windows and torch's SymmetricMemory give the same; our DDP allocates its buckets this way.

Each rank's file starts with three counters, a cache line each, that only it writes: how many
all_reduces of the buffer have their data ready, their chunk reduced, the others' chunks
copied. A rank reads a peer's memory only once the peer's counter says so, and maps its
peers' files read-only. Every wait has the group's deadline and watches the peer's link.

A group whose ranks share this machine also gets a small symmetric buffer of its own, its
`Staging`: all_reduce("auto") copies a small tensor into it and every rank adds up all the
copies itself (one-shot, torch's one_shot_all_reduce_copy; MPICH's shared-memory collectives
do the same). One copy and one wait replace lg p messages, each a frame, a doorbell and a
wake-up on the other side.
"""

from __future__ import annotations

import mmap
import os
import time
import warnings
from typing import Callable

import torch

from course_lib.dist import ring, shm
from course_lib.dist.errors import DistError, DistTimeoutError
from course_lib.dist.group import ProcessGroup
from course_lib.dist.wire import DTYPE_CODE, DTYPES, PeerClosed
from course_lib.i18n import _

HEADER_BYTES = 4096  # the counters; the data starts on a page of its own
READY, REDUCED, COPIED = 0, 8, 16  # each counter's index, in 8-byte words: a cache line apart
NAP_SECONDS = (20e-6, 250e-6)  # a waiting rank's first and longest sleep, once done polling
INFO_BYTES = 64  # what each rank tells the others at allocation: see `_info`
DESCRIBED = 24  # Staging: the word per half saying what it holds (numel, dtype), past COPIED's line
ONE_SHOT_MAX_BYTES = 256 * 1024  # all_reduce "auto" stages up to here (2 ranks: links win at 1 MiB)


class SharedBuffer:
    """This rank's view of one symmetric buffer: its own data and counters, and its peers'."""

    def __init__(self, group: ProcessGroup, maps: list, numel: int, dtype: torch.dtype):
        self.group, self.numel, self.dtype = group, numel, dtype
        self.maps = maps  # per group rank; the mappings must live as long as the tensors
        with warnings.catch_warnings():  # peers' files are read-only: torch warns, we never write
            warnings.simplefilter("ignore", UserWarning)
            self.data = [torch.frombuffer(m, dtype=dtype, count=numel, offset=HEADER_BYTES)
                         for m in maps]
        self.counters = [memoryview(m)[:HEADER_BYTES].cast("Q") for m in maps]
        self.mine = self.counters[group.rank]
        self.seq = 0
        self.bounds = split_bounds(numel, group.size)  # rank q reduces bounds[q]:bounds[q + 1]
        # The peers in the order this rank reads their chunks: each rank starts at the next one.
        self.others = [(group.rank + k) % group.size for k in range(1, group.size)]

    def all_reduce_(self, combine: Callable[[torch.Tensor, torch.Tensor], None],
                    name: str) -> None:
        """Reduce every rank's buffer into every rank's buffer, in place. After one that
        failed, the ranks' counters are out of step: later calls fail too (allocate anew)."""
        me, bounds, seq = self.group.rank, self.bounds, self.seq + 1
        self.seq = seq
        lo, hi = bounds[me], bounds[me + 1]
        mine = self.data[me][lo:hi]
        self.mine[READY] = seq
        for q in self.others:
            self.wait(q, READY, seq, name)
            combine(mine, self.data[q][lo:hi])
        self.mine[REDUCED] = seq
        for q in self.others:
            self.wait(q, REDUCED, seq, name)
            self.data[me][bounds[q]:bounds[q + 1]] = self.data[q][bounds[q]:bounds[q + 1]]
        self.mine[COPIED] = seq
        for q in self.others:  # nobody reads our buffer any more once we return
            self.wait(q, COPIED, seq, name)

    def wait(self, q: int, counter: int, seq: int, name: str) -> None:
        """Until group rank `q`'s `counter` reaches `seq`: poll, yielding the core, then sleep;
        past the group's timeout, or if `q`'s link closes, raise naming both ranks."""
        theirs = self.counters[q]
        if theirs[counter] >= seq:
            return
        start, deadline = time.perf_counter(), self.group.deadline()
        while time.perf_counter() - start < ring.YIELD_SECONDS:
            os.sched_yield()
            if theirs[counter] >= seq:
                return
        peer = self.group.transport.peer(self.group.ranks[q])
        nap = NAP_SECONDS[0]
        while theirs[counter] < seq:
            peer.check_alive(name, "from")
            if time.monotonic() >= deadline:
                raise peer.error(name, "from", _(
                    "timed out after {seconds}s (the peer has not reached this call)",
                    seconds=f"{self.group.timeout:.1f}"), timeout=True)
            try:
                ring.check_peer(peer.receiver.sock)
            except PeerClosed:
                raise peer.error(name, "from", _("peer closed the connection")) from None
            time.sleep(nap)
            nap = min(2 * nap, NAP_SECONDS[1])


class Staging:
    """A group's own symmetric buffer for small all_reduces: two halves of ONE_SHOT_MAX_BYTES,
    used by turns. Each call copies this rank's tensor into its half, says so, and once every
    peer has said so too, adds all the ranks' copies up itself in rank order (the same bits on
    every rank). Half h is written again two calls later, and a peer that has announced the call
    in between has finished reading it: one wait per call. The first call makes the buffer,
    with messages under its own tag: no collective of the group's sequence is added."""

    def __init__(self, g: ProcessGroup):
        self.group = g
        self.buf: SharedBuffer | None = None
        self.bytes: list[torch.Tensor] = []  # per rank, its two halves
        self.slots: dict[tuple, list[torch.Tensor]] = {}  # (half, numel, dtype): a view per rank
        self.issued = self.done = 0  # calls taken in call order, and finished
        self.unavailable = False  # the first call could not make the buffer, on every rank
        self.failed: str | None = None

    def take(self) -> int:
        """This call's turn, taken when it is made (in the same order on every rank)."""
        self.issued += 1
        return self.issued

    def all_reduce_(self, flat: torch.Tensor, combine: Callable[[torch.Tensor, torch.Tensor], None],
                    name: str, turn: int, tag: int) -> bool:
        """Reduce `flat` across the group in place, in pieces of a half each; False, on every
        rank alike, if there is no buffer to do it with (the caller sends messages instead)."""
        if self.done != turn - 1:
            self._wait_turn(turn, name)
        code = DTYPE_CODE.get(flat.dtype)
        if code is None:  # before any communication: every rank raises, still in step
            self.done = turn
            raise TypeError(_("rank {rank}: {name}: dtype {dtype} has no number on the wire; "
                              "supported: {dtypes}", rank=self.group.transport.rank, name=name,
                              dtype=flat.dtype, dtypes=DTYPES))
        what = flat.numel() << 8 | code
        peer = None
        try:
            if self.failed is not None:
                g = self.group
                raise DistError(_(
                    "rank {rank}: {name} failed: an earlier all_reduce through the group's "
                    "shared memory failed ({reason}); make a new group", rank=g.transport.rank,
                    name=name, reason=self.failed), rank=g.transport.rank, operation=name)
            if self.buf is None and not self._allocate(tag, name):
                return False
            step = ONE_SHOT_MAX_BYTES // flat.element_size()
            if flat.numel() <= step:  # most calls: no split (it costs some 4 us on a 12 us path)
                peer = self._one_shot(flat, what, combine, name)
            else:
                for piece in flat.split(step):
                    peer = self._one_shot(piece, what, combine, name)
                    if peer is not None:
                        break
        except BaseException as exc:
            self.failed = self.failed or str(exc)
            raise
        finally:
            self.done = turn
        if peer is not None:  # every rank saw a difference and stopped at the same call: in step
            raise self._mismatch(peer, what, flat, name)
        return True

    def _allocate(self, tag: int, name: str) -> bool:
        g = self.group
        if not self.unavailable:
            self.buf = allocate(g, 2 * ONE_SHOT_MAX_BYTES, torch.uint8, name,
                                lambda t: g.exchange(t, tag, name))
            self.unavailable = self.buf is None
        if self.buf is None:
            return False
        self.bytes = [d.view(2, ONE_SHOT_MAX_BYTES) for d in self.buf.data]
        return True

    def _wait_turn(self, turn: int, name: str) -> None:
        """Until this rank's earlier calls are done: an async one may still run on the group's
        worker thread when a blocking one comes."""
        g = self.group
        deadline = time.monotonic() + g.timeout
        while self.done < turn - 1:
            if time.monotonic() >= deadline:
                raise DistTimeoutError(_(
                    "rank {rank}: {name} failed: timed out after {seconds}s waiting for this "
                    "rank's earlier all_reduce on the group", rank=g.transport.rank, name=name,
                    seconds=f"{g.timeout:.1f}"), rank=g.transport.rank, operation=name)
            time.sleep(NAP_SECONDS[0])

    def _one_shot(self, piece: torch.Tensor, what: int,
                  combine: Callable[[torch.Tensor, torch.Tensor], None], name: str) -> int | None:
        """One half's worth; returns the group rank of a peer whose tensor differs from ours.
        Ranks add the copies up in rank order, the same bits everywhere: ranks 0 and 1 start
        from their own, as a (op) b == b (op) a bit for bit."""
        buf = self.buf
        seq = buf.seq = buf.seq + 1
        half = seq & 1
        slots = self.slots.get((half, piece.numel(), piece.dtype))
        if slots is None:
            slots = self._views(half, piece.numel(), piece.dtype)
        me = buf.group.rank
        slots[me].copy_(piece)
        buf.mine[DESCRIBED + half] = what
        buf.mine[READY] = seq
        for q in buf.others:
            buf.wait(q, READY, seq, name)
            if buf.counters[q][DESCRIBED + half] != what:
                return q
        if me > 1:
            piece.copy_(slots[0])
        combine(piece, slots[1 - me if me < 2 else 1])
        for theirs in slots[2:]:
            combine(piece, theirs)
        return None

    def _views(self, half: int, numel: int, dtype: torch.dtype) -> list[torch.Tensor]:
        nbytes = numel * dtype.itemsize
        views = [b[half, :nbytes].view(dtype) for b in self.bytes]
        if len(self.slots) >= 64:  # a few shapes recur in a training loop; bound the rest
            self.slots.clear()
        self.slots[(half, numel, dtype)] = views
        return views

    def _mismatch(self, q: int, what: int, flat: torch.Tensor, name: str) -> DistError:
        g, theirs = self.group, int(self.buf.counters[q][DESCRIBED + (self.buf.seq & 1)])
        code = theirs & 0xFF
        dtype = DTYPES[code] if code < len(DTYPES) else None
        return g.transport.peer(g.ranks[q]).error(name, "from", _(
            "tensor mismatch: rank {peer} passed {peer_numel} elements of {peer_dtype}, rank "
            "{rank} {numel} of {dtype}", peer=g.ranks[q], peer_numel=theirs >> 8,
            peer_dtype=dtype, rank=g.transport.rank, numel=flat.numel(), dtype=flat.dtype))


def may_stage(g: ProcessGroup) -> bool:
    """Whether all_reduce may go through `g`'s Staging: every rank on this machine, with shared
    memory, and the buffer made (or not yet tried). The same answer on every rank."""
    if g.staging is None:
        g.staging = Staging(g) if _local(g) else False
    return g.staging is not False and not g.staging.unavailable


def split_bounds(n: int, parts: int) -> list[int]:
    """Where `tensor_split(parts)` of `n` elements starts each part, and the end: the first
    n % parts parts one element longer."""
    base, extra = divmod(n, parts)
    return [i * base + min(i, extra) for i in range(parts + 1)]


def holds(group: ProcessGroup, tensor: torch.Tensor) -> SharedBuffer | None:
    """The symmetric buffer `tensor` is, whole, on `group`; None if it is not one."""
    buf = group.shared.get(tensor.data_ptr())
    if (buf is None or tensor.numel() != buf.numel or tensor.dtype != buf.dtype
            or not tensor.is_contiguous()):
        return None
    return buf


def allocate(g: ProcessGroup, size: int, dtype: torch.dtype, name: str,
             gather: Callable[[torch.Tensor], list[torch.Tensor]]) -> SharedBuffer | None:
    """A symmetric buffer of `size` elements on `g`, or None on every rank if any rank cannot
    share (another host, shared memory off, no space); mismatched sizes raise. Collective:
    `gather(t)` returns every rank's `t`, in group rank order."""
    nbytes = HEADER_BYTES + size * dtype.itemsize
    path, own = _create(g, nbytes)
    try:  # our file goes from /dev/shm on every path, once every peer has mapped it or given up
        infos = gather(_info(path, size, dtype))
        differ = [g.ranks[i] for i, info in enumerate(infos)
                  if not torch.equal(info[1:16], infos[0][1:16])]
        if differ:
            raise ValueError(_("rank {rank}: {name}: ranks {differ} asked for a size or dtype "
                               "other than rank {first}'s ({size}, {dtype} here)",
                               rank=g.transport.rank, name=name, differ=differ,
                               first=g.ranks[0], size=size, dtype=dtype))
        maps = _map_all(g, infos, nbytes, own) if size and all(int(i[0]) for i in infos) else None
        oks = gather(torch.tensor([maps is not None], dtype=torch.uint8))
    finally:
        if path is not None:
            shm.unlink(path)
    if maps is None or not all(int(o) for o in oks):
        return None
    return SharedBuffer(g, maps, size, dtype)


def _local(g: ProcessGroup) -> bool:
    """Whether sharing can work: shared memory on, and every peer of the group on this
    machine (its link has a region). Links agree at both ends, so every rank agrees."""
    return (g.size > 1 and shm.enabled() and ring.supported() and
            all(g.transport.peer(r).kind() != "tcp" for r in g.ranks if r != g.transport.rank))


def _create(g: ProcessGroup, nbytes: int) -> tuple[str | None, mmap.mmap | None]:
    """Create and map this rank's file if sharing can work; (None, None) otherwise."""
    if not _local(g):
        return None, None
    name = shm.new_name()
    try:
        return name, shm.map_file(name, nbytes, create=True)
    except OSError:
        return None, None


def _info(name: str | None, size: int, dtype: torch.dtype) -> torch.Tensor:
    """[ok, size (8 bytes), dtype code, 6 zero bytes, name (48 bytes)] as uint8s."""
    info = torch.zeros(INFO_BYTES, dtype=torch.uint8)
    info[0] = name is not None
    info[1:9] = torch.tensor(list(size.to_bytes(8, "little")), dtype=torch.uint8)
    info[9] = DTYPE_CODE[dtype]
    if name is not None:
        info[16:16 + len(name)] = torch.tensor(list(name.encode()), dtype=torch.uint8)
    return info


def _map_all(g: ProcessGroup, infos: list[torch.Tensor], nbytes: int,
             own: mmap.mmap) -> list | None:
    """Every rank's file: ours as `_create` mapped it, the peers' read-only; None if one of
    theirs cannot be mapped."""
    maps = []
    for i, info in enumerate(infos):
        if i == g.rank:
            maps.append(own)
            continue
        name = bytes(info[16:].tolist()).rstrip(b"\0")
        if not shm.is_name(name):
            return None
        try:
            maps.append(shm.map_file(name.decode(), nbytes, create=False, writable=False))
        except OSError:
            return None
    return maps
