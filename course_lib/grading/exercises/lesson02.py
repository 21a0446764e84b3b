"""Lesson 02 (collectives): ring all_reduce and binomial-tree broadcast from send/recv,
checked on the first 2, 3 and 4 ranks of the grader's 4-rank cluster (3 catches code that only
works on powers of two)."""

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


LIBRARY = ("all_reduce", "broadcast", "reduce", "reduce_scatter", "all_gather", "scatter",
           "gather", "barrier")


@contextmanager
def first_ranks_as_world(k: int):
    """Inside the block, course_lib.dist's world is global ranks 0..k-1: get_world_size()
    says k (their ranks and send/recv peers are the same numbers), and the library's
    collectives, which would wait for the ranks left out, raise instead."""
    from course_lib import dist

    saved = {name: getattr(dist, name) for name in ("get_world_size", *LIBRARY)}

    def refuse(name):
        def call(*args, **kwargs):
            raise RuntimeError(f"dist.{name} is the library's; build this one from send/recv")
        return call

    dist.get_world_size = lambda group=None: k if group is None else saved["get_world_size"](group)
    for name in LIBRARY:
        setattr(dist, name, refuse(name))
    try:
        yield
    finally:
        for name, fn in saved.items():
            setattr(dist, name, fn)


# --- lesson02.ring_all_reduce ----------------------------------------------------------------


def ring_harness(fn, rank: int, world_size: int, k: int, n: int, dtype: str) -> dict | None:
    """On the first k ranks as a world of k: each rank's tensor, all-reduced by `fn`."""
    if rank >= k:
        return None
    t = payload(rank, n, getattr(torch, dtype))
    with first_ranks_as_world(k), counting_messages() as counts:
        fn(t)
    return {"tensor": t, "messages sent": counts["sent"]}


def _ring_reference(rank: int, world_size: int, k: int, n: int, dtype: str) -> dict | None:
    if rank >= k:
        return None
    total = sum(payload(r, n, getattr(torch, dtype)) for r in range(k))
    return {"tensor": total if n else torch.empty(0, dtype=getattr(torch, dtype)),
            "messages sent": 2 * (k - 1)}


register(Exercise(
    name="lesson02.ring_all_reduce",
    notebook="02_collectives",
    params=("tensor",),
    cases=[
        case(RANK, WORLD_SIZE, 4, 12, "float32", label="4 ranks, 12 floats"),
        case(RANK, WORLD_SIZE, 3, 7, "float32", label="3 ranks, 7 floats: unequal chunks"),
        case(RANK, WORLD_SIZE, 2, 5, "float32", label="2 ranks, 5 floats"),
        case(RANK, WORLD_SIZE, 3, 1001, "int64", label="3 ranks, 1001 int64"),
        case(RANK, WORLD_SIZE, 4, 2, "float32", label="4 ranks, 2 floats: fewer than ranks"),
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


def tree_harness(fn, rank: int, world_size: int, k: int, n: int, src: int) -> dict | None:
    """On the first k ranks as a world of k; `src` < 0 counts from the end (-1: the last
    rank). Checks the data and the tree shape: the root sends ceil(lg k) messages, every
    other rank receives one and sends fewer."""
    if rank >= k:
        return None
    src %= k
    t = payload(src, n) if rank == src else torch.zeros(n)
    with first_ranks_as_world(k), counting_messages() as counts:
        fn(t, src)
    depth = math.ceil(math.log2(k))
    tree = counts["sent"] == depth if rank == src else counts["sent"] <= depth - 1
    return {"tensor": t, "received": counts["received"], "tree-shaped sends": tree}


def _tree_reference(rank: int, world_size: int, k: int, n: int, src: int) -> dict | None:
    if rank >= k:
        return None
    src %= k
    return {"tensor": payload(src, n), "received": 0 if rank == src else 1,
            "tree-shaped sends": True}


register(Exercise(
    name="lesson02.tree_broadcast",
    notebook="02_collectives",
    params=("tensor", "src"),
    cases=[
        case(RANK, WORLD_SIZE, 4, 5, 0, label="4 ranks, 5 floats from rank 0"),
        case(RANK, WORLD_SIZE, 3, 7, 1, label="3 ranks, 7 floats from rank 1"),
        case(RANK, WORLD_SIZE, 3, 1000, -1, label="3 ranks, 1000 floats from the last rank"),
        case(RANK, WORLD_SIZE, 2, 5, 1, label="2 ranks, 5 floats from rank 1"),
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
