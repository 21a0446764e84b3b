"""Lesson 10 (communication), in two parts. 10a: the cost model's terms behind the size-based
algorithm choice. 10b: the compression hook, error feedback's residual and one PowerSGD step;
these distributed checks run on the first 2, 3 and 4 ranks of the grader's 4-rank cluster and
count the bytes or the collectives. Expected values and the explanations of wrong ones are
judge-side, in `course_lib/course/grading/references/lesson10.py`.

Components (course_lib.ddp, ...) are imported inside the functions that use them, on
purpose: the learner's overlay decides at each call which version runs (theirs or the
reference), and a name bound at import time would keep the first one.
"""

from __future__ import annotations

import torch

from course_lib.course.grading import RANK, WORLD_SIZE, Exercise, case, register
from course_lib.course.grading.sub_worlds import on_first_ranks
from course_lib.course.grading.sub_worlds import register_on_sub_worlds as register_on

PART_A, PART_B = "10a_message_cost", "10b_sending_less"


def grads(rank: int, n: int, scale: float) -> torch.Tensor:
    """Rank `rank`'s gradients of a compress_hook case."""
    g = torch.Generator().manual_seed(10 + rank)
    return (torch.rand(n, generator=g) + 0.5) * scale


class _Bucket:
    """The part of a DDP GradBucket a hook uses."""

    def __init__(self, buffer: torch.Tensor):
        self._buffer = buffer

    def buffer(self) -> torch.Tensor:
        return self._buffer

    def index(self) -> int:
        return 0

    def is_last(self) -> bool:
        return True


# --- lesson10.compress_hook --------------------------------------------------------------------

def _hook_body(dist, rank: int, fn, dtype_name: str, n: int, scale: float) -> dict:
    from course_lib.hook_states import DefaultState

    buffer = grads(rank, n, scale)
    future = fn(getattr(torch, dtype_name), DefaultState(dist=dist), _Bucket(buffer))
    if not callable(getattr(future, "wait", None)):
        return {"returned": type(future).__name__}
    value = future.wait()
    value = value[0] if isinstance(value, (list, tuple)) and len(value) == 1 else value
    return {"returned": "a future", "result dtype": str(value.dtype),
            "result": value.double(), "bucket buffer": buffer.double(),
            "bytes sent": dict(dist.payload)}


def hook_harness(fn, rank: int, world_size: int, k: int, dtype_name: str, n: int, scale: float):
    return on_first_ranks(k, _hook_body, fn, dtype_name, n, scale)


register_on(
    "lesson10.compress_hook", PART_B,
    params=("dtype", "state", "bucket"),
    cases=[case(RANK, WORLD_SIZE, k, dt, n, s, label=f"{k} ranks, {n} {dt} values near {s:g}")
           for k, dt, n, s in ((2, "float16", 50, 1.0), (3, "float16", 33, 0.01),
                               (4, "float16", 40, 1.0), (2, "float16", 20, 40000.0),
                               (3, "float16", 12, 30000.0), (2, "bfloat16", 16, 1.0))],
    reference="lesson10:compress_hook",
    explain="lesson10:explain_compress_hook",
    harness=hook_harness,
    rtol=4e-3, atol=1e-6,  # the narrow type's rounding, summed in the transport's order
    points=2,
    hints=("Two facts decide the result: the narrow type can hold the ranks' average where it "
           "cannot always hold their sum, and DDP wants the bucket back in the gradients' own "
           "type, already averaged over the ranks.",
           "A picture of one bucket: float32 gradients -> a narrow copy, divided by the number "
           "of ranks -> an asynchronous all-reduce -> once its future completes, the reduced "
           "values are written back into the float32 buffer, and that buffer is the value of "
           "the future the hook returns."),
)


# --- lesson10.compress_with_feedback -----------------------------------------------------------

def feedback_inputs(n: int, with_error: bool, seed: int):
    """(grad, error or None) of a compress_with_feedback case."""
    g = torch.Generator().manual_seed(seed)
    grad = torch.randn(n, generator=g, dtype=torch.float64)
    error = torch.randn(n, generator=g, dtype=torch.float64) * 0.8 if with_error else None
    return grad, error


def feedback_harness(fn, n: int, with_error: bool, k: int, seed: int) -> dict:
    grad, error = feedback_inputs(n, with_error, seed)
    before = grad.clone()
    indices, values, residual = fn(grad, error, k)
    order = indices.long().argsort()
    return {"indices sent": indices.long()[order], "values sent": values[order],
            "residual": residual, "grad left unchanged": torch.equal(grad, before)}


register(Exercise(
    name="lesson10.compress_with_feedback",
    notebook=PART_B,
    params=("grad", "error", "k"),
    cases=[case(20, False, 3, 1, label="20 entries, no error yet, k = 3"),
           case(20, True, 3, 2, label="20 entries with last step's residual, k = 3"),
           case(50, True, 1, 3, label="50 entries, k = 1"),
           case(9, True, 9, 4, label="k = n: everything is sent, nothing left")],
    reference="lesson10:compress_with_feedback",
    explain="lesson10:explain_compress_with_feedback",
    harness=feedback_harness,
    rtol=1e-12, atol=0.0,
    points=2,
    hints=("Error feedback loses nothing for good: what is not sent this step waits in the "
           "residual and joins the next step's gradient. So the candidate to send is the "
           "gradient plus what waited, and the new residual is every part of that candidate "
           "that did not go.",
           "Steps: build the candidate in a new tensor (the caller's gradient stays as it "
           "was); rank its entries by size whatever their sign; the k largest go (their "
           "positions and values); the residual is the candidate with those positions emptied."),
))


# --- lesson10.powersgd_step --------------------------------------------------------------------

SHAPES = ([(6, 4), (5, 7)], [(8, 8)], [(4, 9), (4, 9), (3, 5)])


def matrices(rank: int, shapes: list) -> list[torch.Tensor]:
    """Rank `rank`'s gradient matrices of a powersgd_step case, each (1, n, m)."""
    g = torch.Generator().manual_seed(100 + rank)
    return [torch.randn(1, n, m, generator=g, dtype=torch.float64) for n, m in shapes]


def first_qs(shapes: list, r: int) -> list[torch.Tensor]:
    """The Qs every rank starts a case with, orthogonalized."""
    from course_lib.hook_states import orthogonalize_

    g = torch.Generator().manual_seed(7)
    qs = [torch.randn(1, m, r, generator=g, dtype=torch.float64) for _, m in shapes]
    for q in qs:
        orthogonalize_(q)
    return qs


def _powersgd_body(dist, rank: int, fn, shapes: list, r: int) -> dict:
    ms, qs = matrices(rank, shapes), first_qs(shapes, r)
    fn(ms, qs, dist=dist)
    return {"approximations": ms, "new qs": qs, "collectives": dict(dist.calls)}


def powersgd_harness(fn, rank: int, world_size: int, k: int, shapes: list, r: int):
    return on_first_ranks(k, _powersgd_body, fn, shapes, r)


register_on(
    "lesson10.powersgd_step", PART_B,
    params=("matrices", "qs"),
    cases=[case(RANK, WORLD_SIZE, k, shapes, r, label=f"{k} ranks, matrices {shapes}, rank {r}")
           for k, shapes, r in ((2, SHAPES[0], 1), (3, SHAPES[0], 2), (4, SHAPES[1], 2),
                                (3, SHAPES[2], 1), (4, SHAPES[2], 3))],
    reference="lesson10:powersgd_step",
    explain="lesson10:explain_powersgd_step",
    harness=powersgd_harness,
    rtol=1e-9, atol=1e-11,
    points=3,
    hints=("Every rank must use the same basis before anyone computes its second factor, so "
           "the first factor is summed over the ranks before it is orthogonalized; the second "
           "factor is then averaged over the ranks, and their product approximates the "
           "average gradient. All the matrices of a bucket travel together: one collective "
           "for every first factor, one for every second.",
           "Per bucket: compute each matrix's first factor; pack them all into one flat "
           "tensor, reduce it, unpack and orthogonalize each; compute each second factor from "
           "its matrix and its orthogonal first factor; pack, reduce, divide by the world "
           "size, unpack into the given Qs; last, overwrite each matrix with its two factors' "
           "product."),
)


# --- lesson10.terms ----------------------------------------------------------------------------

def terms_harness(fn, algorithm: str, nbytes: int, p: int):
    try:
        return tuple(float(v) for v in fn(algorithm, nbytes, p))
    except ValueError:
        return "raises ValueError"


register(Exercise(
    name="lesson10.terms",
    notebook=PART_A,
    params=("algorithm", "nbytes", "p"),
    cases=[case(a, n, p, label=f"{a}, {n} bytes, {p} ranks")
           for a in ("naive", "ring", "tree", "rabenseifner") for n, p in
           ((4096, 2), (1 << 20, 4), (1000, 3), (1 << 16, 6), (12, 8), (7, 1))]
    + [case("butterfly", 4096, 4, label="an unknown algorithm: ValueError")],
    reference="lesson10:terms",
    explain="lesson10:explain_terms",
    harness=terms_harness,
    rtol=1e-12, atol=0.0,
    points=2,
    hints=("Count on the busiest rank, one thing after another: each message it waits for, "
           "each byte through its port (a swap's send and receive overlap, so they count "
           "once), each byte it adds. A world that is not a power of two pays the fold on top "
           "of the algorithm run on the largest power of two below it.",
           "Walk the pictures with 4 ranks and 4 chunks, counting in chunks: the ring moves one "
           "chunk per step in each of its two phases; recursive doubling swaps the whole "
           "tensor every round; Rabenseifner's first phase swaps half the tensor, then a quarter, "
           "and so on, and its second phase gives the same amounts back. Then say each "
           "count for any number of ranks, and test it on 2 ranks, where recursive doubling "
           "is a single swap."),
))
