"""Lesson 01 (point-to-point): framing a tensor message, the exact read under it, and a
deadlock-free exchange. Expected values and explanations: `references/lesson01.py`."""

from __future__ import annotations

import struct

import torch

from course_lib.course.grading import RANK, WORLD_SIZE, CheckTimeout, Exercise, case, register
from course_lib.course.grading.sub_worlds import counting_messages, first_ranks_as_world
from course_lib.i18n import N_

# --- lesson01.encode_header / decode_header (local) ----------------------------------------

register(Exercise(
    name="lesson01.encode_header",
    notebook="01_point_to_point",
    params=("tag", "tensor"),
    cases=[
        case(0, torch.zeros(3, 4), label="float32 (3, 4), tag 0"),
        case(7, torch.arange(5), label="int64 (5,), tag 7"),
        case(2, torch.ones(2, 3, 1, dtype=torch.float16), label="float16 (2, 3, 1)"),
        case(1, torch.zeros(4, 2, dtype=torch.bfloat16), label="bfloat16 (4, 2): not square"),
        case(3, torch.tensor(True), label="a bool scalar (0 dims)"),
        case(9, torch.empty(0, 5, dtype=torch.uint8), label="empty uint8 (0, 5)"),
    ],
    reference="lesson01:encode_header",
    explain="lesson01:explain_encode_header",
    points=2,
    hints=("The header is the table's fields in the table's order, each as wide as its struct "
           "code says, whatever the tensor: its byte count is the payload's true size, which "
           "depends on the dtype, and its shape always fills all eight entries.",
           "For an int32 tensor of shape (2, 3, 1): dtype code 7, three dimensions, flags 0, "
           "24 payload bytes (six elements of four bytes), then the entries 2, 3, 1 and five "
           "zeros. Check the dtype and the number of dimensions before building anything."),
))


def _header(magic: int = 0x54534443, tag: int = 0, code: int = 0, ndim: int = 2, nbytes: int = 48,
            shape: tuple = (3, 4)) -> bytes:
    """A header with chosen fields, valid or not (the format of course_lib.dist.wire)."""
    shape = list(shape) + [0] * (8 - len(shape))
    return struct.pack("<IqBBHQ8q", magic, tag, code, ndim, 0, nbytes, *shape)


def decode_harness(fn, data: bytes):
    """The decoded tuple, or "rejected" if `fn` raised (any error) on a malformed header."""
    try:
        return fn(data)
    except (NotImplementedError, CheckTimeout):
        raise
    except Exception:  # noqa: BLE001 - refusing a malformed header is the expected answer
        return "rejected"


register(Exercise(
    name="lesson01.decode_header",
    notebook="01_point_to_point",
    params=("data",),
    cases=[
        case(_header(), label="float32 (3, 4)"),
        case(_header(tag=5, code=8, ndim=1, nbytes=56, shape=(7,)), label="int64 (7,), tag 5"),
        case(_header(code=3, ndim=3, nbytes=12, shape=(2, 1, 3)), label="bfloat16 (2, 1, 3)"),
        case(_header(code=9, ndim=0, nbytes=1, shape=()), label="a bool scalar"),
        case(_header(code=2, ndim=2, nbytes=0, shape=(0, 7)), label="empty float16 (0, 7)"),
        case(_header(magic=0x12345678), label="bad magic: reject"),
        case(_header(nbytes=12), label="nbytes disagrees with the shape: reject"),
        case(_header(code=200), label="unknown dtype code: reject"),
        case(_header(ndim=9), label="more than 8 dims: reject"),
        case(_header(ndim=1, nbytes=12, shape=(3, 4)), label="shape entries past ndim: reject"),
    ],
    reference="lesson01:decode_header",
    explain="lesson01:explain_decode_header",
    harness=decode_harness,
    points=2,
    hints=("Everything in the header came from the network: each field that will size an "
           "allocation is checked before it is used, and the fields must agree with each other "
           "(the byte count with the shape and the dtype). Refuse with ProtocolError.",
           "Read the fields back in the table's order. The shape is the first ndim entries; the "
           "entries after them are padding and must be zero. A tensor with no dimensions still "
           "holds one element."),
))

# --- lesson01.exchange (on the cluster) -----------------------------------------------------


def payload(rank: int, n: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """A tensor that differs by rank (exact in every dtype used here)."""
    return ((torch.arange(n) % 1000) + 1000 * (rank + 1)).to(dtype)


def summary(t) -> dict | str:
    """What comes back from the engines instead of a large tensor."""
    if not isinstance(t, torch.Tensor):
        return f"not a tensor: {type(t).__name__}"
    return {"shape": tuple(t.shape), "dtype": str(t.dtype), "head": t.reshape(-1)[:3].tolist(),
            "checksum": float(t.double().sum())}


def partner(rank: int, world_size: int, shift: int) -> int:
    """Round `shift` of a round-robin: pairs (r, (shift - r) mod p); a rank paired with itself
    sits out (one rank per round when p is odd)."""
    return (shift - rank) % world_size


def exchange_harness(fn, rank: int, world_size: int, k: int, n: int, dtype: str, shift: int):
    """On the first k ranks as a world of k: pairs of round `shift` exchange; the messages each
    rank sends and receives are counted (one each way: not a collective, not in pieces). A rank
    without a partner in this round sits out (None)."""
    peer = partner(rank, k, shift) if rank < k else rank
    if peer == rank:
        return None  # sits out this case
    mine = payload(rank, n, getattr(torch, dtype))
    before = mine.clone()
    with first_ranks_as_world(k), counting_messages() as counts:
        got = fn(mine, peer)
    return {"received": summary(got), "own tensor unchanged": bool(torch.equal(mine, before)),
            "messages sent, received": (counts["sent"], counts["received"])}


# 16 MiB of float32: more than a link's 4 MiB of shared-memory slots (or a socket's kernel
# buffers between hosts) hold, so two ranks that both send it first deadlock.
BIG = 2 ** 22

register(Exercise(
    name="lesson01.exchange",
    notebook="01_point_to_point",
    params=("tensor", "peer"),
    cases=[
        case(RANK, WORLD_SIZE, 2, 10, "float32", 1, label="2 ranks, 10 floats, pair (0, 1)"),
        case(RANK, WORLD_SIZE, 3, BIG, "float32", 1, label="3 ranks, 16 MiB, pair (0, 1)"),
        case(RANK, WORLD_SIZE, 3, 1001, "int64", 2, label="3 ranks, 1001 int64, pair (0, 2)"),
        case(RANK, WORLD_SIZE, 4, BIG, "float32", 1,
             label="4 ranks, 16 MiB, pairs (0, 1) and (2, 3) at once"),
        case(RANK, WORLD_SIZE, 4, BIG, "float32", 0, label="4 ranks, 16 MiB, pair (1, 3)"),
    ],
    reference="lesson01:exchange",
    explain="lesson01:explain_exchange",
    harness=exchange_harness,
    distributed=True,
    world_size=4,
    points=2,
    time_limit=10.0,
    hints=("A blocking send of a large tensor returns only once the other side receives it. "
           "Each send must meet a receive that its peer reaches without first waiting on this "
           "rank; when both ranks of a pair send first, neither ever reaches its receive.",
           "Break the symmetry: let the two ranks of a pair play different roles, decided by "
           "something both know, or start the receive before the send so that the transport "
           "reads while it writes. The result goes into a "
           "tensor of its own."),
))


# --- lesson01.recv_exact (on a local socket pair) ----------------------------------------------

SCENARIOS = {  # name: (pieces of the frame sent, pause between them (s), frame size, deadline)
    N_("one piece"): ([64], 0.0, 64, 2.0),
    N_("three pieces"): ([300, 400, 300], 0.05, 1000, 2.0),
    N_("larger than the socket buffer"): ([4 << 20], 0.0, 4 << 20, 5.0),
    N_("empty view"): ([], 0.0, 0, 1.0),
    N_("peer closes mid-frame"): ([10], 0.0, 40, 2.0),
    N_("peer too slow for the deadline"): ([10, 30], 1.0, 40, 0.3),
}


def recv_exact_harness(fn, scenario: str) -> dict:
    """A feeder thread writes the frame in pieces into one end of a socket pair (and always
    closes it at the end, so nothing can block forever); `fn` fills a buffer from the other."""
    import socket
    import threading
    import time

    pieces, pause, size, deadline = SCENARIOS[scenario]
    frame = bytes((i * 7 + 3) % 251 for i in range(size))
    a, b = socket.socketpair()

    def feed():
        try:
            offset = 0
            for i, n in enumerate(pieces):
                if i:
                    time.sleep(pause)
                a.sendall(frame[offset:offset + n])
                offset += n
        except OSError:
            pass  # the reader gave up and closed its end
        finally:
            a.close()

    feeder = threading.Thread(target=feed, daemon=True)
    feeder.start()
    buf = bytearray(size)
    try:
        fn(b, memoryview(buf), time.monotonic() + deadline)
        outcome = "filled"
    except (NotImplementedError, CheckTimeout):
        raise
    except Exception as exc:  # noqa: BLE001 - which error it raised is what the check compares
        outcome = f"raised {type(exc).__name__}"
    finally:
        b.close()
        feeder.join(5)
    return {"outcome": outcome, "buffer == frame": bytes(buf) == frame if outcome == "filled"
            else None}


register(Exercise(
    name="lesson01.recv_exact",
    notebook="01_point_to_point",
    params=("sock", "view", "deadline"),
    cases=[case(name, label=name) for name in SCENARIOS],
    reference="lesson01:recv_exact",
    explain="lesson01:explain_recv_exact",
    harness=recv_exact_harness,
    points=2,
    time_limit=15.0,
    hints=("The invariant: the bytes received so far fill the front of the view, and every read "
           "asks only for what is still missing and writes it where it belongs. Three things end "
           "the wait, and only they: the view is full, the peer closed, or the deadline passed.",
           "Picture a 1000-byte frame arriving as 300, 400 and 300 bytes: three reads, each one "
           "landing right after the last. The time left shrinks, so the socket's timeout is set "
           "again before every read; when the socket cuts a read off, the clock against the "
           "deadline decides between reading on and giving up."),
))
