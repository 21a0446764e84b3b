"""Lesson 02 (collectives): ring all_reduce and binomial-tree broadcast from send/recv."""

from __future__ import annotations

import math
from contextlib import contextmanager

import torch

from course_lib.grading import RANK, WORLD_SIZE, Exercise, case, register
from course_lib.grading.exercises.lesson01 import payload

P2P = {"send": "sent", "isend": "sent", "recv": "received", "irecv": "received"}


@contextmanager
def counting_messages():
    """Count calls of course_lib.dist's send/isend/recv/irecv made inside the block."""
    from course_lib import dist

    counts = {"sent": 0, "received": 0}
    saved = {name: getattr(dist, name) for name in P2P}

    def counted(name):
        def call(*args, **kwargs):
            counts[P2P[name]] += 1
            return saved[name](*args, **kwargs)
        return call

    for name in P2P:
        setattr(dist, name, counted(name))
    try:
        yield counts
    finally:
        for name, fn in saved.items():
            setattr(dist, name, fn)


# --- lesson02.ring_all_reduce ----------------------------------------------------------------


def ring_harness(fn, rank: int, world_size: int, n: int, dtype: str) -> dict:
    t = payload(rank, n, getattr(torch, dtype))
    with counting_messages() as counts:
        fn(t)
    return {"tensor": t, "messages sent": counts["sent"]}


def _ring_reference(rank: int, world_size: int, n: int, dtype: str) -> dict:
    total = sum(payload(r, n, getattr(torch, dtype)) for r in range(world_size))
    return {"tensor": total if n else torch.empty(0, dtype=getattr(torch, dtype)),
            "messages sent": 2 * (world_size - 1)}


register(Exercise(
    name="lesson02.ring_all_reduce",
    notebook="02_collectives",
    params=("tensor",),
    cases=[
        case(RANK, WORLD_SIZE, 12, "float32", label="12 floats"),
        case(RANK, WORLD_SIZE, 7, "float32", label="7 floats: chunks of unequal size"),
        case(RANK, WORLD_SIZE, 1001, "int64", label="1001 int64"),
        case(RANK, WORLD_SIZE, 2, "float32", label="2 floats: fewer elements than ranks"),
    ],
    reference=_ring_reference,
    harness=ring_harness,
    distributed=True,
    world_size=4,
    points=3,
    time_limit=10.0,
    hint=("Split with tensor.tensor_split(p) (unequal chunks are fine). Reduce-scatter: at step "
          "s send chunk (r - s) % p to r + 1, receive chunk (r - s - 1) % p from r - 1 and add "
          "it. All-gather: at step s send chunk (r - s + 1) % p, receive chunk (r - s) % p into "
          "place. Use dist.isend + dist.recv (or parity order) so no step deadlocks."),
))

# --- lesson02.tree_broadcast -----------------------------------------------------------------


def tree_harness(fn, rank: int, world_size: int, n: int, src: int) -> dict:
    """`src` < 0 counts from the end (-1: the last rank). Checks the data and the tree shape:
    the root sends ceil(lg p) messages, every other rank receives one and sends fewer."""
    src %= world_size
    t = payload(src, n) if rank == src else torch.zeros(n)
    with counting_messages() as counts:
        fn(t, src)
    depth = math.ceil(math.log2(world_size))
    tree = counts["sent"] == depth if rank == src else counts["sent"] <= depth - 1
    return {"tensor": t, "received": counts["received"], "tree-shaped sends": tree}


def _tree_reference(rank: int, world_size: int, n: int, src: int) -> dict:
    src %= world_size
    return {"tensor": payload(src, n), "received": 0 if rank == src else 1,
            "tree-shaped sends": True}


register(Exercise(
    name="lesson02.tree_broadcast",
    notebook="02_collectives",
    params=("tensor", "src"),
    cases=[
        case(RANK, WORLD_SIZE, 5, 0, label="5 floats from rank 0"),
        case(RANK, WORLD_SIZE, 7, 1, label="7 floats from rank 1"),
        case(RANK, WORLD_SIZE, 1000, -1, label="1000 floats from the last rank"),
    ],
    reference=_tree_reference,
    harness=tree_harness,
    distributed=True,
    world_size=4,
    points=2,
    time_limit=10.0,
    hint=("Work in virtual ranks v = (rank - src) % p so the root is 0. Round k = 0, 1, ...: "
          "every v < 2**k that has the data sends it to v + 2**k (if < p); v receives once, "
          "from v - 2**floor(lg v). Translate back with (v + src) % p; use dist.send/dist.recv."),
))
