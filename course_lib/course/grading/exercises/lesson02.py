"""Lesson 02 (collectives, parts 02a and 02b): binomial-tree broadcast and reduce, ring
reduce-scatter and all_reduce, recursive doubling, all from send/recv, checked on the first 2,
3 and 4 ranks of the grader's 4-rank cluster (3 catches code that only works on powers of two).

The expected values and the explanations of wrong ones are judge-side:
`course_lib/course/grading/references/lesson02.py`."""

from __future__ import annotations

import math

import torch

from course_lib.course.grading import RANK, WORLD_SIZE, case
from course_lib.course.grading.exercises.lesson01 import payload
from course_lib.course.grading.sub_worlds import (counting_messages, first_ranks_as_world,
                                          register_on_sub_worlds)

PART_A, PART_B = "02a_broadcast_reduce", "02b_all_reduce"

# --- lesson02.tree_broadcast -----------------------------------------------------------------


def tree_harness(fn, rank: int, world_size: int, k: int, n: int, src: int) -> dict | None:
    """On the first k ranks as a world of k; `src` < 0 counts from the end (-1: the last
    rank). Checks the data and the tree shape: the root sends ceil(lg k) messages, one per
    round, and every other rank fewer."""
    if rank >= k:
        return None
    src %= k
    t = payload(src, n) if rank == src else torch.zeros(n)
    with first_ranks_as_world(k), counting_messages() as counts:
        fn(t, src)
    if rank == src:
        return {"tensor": t, "received": counts["received"], "messages sent": counts["sent"]}
    depth = math.ceil(math.log2(k))
    return {"tensor": t, "received": counts["received"],
            "sends fewer than the root": counts["sent"] <= depth - 1}


register_on_sub_worlds(
    "lesson02.tree_broadcast", PART_A,
    params=("tensor", "src"),
    cases=[
        case(RANK, WORLD_SIZE, 4, 5, 0, label="4 ranks, 5 floats from rank 0"),
        case(RANK, WORLD_SIZE, 3, 7, 1, label="3 ranks, 7 floats from rank 1"),
        case(RANK, WORLD_SIZE, 3, 1000, -1, label="3 ranks, 1000 floats from the last rank"),
        case(RANK, WORLD_SIZE, 2, 5, 1, label="2 ranks, 5 floats from rank 1"),
    ],
    reference="lesson02:tree_broadcast",
    explain="lesson02:explain_tree_broadcast",
    harness=tree_harness,
    points=2,
    time_limit=10.0,
    hints=("The invariant: after each round twice as many ranks hold the data, and after the "
           "last round all of them. Count the ranks from the root, wrapping around: in every "
           "round each rank that holds the data gives it to one rank that does not have it yet.",
           "Draw p = 6 with the ranks counted from the root as 0 to 5. Round 0: 0 gives to 1. "
           "Round 1: 0 gives to 2 and 1 to 3. Round 2: 0 gives to 4 and 1 to 5. A rank receives "
           "in exactly one round and gives in every later round while its partner exists; turn "
           "the counted numbers back into real ranks for every send and receive."),
)

# --- lesson02.tree_reduce ----------------------------------------------------------------------


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


register_on_sub_worlds(
    "lesson02.tree_reduce", PART_A,
    params=("tensor", "dst"),
    cases=[
        case(RANK, WORLD_SIZE, 4, 5, 0, label="4 ranks, 5 floats onto rank 0"),
        case(RANK, WORLD_SIZE, 3, 7, 2, label="3 ranks, 7 floats onto rank 2"),
        case(RANK, WORLD_SIZE, 4, 6, 1, label="4 ranks onto rank 1"),
        case(RANK, WORLD_SIZE, 2, 3, -1, label="2 ranks onto the last"),
    ],
    reference="lesson02:tree_reduce",
    explain="lesson02:explain_tree_reduce",
    harness=reduce_harness,
    points=2,
    time_limit=10.0,
    hints=("A broadcast tree run backwards, leaves first: each rank sends its partial sum to "
           "its parent exactly once, after it has received the partial sums of all its "
           "children, and is then done. Only the root keeps a result; the others add into a "
           "copy.",
           "Draw p = 6 with the ranks counted from the root as 0 to 5: round 0: 1 gives to 0, 3 "
           "to 2, 5 to 4; round 1: 2 gives to 0; round 2: 4 gives to 0. A rank that has given "
           "is done; until then it takes one partial sum in each round in which a rank reports "
           "to it, and adds it."),
)

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
        # Bandwidth-optimal: every chunk but one leaves each rank once per phase (2(p-1)/p n).
        optimal = abs(counts["elements sent"] - 2 * (k - 1) / k * n) <= 2
        return {"tensor": t, "messages sent": counts["sent"],
                "elements sent: one chunk per step": optimal}
    harness.__name__ = harness.__qualname__ = f"ring_{phase}_harness"
    return harness


ring_reduce_scatter_harness = _ring_harness("reduce_scatter")
ring_all_reduce_harness = _ring_harness("all_reduce")

_RING_CASES = [
    case(RANK, WORLD_SIZE, 4, 12, "float32", label="4 ranks, 12 floats"),
    case(RANK, WORLD_SIZE, 3, 7, "float32", label="3 ranks, 7 floats: unequal chunks"),
    case(RANK, WORLD_SIZE, 2, 5, "float32", label="2 ranks, 5 floats"),
    case(RANK, WORLD_SIZE, 3, 1001, "int64", label="3 ranks, 1001 int64"),
    case(RANK, WORLD_SIZE, 4, 2, "float32", label="4 ranks, 2 floats: fewer than ranks"),
]

register_on_sub_worlds(
    "lesson02.ring_reduce_scatter", PART_B,
    params=("tensor",),
    cases=_RING_CASES,
    reference="lesson02:ring_reduce_scatter",
    explain="lesson02:explain_ring_reduce_scatter",
    harness=ring_reduce_scatter_harness,
    points=2,
    time_limit=10.0,
    hints=("Each chunk travels once around the ring to the right, collecting one contribution "
           "per hop, and must finish its trip complete on the rank whose number it carries. "
           "Work backwards from there: which chunk must a rank pass on in the last step, and "
           "so in the first?",
           "Picture p = 3: chunk 0 starts on rank 1 with one contribution, reaches rank 2 (two), "
           "then rank 0 (three: complete). In every step a rank passes on the chunk it added "
           "into in the step before (in the first step, one it has not touched) and receives "
           "the next one into a separate buffer, never into the chunk it is still sending."),
)

register_on_sub_worlds(
    "lesson02.ring_all_reduce", PART_B,
    params=("tensor",),
    cases=_RING_CASES,
    reference="lesson02:ring_all_reduce",
    explain="lesson02:explain_ring_all_reduce",
    harness=ring_all_reduce_harness,
    points=3,
    time_limit=10.0,
    hints=("After your reduce-scatter each rank holds exactly one chunk complete, its own. The "
           "all-gather passes the complete chunks around the same ring, p - 1 more steps, "
           "copying instead of adding.",
           "In each all-gather step a rank forwards the chunk it received in the step before "
           "(in the first step its own complete one) and receives the next complete chunk "
           "straight into its place in the tensor. Post the send before the receive, or every "
           "rank waits for its left neighbour."),
)

# --- lesson02.tree_all_reduce (recursive doubling) --------------------------------------------


def doubling_harness(fn, rank: int, world_size: int, k: int, n: int, dtype: str) -> dict | None:
    if rank >= k:
        return None
    t = payload(rank, n, getattr(torch, dtype))
    with first_ranks_as_world(k), counting_messages() as counts:
        fn(t)
    return {"tensor": t, "messages sent": counts["sent"],
            "elements sent": counts["elements sent"]}


register_on_sub_worlds(
    "lesson02.tree_all_reduce", PART_B,
    params=("tensor",),
    cases=[
        case(RANK, WORLD_SIZE, 4, 5, "float32", label="4 ranks, 5 floats"),
        case(RANK, WORLD_SIZE, 3, 7, "int64", label="3 ranks, 7 int64: ranks 0 and 1 fold"),
        case(RANK, WORLD_SIZE, 2, 3, "float32", label="2 ranks, 3 floats"),
        case(RANK, WORLD_SIZE, 3, 1000, "float32", label="3 ranks, 1000 floats"),
    ],
    reference="lesson02:tree_all_reduce",
    explain="lesson02:explain_tree_all_reduce",
    harness=doubling_harness,
    points=3,
    time_limit=10.0,
    hints=("On a power of two: in each round every rank swaps its whole tensor with the rank "
           "whose number differs from its own in one bit, a new bit each round, and both add. "
           "After a round every rank holds the sum over a block twice as large as before.",
           "Not a power of two: shrink the world to the largest power of two below it first. "
           "The surplus ranks pair up with their neighbours (0 with 1, 2 with 3, ...); the even "
           "one hands its tensor to the odd one and later gets the result back. The doubling "
           "runs on the ranks left, renumbered from 0 in rank order: turn those numbers back "
           "into real ranks for every message."),
)
