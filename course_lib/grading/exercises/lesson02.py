"""Lesson 02 (collectives): ring all_reduce and binomial-tree broadcast from send/recv,
checked on the first 2, 3 and 4 ranks of the grader's 4-rank cluster (3 catches code that only
works on powers of two)."""

from __future__ import annotations

import math
import torch

from course_lib.grading import RANK, WORLD_SIZE, case
from course_lib.grading.exercises.lesson01 import payload
from course_lib.grading.sub_worlds import (counting_messages, first_ranks_as_world,
                                          register_on_sub_worlds)

# --- lesson02.ring_reduce_scatter and lesson02.ring_all_reduce -------------------------------


def _ring_harness(phase: str):
    def harness(fn, rank: int, world_size: int, k: int, n: int, dtype: str) -> dict | None:
        """On the first k ranks as a world of k: each rank's tensor, reduced by `fn`, and the
        messages and elements this rank sent."""
        if rank >= k:
            return None
        t = payload(rank, n, getattr(torch, dtype))
        with first_ranks_as_world(k), counting_messages() as counts:
            fn(t)
        if phase == "reduce_scatter":
            return {"chunk r": t.view(-1).tensor_split(k)[rank], "messages sent": counts["sent"],
                    "elements sent": counts["elements sent"]}
        # Bandwidth-optimal: every chunk but one leaves each rank once per phase.
        optimal = abs(counts["elements sent"] - 2 * (k - 1) / k * n) <= 2
        return {"tensor": t, "messages sent": counts["sent"],
                "elements sent ~ 2(p-1)/p n": optimal}
    return harness


def _ring_reference(phase: str):
    def reference(rank: int, world_size: int, k: int, n: int, dtype: str) -> dict | None:
        if rank >= k:
            return None
        total = sum(payload(r, n, getattr(torch, dtype)) for r in range(k))
        if not n:
            total = torch.empty(0, dtype=getattr(torch, dtype))
        if phase == "reduce_scatter":
            return {"chunk r": total.tensor_split(k)[rank], "messages sent": k - 1,
                    "elements sent": n - total.tensor_split(k)[rank].numel()}
        return {"tensor": total, "messages sent": 2 * (k - 1), "elements sent ~ 2(p-1)/p n": True}
    return reference


_RING_CASES = [
    case(RANK, WORLD_SIZE, 4, 12, "float32", label="4 ranks, 12 floats"),
    case(RANK, WORLD_SIZE, 3, 7, "float32", label="3 ranks, 7 floats: unequal chunks"),
    case(RANK, WORLD_SIZE, 2, 5, "float32", label="2 ranks, 5 floats"),
    case(RANK, WORLD_SIZE, 3, 1001, "int64", label="3 ranks, 1001 int64"),
    case(RANK, WORLD_SIZE, 4, 2, "float32", label="4 ranks, 2 floats: fewer than ranks"),
]

register_on_sub_worlds(
    "lesson02.ring_reduce_scatter", "02_collectives",
    params=("tensor",),
    cases=_RING_CASES,
    reference=_ring_reference("reduce_scatter"),
    harness=_ring_harness("reduce_scatter"),
    points=2,
    time_limit=10.0,
    hints=("chunks = tensor.view(-1).tensor_split(p). Rank r must end with chunk r complete, so "
          "it sends chunk r - 1 first: at step s send chunk (r - s - 1) % p to r + 1, receive "
          "chunk (r - s - 2) % p from r - 1 into a buffer and add it. p - 1 steps, one message "
          "each, every chunk but your own sent once.",),
)

register_on_sub_worlds(
    "lesson02.ring_all_reduce", "02_collectives",
    params=("tensor",),
    cases=_RING_CASES,
    reference=_ring_reference("all_reduce"),
    harness=_ring_harness("all_reduce"),
    points=3,
    time_limit=10.0,
    hints=("Your ring_reduce_scatter first (rank r then holds chunk r summed), then p - 1 "
          "all-gather steps: at step s send chunk (r - s) % p to r + 1 and receive chunk "
          "(r - s - 1) % p from r - 1 straight into place. Use dist.isend + dist.recv (or "
          "parity order) so no step deadlocks.",),
)

# --- lesson02.tree_reduce ----------------------------------------------------------------------


def _children(v: int, p: int) -> int:
    """How many ranks send to virtual rank v in a binomial-tree reduce over p ranks."""
    k, n = 1, 0
    while k < p and not v & k:
        n += v + k < p
        k *= 2
    return n


def reduce_harness(fn, rank: int, world_size: int, k: int, n: int, dst: int) -> dict | None:
    """On the first k ranks as a world of k; `dst` < 0 counts from the end."""
    if rank >= k:
        return None
    dst %= k
    t = payload(rank, n)
    with first_ranks_as_world(k), counting_messages() as counts:
        fn(t, dst)
    return {"tensor" if rank == dst else "tensor (unchanged)": t,
            "messages sent, received": (counts["sent"], counts["received"])}


def _reduce_reference(rank: int, world_size: int, k: int, n: int, dst: int) -> dict | None:
    if rank >= k:
        return None
    dst %= k
    if rank == dst:
        return {"tensor": sum(payload(r, n) for r in range(k)),
                "messages sent, received": (0, _children(0, k))}
    return {"tensor (unchanged)": payload(rank, n),
            "messages sent, received": (1, _children((rank - dst) % k, k))}


register_on_sub_worlds(
    "lesson02.tree_reduce", "02_collectives",
    params=("tensor", "dst"),
    cases=[
        case(RANK, WORLD_SIZE, 4, 5, 0, label="4 ranks, 5 floats onto rank 0"),
        case(RANK, WORLD_SIZE, 3, 7, 2, label="3 ranks, 7 floats onto rank 2"),
        case(RANK, WORLD_SIZE, 4, 6, 1, label="4 ranks onto rank 1"),
        case(RANK, WORLD_SIZE, 2, 3, -1, label="2 ranks onto the last"),
    ],
    reference=_reduce_reference,
    harness=reduce_harness,
    points=2,
    time_limit=10.0,
    hints=("v = (rank - dst) % p; acc = tensor on the root, a clone elsewhere. For k = 1, 2, 4, "
          "... < p: if v & k, send acc to (v - k + dst) % p and stop; else if v + k < p, "
          "receive from (v + k + dst) % p and add it to acc.",),
)


# --- lesson02.tree_all_reduce (recursive doubling) --------------------------------------------


def _doubling_messages(rank: int, k: int) -> int:
    """Messages rank `rank` sends in recursive doubling on k ranks: lg(2**floor(lg k)) in the
    doubling; a rank that folds into its odd neighbour sends 1, that neighbour 1 more."""
    pof2 = 1 << (k.bit_length() - 1)
    extra, rounds = k - pof2, pof2.bit_length() - 1
    if rank < 2 * extra:
        return 1 if rank % 2 == 0 else rounds + 1
    return rounds


def doubling_harness(fn, rank: int, world_size: int, k: int, n: int, dtype: str) -> dict | None:
    if rank >= k:
        return None
    t = payload(rank, n, getattr(torch, dtype))
    with first_ranks_as_world(k), counting_messages() as counts:
        fn(t)
    return {"tensor": t, "messages sent": counts["sent"],
            "elements sent": counts["elements sent"]}


def _doubling_reference(rank: int, world_size: int, k: int, n: int, dtype: str) -> dict | None:
    if rank >= k:
        return None
    messages = _doubling_messages(rank, k)
    return {"tensor": sum(payload(r, n, getattr(torch, dtype)) for r in range(k)),
            "messages sent": messages, "elements sent": messages * n}


register_on_sub_worlds(
    "lesson02.tree_all_reduce", "02_collectives",
    params=("tensor",),
    cases=[
        case(RANK, WORLD_SIZE, 4, 5, "float32", label="4 ranks, 5 floats"),
        case(RANK, WORLD_SIZE, 3, 7, "int64", label="3 ranks, 7 int64: ranks 0 and 1 fold"),
        case(RANK, WORLD_SIZE, 2, 3, "float32", label="2 ranks, 3 floats"),
        case(RANK, WORLD_SIZE, 3, 1000, "float32", label="3 ranks, 1000 floats"),
    ],
    reference=_doubling_reference,
    harness=doubling_harness,
    points=3,
    time_limit=10.0,
    hints=("pof2 = 1 << (p.bit_length() - 1), extra = p - pof2. Ranks r < 2*extra: even ones send "
          "to r + 1 and receive the result from it; odd ones receive and add first. Virtual rank "
          "v = r // 2 (r < 2*extra) or r - extra; partner v ^ mask for mask = 1, 2, ... < pof2, "
          "back to a real rank as 2*v + 1 if v < extra else v + extra; swap whole tensors and "
          "add. Then each odd r < 2*extra sends the sum to r - 1.",),
)


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


register_on_sub_worlds(
    "lesson02.tree_broadcast", "02_collectives",
    params=("tensor", "src"),
    cases=[
        case(RANK, WORLD_SIZE, 4, 5, 0, label="4 ranks, 5 floats from rank 0"),
        case(RANK, WORLD_SIZE, 3, 7, 1, label="3 ranks, 7 floats from rank 1"),
        case(RANK, WORLD_SIZE, 3, 1000, -1, label="3 ranks, 1000 floats from the last rank"),
        case(RANK, WORLD_SIZE, 2, 5, 1, label="2 ranks, 5 floats from rank 1"),
    ],
    reference=_tree_reference,
    harness=tree_harness,
    points=2,
    time_limit=10.0,
    hints=("Work in virtual ranks v = (rank - src) % p so the root is 0. Round k = 0, 1, ...: "
          "every v < 2**k that has the data sends it to v + 2**k (if < p); v receives once, "
          "from v - 2**floor(lg v). Translate back with (v + src) % p; use dist.send/dist.recv.",),
)
