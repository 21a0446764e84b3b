"""Failures on course_lib.dist: a rank that dies mid-all_reduce, intruders, malformed frames.

A dead peer must make every other rank raise (not hang) well within the group timeout, with
an error naming this rank, the operation and the dead rank; strangers on a listening port are
rejected and logged, and the group keeps computing correct results.
"""

from __future__ import annotations

import inspect
import json
import logging
import os
import pickle
import socket
import time

import pytest
import torch

from course_lib.spawn import SpawnError, spawn
from outcome import record_outcome  # tests/ is on sys.path

GROUP_TIMEOUT = 60.0


def die_mid_all_reduce(rank: int, world: int, outdir: str, victim: int) -> None:
    from course_lib import dist
    from course_lib.dist import collectives

    t = torch.ones(2 ** 18)
    dist.all_reduce(t, algorithm="ring")  # the group works...
    if rank == victim:
        def crash(*args):  # ...until the victim dies after receiving its first segment
            os._exit(17)
        collectives._REDUCERS[dist.ReduceOp.SUM] = crash  # what reduce_ and reducer call
    record_outcome(lambda: dist.all_reduce(t, algorithm="ring"), outdir, rank)


def test_dead_rank_makes_every_other_rank_raise(tmp_path):
    world, victim = 4, 2
    with pytest.raises(SpawnError) as info:
        spawn(die_mid_all_reduce, world, str(tmp_path), victim, backend="scratch",
              timeout=GROUP_TIMEOUT)
    assert set(info.value.failures) == {victim}, info.value
    for rank in set(range(world)) - {victim}:
        result = json.loads((tmp_path / f"rank{rank}.json").read_text())
        msg = result["error"]
        first, cause = msg.splitlines()
        assert first.startswith(f"all_reduce #1 (float32[262144], world) failed on rank {rank}: "
                                ), result  # the flight recorder's summary, then the cause
        assert f"rank {victim} did not answer" in first, first
        assert cause.startswith(f"  cause: rank {rank}: all_reduce(ring) "), result
        assert f"rank {victim}" in cause, msg  # names the dead peer, even if not a neighbour
        assert result["elapsed"] < GROUP_TIMEOUT / 4, result


def crash_in_native_code(rank: int, world: int, victim: int) -> int:
    import ctypes

    if rank == victim:
        ctypes.string_at(0)  # reads address 0: SIGSEGV inside C, no Python exception
    return rank


def test_a_native_crash_names_its_signal_and_its_python_stack():
    with pytest.raises(SpawnError) as info:
        spawn(crash_in_native_code, 3, 1, backend="scratch", timeout=GROUP_TIMEOUT)
    assert info.value.signals == {1: 11}, info.value
    assert set(info.value.failures) == {1}, info.value
    message = info.value.failures[1]
    assert "was killed by SIGSEGV" in message, message
    # faulthandler's report, with the line of the test's function that crashed
    assert "Fatal Python error: Segmentation fault" in message, message
    lines, first = inspect.getsourcelines(crash_in_native_code)
    line = first + next(i for i, text in enumerate(lines) if "string_at" in text)
    assert f"line {line} in crash_in_native_code" in message, message


def intruders(rank: int, world: int) -> dict:
    from course_lib import dist
    from course_lib.dist import group
    from course_lib.dist.handshake import HELLO, HELLO_MAGIC

    out = {}
    records: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: records.append(record.getMessage())
    logging.getLogger("course_lib.dist").addHandler(handler)
    transport = group._world.transport
    out["own_address"] = tuple(dist.get_address()) == tuple(transport.addresses[rank])
    dist.barrier()
    if rank == 1:
        target = transport.addresses[0]
        attempts = {
            "garbage": b"GET / HTTP/1.1\r\nHost: x\r\n\r\n" + bytes(40),
            "pickle": pickle.dumps(torch.ones(3)),
            "nothing": b"",
        }
        for name, payload in attempts.items():
            with socket.create_connection(target, timeout=5) as s:
                try:
                    s.sendall(payload)
                    s.shutdown(socket.SHUT_WR)
                    out[name] = s.recv(100)  # b"" once the listener hangs up...
                except OSError:
                    out[name] = b""  # ...or a reset, when it closed with our bytes unread
        with socket.create_connection(target, timeout=5) as s:  # a hello, then a wrong proof
            s.sendall(HELLO.pack(HELLO_MAGIC, 1, 0, os.urandom(32)))
            reply = s.recv(64, socket.MSG_WAITALL)
            s.sendall(os.urandom(32))
            out["wrong_secret"] = (len(reply), s.recv(10))
    dist.barrier()
    if rank == 0:
        deadline = time.monotonic() + 10
        while len(records) < 4 and time.monotonic() < deadline:
            time.sleep(0.05)
        out["warnings"] = list(records)
    # The group still works, with correct results.
    t = torch.arange(10, dtype=torch.float32) * (rank + 1)
    dist.all_reduce(t)
    out["all_reduce_ok"] = torch.equal(t, torch.arange(10, dtype=torch.float32) * 3)
    dist.barrier()
    # An authenticated peer that sends a malformed frame: closed, logged, and an error.
    if rank == 1:
        # On one machine frames travel in a shared-memory ring beside the socket, so garbage
        # on the socket is noticed whenever rank 0 next waits: let it finish the barrier first.
        time.sleep(0.5)
        transport.peer(0).sender.sock.sendall(pickle.dumps({"x": 1}).ljust(88, b"\0"))
        time.sleep(0.5)
    else:
        try:
            dist.recv(torch.empty(3), 1)
        except dist.DistError as exc:
            out["malformed"] = str(exc)
        out["warnings_after"] = list(records)
    return out


def test_intruders_are_rejected_and_the_group_keeps_working():
    r0, r1 = spawn(intruders, 2, backend="scratch", timeout=GROUP_TIMEOUT)
    assert r0["own_address"] and r1["own_address"]  # dist.get_address(): where intruders knock
    assert r1["garbage"] == r1["pickle"] == r1["nothing"] == b""
    assert r1["wrong_secret"] == (64, b""), r1  # the listener still answered, then hung up
    warnings = r0["warnings"]
    assert len(warnings) == 4, warnings
    assert all(w.startswith("rank 0: rejected a connection from 127.0.0.1") for w in warnings)
    assert sum("not a course_lib.dist hello" in w for w in warnings) == 2, warnings
    assert any("failed the HMAC challenge" in w for w in warnings), warnings
    assert r0["all_reduce_ok"] and r1["all_reduce_ok"]
    assert r0["malformed"].startswith("rank 0: recv from rank 1 failed: malformed frame"), r0
    assert any("malformed frame" in w for w in r0["warnings_after"])


def test_get_address_needs_an_initialized_group():
    from course_lib import dist

    with pytest.raises(RuntimeError, match="get_address: the process group is not initialized"):
        dist.get_address()
