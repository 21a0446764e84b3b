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
"""

from __future__ import annotations

import mmap
import operator
import os
import time
import warnings
import weakref
from typing import Callable

import torch

from course_lib.dist import ring, shm
from course_lib.dist.group import ProcessGroup, resolve
from course_lib.dist.wire import DTYPE_CODE, PeerClosed
from course_lib.i18n import _

HEADER_BYTES = 4096  # the counters; the data starts on a page of its own
READY, REDUCED, COPIED = 0, 8, 16  # each counter's index, in 8-byte words: a cache line apart
NAP_SECONDS = (20e-6, 250e-6)  # a waiting rank's first and longest sleep, once done polling
INFO_BYTES = 64  # what each rank tells the others at allocation: see `_info`


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
            self._wait(q, READY, seq, name)
            combine(mine, self.data[q][lo:hi])
        self.mine[REDUCED] = seq
        for q in self.others:
            self._wait(q, REDUCED, seq, name)
            self.data[me][bounds[q]:bounds[q + 1]] = self.data[q][bounds[q]:bounds[q + 1]]
        self.mine[COPIED] = seq
        for q in self.others:  # nobody reads our buffer any more once we return
            self._wait(q, COPIED, seq, name)

    def _wait(self, q: int, counter: int, seq: int, name: str) -> None:
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
                raise peer.error(name, "from", "peer closed the connection") from None
            time.sleep(nap)
            nap = min(2 * nap, NAP_SECONDS[1])


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


def shared_zeros(size: int, *, dtype: torch.dtype = torch.float32,
                 group: ProcessGroup | None = None) -> torch.Tensor:
    """A 1-D tensor of `size` zeros that every rank of `group` allocates in the same call,
    in shared memory when all of them are on this machine (an ordinary tensor otherwise, on
    every rank alike); all_reduce(algorithm="auto") on it then reads the peers' copies in
    place. Collective: every rank must pass the same size and dtype."""
    from course_lib.dist.collectives import all_gather  # collectives imports this module

    g = resolve(group, "shared_zeros")
    if isinstance(size, bool) or not hasattr(size, "__index__"):
        raise TypeError(f"shared_zeros: size is a number of elements (the buffer is 1-D), got "
                        f"{size!r}")
    size = operator.index(size)
    if size < 0 or dtype not in DTYPE_CODE:
        raise ValueError(f"shared_zeros: needs a size >= 0 and a dtype of the wire's, got "
                         f"{size} and {dtype}")
    nbytes = HEADER_BYTES + size * dtype.itemsize
    name, own = _create(g, nbytes)
    try:  # our file goes from /dev/shm on every path, once every peer has mapped it or given up
        infos = [torch.empty(INFO_BYTES, dtype=torch.uint8) for _ in range(g.size)]
        all_gather(infos, _info(name, size, dtype), group=g)
        differ = [g.ranks[i] for i, info in enumerate(infos)
                  if not torch.equal(info[1:16], infos[0][1:16])]
        if differ:
            raise ValueError(f"rank {g.transport.rank}: shared_zeros: ranks {differ} asked for a "
                             f"size or dtype other than rank {g.ranks[0]}'s ({size}, {dtype} here)")
        maps = _map_all(g, infos, nbytes, own) if size and all(int(i[0]) for i in infos) else None
        ok = torch.tensor([maps is not None], dtype=torch.uint8)
        oks = [torch.empty_like(ok) for _ in range(g.size)]
        all_gather(oks, ok, group=g)
    finally:
        if name is not None:
            shm.unlink(name)
    if maps is None or not all(int(o) for o in oks):
        return torch.zeros(size, dtype=dtype)
    buf = SharedBuffer(g, maps, size, dtype)
    tensor = buf.data[g.rank].view(size)  # another object: when the caller drops it, we forget
    g.shared[tensor.data_ptr()] = buf
    weakref.finalize(tensor, g.shared.pop, tensor.data_ptr(), None)
    return tensor


def _create(g: ProcessGroup, nbytes: int) -> tuple[str | None, mmap.mmap | None]:
    """Create and map this rank's file if sharing can work: shared memory on, and every peer
    of the group on this machine (its link has a region); (None, None) otherwise."""
    if not (g.size > 1 and shm.enabled() and ring.supported()):
        return None, None
    if any(g.transport.peer(r).kind() == "tcp" for r in g.ranks if r != g.transport.rank):
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
