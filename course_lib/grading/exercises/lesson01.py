"""Lesson 01 (point-to-point): framing a tensor message; a deadlock-free exchange."""

from __future__ import annotations

import struct

import torch

from course_lib.grading import RANK, WORLD_SIZE, CheckTimeout, Exercise, case, register

# --- lesson01.encode_header / decode_header (local) ----------------------------------------


def _encode_reference(tag: int, tensor: torch.Tensor) -> bytes:
    from course_lib.dist.wire import encode_header

    return encode_header(tag, tensor)


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
    reference=_encode_reference,
    points=2,
    hints=("HEADER.pack(MAGIC, tag, DTYPE_CODE[tensor.dtype], tensor.dim(), 0, nbytes, *shape): "
          "nbytes = numel * element_size (not 4 for every dtype), shape in order, padded with "
          "zeros to MAX_DIMS entries.",),
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


def _decode_reference(data: bytes):
    from course_lib.dist.wire import decode_header

    return decode_harness(decode_header, data)


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
    reference=_decode_reference,
    harness=decode_harness,
    points=2,
    hints=("Unpack with HEADER, check the magic, the dtype code (< len(DTYPES)), ndim <= MAX_DIMS, "
          "that shape entries past ndim are 0, and nbytes == numel * dtype.itemsize; return "
          "(tag, dtype, shape[:ndim] as a tuple, nbytes).",),
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
    rank sends and receives are counted (one each way: not a collective, not in pieces)."""
    from course_lib.grading.sub_worlds import counting_messages, first_ranks_as_world

    peer = partner(rank, k, shift) if rank < k else rank
    if peer == rank:
        return "sits out"
    mine = payload(rank, n, getattr(torch, dtype))
    before = mine.clone()
    with first_ranks_as_world(k), counting_messages() as counts:
        got = fn(mine, peer)
    return {"received": summary(got), "own tensor unchanged": bool(torch.equal(mine, before)),
            "messages sent, received": (counts["sent"], counts["received"])}


def _exchange_reference(rank: int, world_size: int, k: int, n: int, dtype: str, shift: int):
    peer = partner(rank, k, shift) if rank < k else rank
    if peer == rank:
        return "sits out"
    return {"received": summary(payload(peer, n, getattr(torch, dtype))),
            "own tensor unchanged": True, "messages sent, received": (1, 1)}


BIG = 2 ** 23  # 32 MiB of float32: more than the kernel buffers a socket, so order matters

register(Exercise(
    name="lesson01.exchange",
    notebook="01_point_to_point",
    params=("tensor", "peer"),
    cases=[
        case(RANK, WORLD_SIZE, 2, 10, "float32", 1, label="2 ranks, 10 floats, pair (0, 1)"),
        case(RANK, WORLD_SIZE, 3, BIG, "float32", 1, label="3 ranks, 32 MiB, pair (0, 1)"),
        case(RANK, WORLD_SIZE, 3, 1001, "int64", 2, label="3 ranks, 1001 int64, pair (0, 2)"),
        case(RANK, WORLD_SIZE, 4, BIG, "float32", 1,
             label="4 ranks, 32 MiB, pairs (0, 1) and (2, 3) at once"),
        case(RANK, WORLD_SIZE, 4, BIG, "float32", 0, label="4 ranks, 32 MiB, pair (1, 3)"),
    ],
    reference=_exchange_reference,
    harness=exchange_harness,
    distributed=True,
    world_size=4,
    points=2,
    time_limit=10.0,
    hints=("Both ranks sending a large tensor first deadlock: neither receives. Let the lower "
          "rank send first and the higher receive first, or post dist.irecv and dist.isend and "
          "wait on both. Receive into a new tensor (torch.empty_like) and return it.",),
))


# --- lesson01.recv_exact (on a local socket pair) ----------------------------------------------

_SCENARIOS = {  # name: (pieces of the frame sent, pause between them (s), frame size, deadline)
    "one piece": ([64], 0.0, 64, 2.0),
    "three pieces": ([300, 400, 300], 0.05, 1000, 2.0),
    "larger than the socket buffer": ([4 << 20], 0.0, 4 << 20, 5.0),
    "empty view": ([], 0.0, 0, 1.0),
    "peer closes mid-frame": ([10], 0.0, 40, 2.0),
    "peer too slow for the deadline": ([10, 30], 1.0, 40, 0.3),
}


def recv_exact_harness(fn, scenario: str) -> dict:
    """A feeder thread writes the frame in pieces into one end of a socket pair (and always
    closes it at the end, so nothing can block forever); `fn` fills a buffer from the other."""
    import socket
    import threading
    import time

    pieces, pause, size, deadline = _SCENARIOS[scenario]
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
    except Exception as exc:
        outcome = f"raised {type(exc).__name__}"
    finally:
        b.close()
        feeder.join(5)
    return {"outcome": outcome, "buffer == frame": bytes(buf) == frame if outcome == "filled"
            else None}


def _recv_exact_reference(scenario: str) -> dict:
    filled = scenario not in ("peer closes mid-frame", "peer too slow for the deadline")
    return {"outcome": "filled" if filled else
            "raised PeerClosed" if scenario == "peer closes mid-frame" else "raised WireTimeout",
            "buffer == frame": True if filled else None}


register(Exercise(
    name="lesson01.recv_exact",
    notebook="01_point_to_point",
    params=("sock", "view", "deadline"),
    cases=[case(name, label=name) for name in _SCENARIOS],
    reference=_recv_exact_reference,
    harness=recv_exact_harness,
    points=2,
    time_limit=15.0,
    hints=("Loop until the view is full: _set_timeout(sock, socket.SO_RCVTIMEO, deadline) (it "
          "raises WireTimeout once the deadline is past), then k = sock.recv_into(view[got:], "
          "n - got, socket.MSG_WAITALL); k == 0 means the peer closed: raise PeerClosed; on "
          "BlockingIOError/TimeoutError raise WireTimeout(got) if the deadline passed, else "
          "retry.",),
))
