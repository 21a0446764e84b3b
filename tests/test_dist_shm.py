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
from course_lib.spawn import SpawnError, spawn

pytestmark = pytest.mark.skipif(not shm.enabled(), reason="shared memory needs Linux /dev/shm")

BIG = 5 * 1024 * 1024 // 8  # float64 elements: more bytes than a region's slots, so they cycle


def leftover_regions() -> set[str]:
    return {n for n in os.listdir(shm.SHM_DIR) if n.startswith("course_lib-dist-")}


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
    return {"shm": (peer._shm_out is not None, peer._shm_in is not None),
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
    assert leftover_regions() <= before  # unlinked once both ends had mapped them


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
    t0 = time.monotonic()
    try:
        dist.send(torch.ones(BIG, dtype=torch.float64), 1)
        result = {"error": None}
    except dist.DistError as exc:
        result = {"error": str(exc), "type": type(exc).__name__}
    result["elapsed"] = time.monotonic() - t0
    with open(os.path.join(outdir, "rank0.json"), "w") as f:
        json.dump(result, f)


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


@pytest.fixture
def region_sized_file_elsewhere():
    """A file of exactly a region's size outside /dev/shm: mappable, were its name accepted."""
    fd, path = tempfile.mkstemp(dir="/tmp")
    os.ftruncate(fd, shm.REGION_BYTES)
    os.close(fd)
    yield os.path.relpath(path, shm.SHM_DIR).encode()
    os.unlink(path)


@pytest.mark.parametrize("kind", ["traversal", "absolute", "missing"])
def test_foreign_or_missing_region_names_fall_back_to_tcp(kind, region_sized_file_elsewhere):
    """A peer's offer is only a name matching our pattern that exists: nothing else is opened."""
    relative = region_sized_file_elsewhere
    name = {"traversal": relative,
            "absolute": os.path.normpath(os.path.join(shm.SHM_DIR.encode(), relative)),
            "missing": b"course_lib-dist-" + b"0" * 32}[kind]
    a, b = socket.socketpair()
    deadline = time.monotonic() + 5
    out: dict = {}

    def real_side() -> None:
        out["regions"] = shm.negotiate(a, deadline)

    t = threading.Thread(target=real_side)
    t.start()
    offer = bytearray(shm.OFFER.size)
    b.recv_into(offer, len(offer), socket.MSG_WAITALL)
    b.sendall(shm.OFFER.pack(shm.OFFER_MAGIC, name))
    reply_to_them = b.recv(1)
    b.sendall(b"\x00")  # "we could not map yours"
    t.join(5)
    a.close()
    b.close()
    outgoing, incoming = out["regions"]
    assert incoming is None and reply_to_them == b"\x00"
    assert outgoing is None  # refused by the other side, so not used
    assert shm.OFFER.unpack(offer)[1].rstrip(b"\0").decode() not in leftover_regions()
