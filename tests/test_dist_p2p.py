"""Point-to-point on course_lib.dist: tags, ordering, non-blocking calls, mismatches, timeouts.

Reference: the exact tensors sent. All checks for a world run inside one spawned function.
"""

from __future__ import annotations

import time

import pytest
import torch

from course_lib.spawn import spawn


def p2p_checks(rank: int, world: int) -> dict:
    from course_lib import dist

    peer, out = 1 - rank, {}
    # Tags: sent 1, 2, 3; received 3, 1, 2 (the others wait, buffered, until asked for).
    if rank == 0:
        for tag in (1, 2, 3):
            dist.send(torch.full((4,), float(tag)), 1, tag=tag)
    else:
        got = {}
        for tag in (3, 1, 2):
            t = torch.empty(4)
            assert dist.recv(t, 0, tag=tag) == 0
            got[tag] = t[0].item()
        out["tags"] = got
    # Order per (peer, tag): five messages with one tag, received by irecvs posted first.
    if rank == 1:
        bufs = [torch.empty(2, dtype=torch.int64) for _ in range(5)]
        works = [dist.irecv(b, 0, tag=9) for b in bufs]
        dist.send(torch.ones(1), 0, tag=0)  # "ready"
        for w in works:
            w.wait()
        out["order"] = [int(b[0]) for b in bufs]
    else:
        dist.recv(torch.empty(1), 1, tag=0)
        works = [dist.isend(torch.tensor([i, i]), 1, tag=9) for i in range(5)]
        for w in works:
            assert w.wait() is True
    # The deadlock fix: both send 8 MiB first, but non-blocking, then receive.
    big = torch.arange(2 * 2 ** 20, dtype=torch.float32) + rank
    got = torch.empty_like(big)
    w = dist.isend(big, peer)
    dist.recv(got, peer)
    w.wait()
    out["exchange"] = torch.equal(got, torch.arange(2 * 2 ** 20, dtype=torch.float32) + peer)
    # Dtypes and shapes, including empty, 0-dim, bool, bfloat16, complex and non-contiguous.
    samples = [torch.empty(0), torch.tensor(3.5), torch.tensor([True, False, True]),
               torch.arange(6, dtype=torch.bfloat16).view(2, 3),
               torch.tensor([1 + 2j, 3 - 1j], dtype=torch.complex64),
               torch.arange(12, dtype=torch.int16).view(3, 4)]
    ok = []
    for s in samples:
        if rank == 0:
            dist.send(s, 1, tag=4)
        else:
            t = torch.empty_like(s) if s.dim() < 2 else torch.empty(s.shape[::-1], dtype=s.dtype).t()
            dist.recv(t, 0, tag=4)
            ok.append(torch.equal(t, s))
    out["dtypes"] = ok
    # Mismatch: a clear error on the receiver naming both sides; the stream stays in step.
    sent = [torch.zeros(3), torch.zeros(4), torch.zeros(2 ** 18)]
    wanted = [torch.zeros(3, dtype=torch.int64), torch.zeros(3), torch.zeros(5)]
    errors = []
    for s, w_ in zip(sent, wanted):
        if rank == 0:
            dist.send(s, 1, tag=6)
            dist.send(torch.tensor([42.0]), 1, tag=6)
        else:
            try:
                dist.recv(w_, 0, tag=6)
                errors.append("no error")
            except dist.DistError as exc:
                errors.append(str(exc))
            after = torch.empty(1)
            dist.recv(after, 0, tag=6)
            errors.append(f"next message: {after.item()}")
    out["mismatch"] = errors
    # Timeouts: a group with a 1 s timeout; nobody sends.
    quick = dist.new_group([0, 1], timeout=1.0)
    if rank == 1:
        t0 = time.monotonic()
        try:
            dist.recv(torch.empty(1), 0, group=quick, tag=3)
        except dist.DistTimeoutError as exc:
            out["timeout"] = (str(exc), time.monotonic() - t0)
        try:
            dist.irecv(torch.empty(1), 0, tag=8).wait(timeout=0.3)
        except dist.DistTimeoutError as exc:
            out["irecv_timeout"] = str(exc)
    # Bad input gets a clear error.
    bad = []
    for call in (lambda: dist.send(torch.ones(1), rank), lambda: dist.send(torch.ones(1), 5),
                 lambda: dist.send(torch.ones(1), peer, tag=-1),
                 lambda: dist.send([1.0], peer)):
        try:
            call()
            bad.append("no error")
        except (ValueError, TypeError) as exc:
            bad.append(type(exc).__name__)
    out["bad_input"] = bad
    dist.barrier()
    # Both ranks block in a 64 MiB send to each other: the classic deadlock ends in a timeout.
    stuck = dist.new_group([0, 1], timeout=2.0)
    t0 = time.monotonic()
    try:
        dist.send(torch.zeros(16 * 2 ** 20), peer, group=stuck)
        out["deadlock"] = "sent?"
    except dist.DistError as exc:
        out["deadlock"] = (str(exc), time.monotonic() - t0)
    return out


def test_point_to_point():
    r0, r1 = spawn(p2p_checks, 2, backend="scratch", timeout=120)
    assert r1["tags"] == {1: 1.0, 2: 2.0, 3: 3.0}
    assert r1["order"] == [0, 1, 2, 3, 4]
    assert r0["exchange"] and r1["exchange"]
    assert r1["dtypes"] == [True] * 6
    m = r1["mismatch"]
    assert "rank 0 sent torch.float32 [3], rank 1 expects torch.int64 [3]" in m[0], m[0]
    assert "rank 0 sent torch.float32 [4], rank 1 expects torch.float32 [3]" in m[2], m[2]
    assert "rank 0 sent torch.float32 [262144]" in m[4], m[4]
    assert all(x.startswith("rank 1: recv from rank 0 failed: message mismatch") for x in m[::2]), m
    assert m[1::2] == ["next message: 42.0"] * 3  # the mismatched payload was drained
    msg, elapsed = r1["timeout"]
    assert msg.startswith("rank 1: recv from rank 0 failed: timed out after 1."), msg
    assert 0.8 < elapsed < 5
    assert r1["irecv_timeout"].startswith("rank 1: irecv from rank 0 failed: timed out")
    assert r0["bad_input"] == ["ValueError", "ValueError", "ValueError", "TypeError"]
    for rank, r in enumerate((r0, r1)):
        msg, elapsed = r["deadlock"]
        assert msg.startswith(f"rank {rank}: send "), msg
        assert f"rank {1 - rank}" in msg and elapsed < 10, (msg, elapsed)


def test_wire_rejects_malformed_headers():
    from course_lib.dist.errors import ProtocolError
    from course_lib.dist.wire import HEADER, MAGIC, decode_header, encode_header

    t = torch.zeros(3, 4, dtype=torch.int32)
    assert decode_header(encode_header(7, t)) == (7, torch.int32, (3, 4), 48)
    bad = [b"\x80\x04" + bytes(HEADER.size - 2),  # a pickle's first bytes
           HEADER.pack(MAGIC, 0, 99, 1, 0, 4, 1, *[0] * 7),  # unknown dtype
           HEADER.pack(MAGIC, 0, 0, 9, 0, 4, *[1] * 8),  # too many dims
           HEADER.pack(MAGIC, 0, 0, 1, 0, 8, 1, *[0] * 7),  # nbytes does not match the shape
           HEADER.pack(MAGIC, 0, 0, 1, 0, 0, -1, *[0] * 7)]  # negative size
    for data in bad:
        with pytest.raises(ProtocolError):
            decode_header(data)


def test_handshake_needs_the_secret():
    import socket
    import threading

    from course_lib.dist.errors import ProtocolError
    from course_lib.dist.handshake import client_handshake, server_handshake

    def attempt(client_secret: bytes):
        a, b = socket.socketpair()
        result = {}

        def server():
            try:
                result["peer"] = server_handshake(b, b"s" * 32, 0, 2, time.monotonic() + 5)
            except (ProtocolError, OSError) as exc:  # the client hangs up on a wrong proof
                result["server_error"] = str(exc)
                b.close()

        t = threading.Thread(target=server)
        t.start()
        try:
            client_handshake(a, client_secret, 1, 0, time.monotonic() + 5)
        except (ProtocolError, OSError) as exc:
            result["client_error"] = str(exc)
        a.close()  # hang up, as a connecting rank does on a failed handshake
        t.join()
        return result

    assert attempt(b"s" * 32) == {"peer": 1}
    wrong = attempt(b"x" * 32)
    assert "did not prove it knows the cluster secret" in wrong["client_error"]
    assert "peer" not in wrong and wrong["server_error"]


def exchanges(rank: int, world: int, sizes: list[int]) -> dict:
    """`ProcessGroup.sendrecv` in place: with one partner, combined (a + b) and copied (a swap),
    and around a ring (from the left, to the right); references computed from the inputs."""
    from course_lib.dist.group import resolve

    g = resolve(None, "test")
    out = {}
    for n in sizes:  # small (written whole at once) and large (shm slots, the sender thread)
        mine = lambda r: torch.arange(n, dtype=torch.float64) * (r + 1) + r  # noqa: E731
        if world % 2 == 0:
            partner = rank ^ 1
            t = mine(rank)
            g.sendrecv(t, partner, t, partner, tag=1, name="t", combine=torch.Tensor.add_)
            out[f"sum {n}"] = torch.equal(t, mine(rank) + mine(partner))
            t = mine(rank)
            g.sendrecv(t, partner, t, partner, tag=2, name="t")
            out[f"swap {n}"] = torch.equal(t, mine(partner))
        t = mine(rank)
        left, right = (rank - 1) % world, (rank + 1) % world
        g.sendrecv(t, right, t, left, tag=3, name="t")
        out[f"shift {n}"] = torch.equal(t, mine(left))
    return out


@pytest.mark.parametrize("world,shm", [(2, "1"), (3, "1"), (4, "1"), (2, "0")])
def test_sendrecv_in_place_equals_the_exchanged_inputs(world, shm, monkeypatch):
    monkeypatch.setenv("COURSE_DIST_SHM", shm)
    for result in spawn(exchanges, world, [5, 3 << 20], backend="scratch", timeout=120):
        assert result and all(result.values()), result


def test_overlaps_sees_shared_memory_only():
    from course_lib.dist.peer import overlaps

    t = torch.arange(10.0)
    assert overlaps(t, t) and overlaps(t[:6], t[4:])
    assert not overlaps(t[:5], t[5:]) and not overlaps(t, torch.arange(10.0))
    assert overlaps(t[::2], t[1::2])  # strided views of one storage: taken as overlapping
    assert not overlaps(t[:0], t)  # nothing to overlap with
