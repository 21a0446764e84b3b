"""Shared memory between ranks on one machine: used for large payloads, results identical to the
TCP path, no file left in /dev/shm, and a dead or silent receiver still ends a send with an
error naming both ranks instead of a hang. Foreign region names are never opened."""

from __future__ import annotations

import json
import os
import socket
import tempfile
import threading
import time

import pytest
import torch

from course_lib.dist import shm
from course_lib.dist.wire import HEADER, encode_header
from course_lib.spawn import SpawnError, spawn
from outcome import record_outcome  # tests/ is on sys.path

pytestmark = pytest.mark.skipif(not shm.enabled(), reason="shared memory needs Linux /dev/shm")

BIG = 5 * 1024 * 1024 // 8  # float64 elements: more bytes than a region's slots, so they cycle


def leftover_regions() -> set[str]:
    return {n for n in os.listdir(shm.SHM_DIR) if n.startswith("course_lib-dist-")}


def none_left_since(before: set[str], within: float = 5.0) -> bool:
    """Whether every region file made since `before` is gone. Tests running beside this one
    make regions too, each unlinked a moment later: only a file that stays is a leak."""
    end = time.monotonic() + within
    while not leftover_regions() <= before:
        if time.monotonic() > end:
            return False
        time.sleep(0.05)
    return True


def exchange(rank: int, world: int) -> dict:
    """Large and small messages both ways, and an all_reduce, checked against local results."""
    from course_lib import dist
    from course_lib.dist import group

    other = 1 - rank
    peer = group._world.transport.peer(other)
    g = torch.Generator().manual_seed(rank)
    mine = torch.randn(BIG, dtype=torch.float64, generator=g)
    theirs = torch.randn(BIG, dtype=torch.float64, generator=torch.Generator().manual_seed(other))
    got = torch.empty_like(mine)
    small = torch.arange(10, dtype=torch.int64) + rank
    small_got = torch.empty_like(small)
    works = [dist.isend(mine, other), dist.isend(small, other)]
    dist.recv(got, other)
    dist.recv(small_got, other)
    for w in works:
        w.wait()
    total = mine.clone()
    dist.all_reduce(total)
    return {"shm": (peer.sender.region is not None, peer.receiver.region is not None),
            "big_equal": torch.equal(got, theirs),
            "small_equal": torch.equal(small_got, torch.arange(10) + other),
            "sum_equal": torch.equal(total, mine + theirs)}


@pytest.mark.parametrize("enabled", ["1", "0"])
def test_payloads_equal_with_and_without_shared_memory(enabled, monkeypatch):
    monkeypatch.setenv("COURSE_DIST_SHM", enabled)
    before = leftover_regions()
    results = spawn(exchange, 2, backend="scratch", timeout=60)
    for r in results:
        assert r["shm"] == ((True, True) if enabled == "1" else (False, False)), r
        assert r["big_equal"] and r["small_equal"] and r["sum_equal"], r
    assert none_left_since(before)  # unlinked once both ends had mapped them


def send_to_absent_receiver(rank: int, world: int, mode: str, outdir: str) -> None:
    """Rank 0 sends more than the slots hold; rank 1 never receives: it dies or just waits."""
    from course_lib import dist
    from course_lib.dist import group

    if rank == 1:
        if mode == "dies":
            time.sleep(0.5)
            os._exit(17)
        time.sleep(6.0)
        return
    group._world.timeout = 2.0 if mode == "silent" else 60.0
    record_outcome(lambda: dist.send(torch.ones(BIG, dtype=torch.float64), 1), outdir, 0)


def test_dead_receiver_ends_a_shared_memory_send(tmp_path):
    with pytest.raises(SpawnError) as info:
        spawn(send_to_absent_receiver, 2, "dies", str(tmp_path), backend="scratch", timeout=60)
    assert set(info.value.failures) == {1}, info.value
    r0 = json.loads((tmp_path / "rank0.json").read_text())
    assert r0["error"] and r0["error"].startswith("rank 0: send to rank 1 failed"), r0
    assert r0["elapsed"] < 10, r0


def test_silent_receiver_times_out_naming_both_ranks(tmp_path):
    spawn(send_to_absent_receiver, 2, "silent", str(tmp_path), backend="scratch", timeout=60)
    r0 = json.loads((tmp_path / "rank0.json").read_text())
    assert r0["type"] == "DistTimeoutError", r0
    assert r0["error"].startswith("rank 0: send to rank 1 failed: timed out"), r0
    assert 1.5 < r0["elapsed"] < 5.0, r0


def sends_while_the_receiver_waits(rank: int, world: int, outdir: str) -> dict:
    """Rank 0 isends one slot's worth SLOTS + 1 times, then a small message, while rank 1 reads
    nothing; rank 1 starts receiving only once rank 0 has noted which sends had completed."""
    from course_lib import dist
    from course_lib.dist import group

    sender = group._world.transport.peer(1 - rank).sender
    messages = [torch.full((shm.SLOT_BYTES // 8,), float(i), dtype=torch.float64)
                for i in range(shm.SLOTS + 1)]
    small = torch.arange(5)
    flag = os.path.join(outdir, "sent")
    if rank == 0:
        works, done, thread_before_last = [], [], None
        for i, m in enumerate(messages):
            if i == shm.SLOTS:
                thread_before_last = sender._thread is not None
            works.append(dist.isend(m, 1))
            done.append(works[-1].is_completed())
        works.append(dist.isend(small, 1))
        done.append(works[-1].is_completed())
        open(flag, "w").close()
        for w in works:
            w.wait()
        return {"done": done, "thread_before_last": thread_before_last}
    deadline = time.monotonic() + 30
    while not os.path.exists(flag) and time.monotonic() < deadline:
        time.sleep(0.01)
    got = [torch.empty_like(m) for m in messages]
    for g in got:
        dist.recv(g, 0)
    small_got = torch.empty_like(small)
    dist.recv(small_got, 0)
    return {"equal": all(torch.equal(a, b) for a, b in zip(got, messages))
            and torch.equal(small_got, small)}


@pytest.mark.parametrize("ring_on", ["1", "0"])
def test_a_large_send_leaves_on_the_callers_thread_only_when_slots_are_free(ring_on, tmp_path,
                                                                         monkeypatch):
    """While the slots last, a large isend is copied in by the caller (no hand-off to the sender
    thread); the next one, and the small one behind it, wait in order for the sender thread.
    Over the socket (no ring) a send cannot know it will not block, so every large one queues."""
    monkeypatch.setenv("COURSE_DIST_RING", ring_on)
    r0, r1 = spawn(sends_while_the_receiver_waits, 2, str(tmp_path), backend="scratch",
                   timeout=60)
    assert r1["equal"], r1
    inline = ring_on == "1" and shm.ring_enabled()
    assert r0["done"] == [inline] * shm.SLOTS + [False, False], r0
    assert r0["thread_before_last"] is (not inline), r0


def _switches(thread) -> int:
    """How many times `thread` has gone to sleep and been woken (Linux's count)."""
    with open(f"/proc/self/task/{thread.native_id}/status") as f:
        return next(int(line.split()[1]) for line in f
                    if line.startswith("voluntary_ctxt_switches"))


def wakes_of_idle_threads(rank: int, world: int) -> dict:
    """Start both link threads (a large isend that queues, an irecv), let them go idle, then run
    small all_reduces and exchanges: how often each idle thread was woken meanwhile."""
    from course_lib import dist
    from course_lib.dist import group

    peer = group._world.transport.peer(1 - rank)
    big = torch.ones(3 * shm.SLOTS * shm.SLOT_BYTES // 4)
    work = dist.isend(big, 1 - rank, tag=4)  # more than the slots take now: the sender thread
    dist.recv(torch.empty_like(big), 1 - rank, tag=4)
    work.wait()
    dist.irecv(torch.empty(3), 1 - rank, tag=5).wait() if rank == 0 else dist.send(
        torch.ones(3), 0, tag=5)  # an irecv: the receiver thread
    time.sleep(0.2)
    threads = {"sender": peer.sender._thread, "receiver": peer.receiver._thread}
    before = {k: _switches(t) for k, t in threads.items() if t is not None}
    small = torch.ones(1024)
    for _ in range(200):
        dist.all_reduce(small)
        dist.barrier()
    return {k: _switches(threads[k]) - v for k, v in before.items()}


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="counts Linux's switches")
def test_small_messages_do_not_wake_the_links_idle_threads():
    """The latency path has no thread hand-off: once a link's sender and receiver threads
    have nothing to do, 400 small collectives wake neither of them."""
    r0, r1 = spawn(wakes_of_idle_threads, 2, backend="scratch", timeout=120)
    assert set(r0) == {"sender", "receiver"} and set(r1) == {"sender"}, (r0, r1)
    assert all(n <= 2 for n in [*r0.values(), *r1.values()]), (r0, r1)  # before: 700-800


class BytePipe:
    """A frame stream in one process: what `send` writes, `recv_exact` reads back (a
    `SlotWriter` writes its frame's header first: `send_payload` drops it, as the receiver has
    read it before it calls `shm.receive`)."""

    sending = None  # no send of this thread's own to write while it reads

    def __init__(self):
        self.data = bytearray()
        self.sock = None  # only a wait for a slot looks at it, and no test here waits

    def room(self) -> int:
        return 1 << 20

    def send(self, parts: list, deadline: float) -> None:
        for part in parts:
            self.data += bytes(part)

    def recv_exact(self, view: memoryview, deadline: float, soon: bool = False) -> None:
        view[:] = self.data[:len(view)]
        del self.data[:len(view)]

    def send_payload(self, region: shm.Region, tensor: torch.Tensor) -> list[int]:
        """Write a frame through `region`'s slots; the doorbells it rang (its header dropped)."""
        start = len(self.data)
        shm.SlotWriter(region, self, encode_header(0, tensor), tensor).write(time.monotonic() + 5)
        del self.data[start:start + HEADER.size]
        return list(self.data[start:])


def _exchange_inputs(rank: int, salt: int) -> torch.Tensor:
    """A message of more bytes than a region's slots hold (an odd count), as rank `rank`'s."""
    n = 3 * shm.SLOTS * shm.SLOT_BYTES // 8 + 5
    return torch.randn(n, dtype=torch.float64,
                       generator=torch.Generator().manual_seed(10 * rank + salt))


def exchanges_on_the_receiving_thread(rank: int, world: int) -> dict:
    """Large `ProcessGroup.sendrecv`s both ways, reduced and copied, with every wait polling
    (never handing its send off): the results, and whether the link's sender thread started."""
    from course_lib import dist
    from course_lib.dist import group, ring

    ring.YIELD_SECONDS = 60.0  # no receive here waits that long to hand its send off
    g, other, make = group.resolve(None, "test"), 1 - rank, _exchange_inputs
    into = make(rank, 1)
    g.sendrecv(make(rank, 2), other, into, other, tag=1, name="t", combine=torch.Tensor.add_)
    out = {"sum": torch.equal(into, make(rank, 1) + make(other, 2))}
    g.sendrecv(make(rank, 3), other, into, other, tag=2, name="t")
    out["copy"] = torch.equal(into, make(other, 3))
    out["sender thread started"] = g.transport.peer(other).sender._thread is not None
    dist.barrier()  # every slot of ours has been read: a two-slot send goes out at once
    sender = g.transport.peer(other).sender
    small = torch.full((shm.SLOT_BYTES // 4,), float(rank + 1), dtype=torch.float64)
    exchange = sender.start_exchange(small, 6, "t", g.deadline())
    out["link free once all is out"] = not exchange.pending and not sender.writing
    got = torch.empty_like(small)
    g.recv(got, other, tag=6, name="t")
    exchange.finish()
    out["copy"] &= bool((got == other + 1).all())
    return out


def test_a_large_exchange_is_written_by_the_receiving_thread():
    """A large sendrecv on one host needs no sender thread: the thread that receives fills
    the slots the peer has emptied each time it waits, and the result is exact."""
    for result in spawn(exchanges_on_the_receiving_thread, 2, backend="scratch", timeout=30):
        assert result == {"sum": True, "copy": True, "sender thread started": False,
                          "link free once all is out": True}, result


def large_all_reduces(rank: int, world: int) -> dict:
    """all_reduce of more bytes than a region's slots hold, by every algorithm, against the
    sum computed here from every rank's input (integers in float64: exact in any order)."""
    from course_lib import dist

    def make(r: int) -> torch.Tensor:
        return _exchange_inputs(r, 7).mul_(1000).round_()

    want = sum(make(r) for r in range(world))
    out = {}
    for algorithm in ("rabenseifner", "tree", "ring", "auto"):
        t = make(rank)
        dist.all_reduce(t, algorithm=algorithm)
        out[algorithm] = torch.equal(t, want)
    return out


@pytest.mark.parametrize("world", [2, 3, 4])
def test_large_all_reduces_equal_the_sum_on_2_to_4_ranks(world):
    """Large exchanges inside every algorithm, powers of two or not (3 ranks fold one in)."""
    for result in spawn(large_all_reduces, world, backend="scratch", timeout=120):
        assert all(result.values()), result


def exchanges_that_cannot_take_turns(rank: int, world: int) -> dict:
    """Rank 0's large sendrecv against a rank that receives all of it before it sends, then
    behind a large send still queued for the sender thread; checked against the inputs."""
    from course_lib.dist import group

    g, make = group.resolve(None, "test"), _exchange_inputs
    into, first = torch.empty_like(make(0, 0)), torch.empty_like(make(0, 0))
    if rank == 0:
        g.sendrecv(make(0, 4), 1, into, 1, tag=3, name="t")
        out = {"peer receives first": torch.equal(into, make(1, 4))}
        work = g.isend(make(0, 5), 1, tag=4, name="t")
        g.sendrecv(make(0, 6), 1, into, 1, tag=5, name="t")
        work.wait()
        out["behind a queued send"] = torch.equal(into, make(1, 6))
        return out
    time.sleep(0.3)  # rank 0 has filled its slots and its receive has gone to sleep
    g.recv(into, 0, tag=3, name="t")
    g.send(make(1, 4), 0, tag=3, name="t")
    out = {"peer receives first": torch.equal(into, make(0, 4))}
    time.sleep(0.3)  # rank 0's sender thread has filled the slots and waits, mid-frame
    g.recv(first, 0, tag=4, name="t")
    g.sendrecv(make(1, 6), 0, into, 0, tag=5, name="t")
    out["behind a queued send"] = torch.equal(first, make(0, 5)) and torch.equal(into, make(0, 6))
    return out


def test_a_large_exchange_completes_when_the_peer_cannot_take_turns():
    """MPI_Sendrecv's promise: it completes against a plain receive then send. The exchange
    hands its send to the sender thread before its receive sleeps (else rank 1 would wait for
    bytes rank 0 only writes once it has received); a send already queued goes out first."""
    for result in spawn(exchanges_that_cannot_take_turns, 2, backend="scratch", timeout=30):
        assert result == {"peer receives first": True, "behind a queued send": True}, result


@pytest.fixture
def region_pair():
    """One direction of a link inside this process: the writer's region and the reader's map."""
    out = shm.Region(f"course_lib-dist-{os.urandom(16).hex()}", create=True)
    try:
        yield out, shm.Region(out.name, create=False)
    finally:
        out.unlink()


def test_messages_that_fit_reuse_the_lowest_free_slots_named_in_their_doorbells(region_pair):
    """A slot once emptied is the next one filled (its lines still in cache), and the receiver
    takes each slot from the doorbell, not from a count of its own."""
    out, incoming = region_pair
    pipe, deadline = BytePipe(), time.monotonic() + 5
    one = torch.arange(shm.SLOT_BYTES // 8, dtype=torch.float64)
    for k in range(3):  # each received before the next is sent: always slot 0
        assert pipe.send_payload(out, one + k) == [shm.DOORBELL]
        got = torch.empty_like(one)
        shm.receive(incoming, pipe, got, one.nbytes, deadline)
        assert torch.equal(got, one + k)
    assert pipe.send_payload(out, one) == [shm.DOORBELL]  # slot 0 full, not yet received
    two = torch.arange(2 * one.numel(), dtype=torch.float64)
    assert pipe.send_payload(out, two) == [shm.DOORBELL + 1, shm.DOORBELL + 2]
    first, second = torch.empty_like(one), torch.zeros_like(two)
    shm.receive(incoming, pipe, first, one.nbytes, deadline)
    shm.receive(incoming, pipe, second, two.nbytes, deadline, combine=torch.Tensor.add_)
    assert torch.equal(first, one) and torch.equal(second, two)
    assert not any(out.busy(i) for i in range(shm.SLOTS))


@pytest.mark.parametrize("bell", ["empty slot", "out of range"])
def test_a_doorbell_naming_a_slot_not_filled_is_a_protocol_error(region_pair, bell):
    out, incoming = region_pair
    pipe = BytePipe()
    pipe.data.append(shm.DOORBELL + (3 if bell == "empty slot" else shm.SLOTS))
    with pytest.raises(shm.ProtocolError, match="doorbell"):
        shm.receive(incoming, pipe, torch.empty(8), 64, time.monotonic() + 5)


@pytest.mark.parametrize("yield_seconds, sleeps", [(5.0, False), (0.0, True)])
def test_a_sender_polls_for_a_free_slot_before_it_sleeps(region_pair, monkeypatch,
                                                         yield_seconds, sleeps):
    """A sender waiting for a slot polls between yields of its core (a slot frees a reduction
    later, and a sleep would overshoot that); only past YIELD_SECONDS does it sleep. Here the
    receiver frees slot 2 of four full ones 30 ms later either way."""
    from course_lib.dist import ring

    out, _ = region_pair
    naps = []
    monkeypatch.setattr(ring, "YIELD_SECONDS", yield_seconds)
    monkeypatch.setattr(shm.time, "sleep", lambda s: naps.append(s) or time.perf_counter())
    for i in range(shm.SLOTS):
        out.set_busy(i, True)
    freer = threading.Timer(0.03, lambda: out.set_busy(2, False))
    a, b = socket.socketpair()
    try:
        freer.start()
        assert shm._free_slot(out, a, time.monotonic() + 5) == 2
    finally:
        freer.join()
        a.close()
        b.close()
    assert bool(naps) is sleeps, naps


@pytest.fixture
def region_sized_file_elsewhere():
    """A file of exactly a region's size outside /dev/shm: mappable, were its name accepted."""
    fd, path = tempfile.mkstemp(dir="/tmp")
    os.ftruncate(fd, shm.REGION_BYTES)
    os.close(fd)
    yield os.path.relpath(path, shm.SHM_DIR).encode()
    os.unlink(path)


def negotiate_with_fake_peer(offer_name: bytes) -> tuple[tuple, bytes, bytes]:
    """Run our side of `negotiate` against a peer that offers `offer_name` and says it could
    not map ours; returns (our regions, the name we offered, our reply)."""
    a, b = socket.socketpair()
    out: dict = {}
    t = threading.Thread(target=lambda: out.update(regions=shm.negotiate(a, time.monotonic() + 5)))
    t.start()
    ours = bytearray(shm.OFFER.size)
    b.recv_into(ours, len(ours), socket.MSG_WAITALL)
    b.sendall(shm.OFFER.pack(shm.OFFER_MAGIC, offer_name, 1))
    reply = b.recv(1)
    b.sendall(b"\x00")
    t.join(5)
    a.close()
    b.close()
    return out["regions"], shm.OFFER.unpack(ours)[1].rstrip(b"\0"), reply


@pytest.mark.parametrize("kind", ["traversal", "absolute", "missing"])
def test_foreign_or_missing_region_names_fall_back_to_tcp(kind, region_sized_file_elsewhere):
    """A peer's offer is only a name matching our pattern that exists: nothing else is opened."""
    relative = region_sized_file_elsewhere
    name = {"traversal": relative,
            "absolute": os.path.normpath(os.path.join(shm.SHM_DIR.encode(), relative)),
            "missing": b"course_lib-dist-" + b"0" * 32}[kind]
    (outgoing, incoming), ours, reply = negotiate_with_fake_peer(name)
    assert incoming is None and reply == b"\x00"
    assert outgoing is None  # refused by the other side, so not used
    assert ours.decode() not in leftover_regions()


def test_full_dev_shm_falls_back_to_tcp_and_leaves_no_file(monkeypatch):
    """Docker's /dev/shm is 64 MiB: when it is full, the link is plain TCP (no SIGBUS later)."""
    def full(fd, offset, length):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(shm.os, "posix_fallocate", full)
    before = leftover_regions()
    (outgoing, incoming), ours, _ = negotiate_with_fake_peer(b"")
    assert outgoing is None and incoming is None and ours == b""  # nothing offered
    assert none_left_since(before)
