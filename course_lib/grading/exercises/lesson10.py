"""Lesson 10 (communication): the compression hook, error feedback's residual, one PowerSGD
step, and the cost model's terms behind the size-based algorithm choice. Distributed checks
run on the first 2, 3 and 4 ranks of the grader's 4-rank cluster and count the bytes sent."""

from __future__ import annotations

import torch

from course_lib.grading import RANK, WORLD_SIZE, Exercise, case, register
from course_lib.grading.sub_worlds import on_first_ranks
from course_lib.grading.sub_worlds import register_on_sub_worlds as register_on


def _grads(rank: int, n: int, scale: float) -> torch.Tensor:
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
    from course_lib.comm_hooks import DefaultState

    buffer = _grads(rank, n, scale)
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


def _hook_reference(rank: int, world_size: int, k: int, dtype_name: str, n: int, scale: float):
    if rank >= k:
        return None
    dtype = getattr(torch, dtype_name)
    total = sum(_grads(r, n, scale).to(dtype).div_(k).double() for r in range(k))
    return {"returned": "a future", "result dtype": "torch.float32", "result": total,
            "bucket buffer": total, "bytes sent": {"all_reduce": 2 * n}}


register_on(
    "lesson10.compress_hook", "10_communication",
    params=("dtype", "state", "bucket"),
    cases=[case(RANK, WORLD_SIZE, k, dt, n, s, label=f"{k} ranks, {n} {dt} values near {s:g}")
           for k, dt, n, s in ((2, "float16", 50, 1.0), (3, "float16", 33, 0.01),
                               (4, "float16", 40, 1.0), (2, "float16", 20, 40000.0),
                               (3, "float16", 12, 30000.0), (2, "bfloat16", 16, 1.0))],
    reference=_hook_reference,
    harness=hook_harness,
    rtol=4e-3, atol=1e-6,  # the narrow type's rounding, summed in the transport's order
    points=2,
    hints=("compressed = bucket.buffer().to(dtype).div_(world_size) (divide before the sum: the "
          "sum of large values overflows float16); all_reduce it asynchronously; in the "
          "future's then(), copy the result back into the buffer (float32) and return it.",),
)


# --- lesson10.compress_with_feedback -----------------------------------------------------------

def _feedback_inputs(n: int, with_error: bool, seed: int):
    g = torch.Generator().manual_seed(seed)
    grad = torch.randn(n, generator=g, dtype=torch.float64)
    error = torch.randn(n, generator=g, dtype=torch.float64) * 0.8 if with_error else None
    return grad, error


def feedback_harness(fn, n: int, with_error: bool, k: int, seed: int) -> dict:
    grad, error = _feedback_inputs(n, with_error, seed)
    before = grad.clone()
    indices, values, residual = fn(grad, error, k)
    order = indices.long().argsort()
    return {"indices sent": indices.long()[order], "values sent": values[order],
            "residual": residual, "grad left unchanged": torch.equal(grad, before)}


def _feedback_reference(n: int, with_error: bool, k: int, seed: int) -> dict:
    grad, error = _feedback_inputs(n, with_error, seed)
    acc = grad + error if error is not None else grad.clone()
    indices = acc.abs().argsort(descending=True)[:k].sort().values
    residual = acc.clone()
    residual[indices] = 0
    return {"indices sent": indices, "values sent": acc[indices], "residual": residual,
            "grad left unchanged": True}


register(Exercise(
    name="lesson10.compress_with_feedback",
    notebook="10_communication",
    params=("grad", "error", "k"),
    cases=[case(20, False, 3, 1, label="20 entries, no error yet, k = 3"),
           case(20, True, 3, 2, label="20 entries with last step's residual, k = 3"),
           case(50, True, 1, 3, label="50 entries, k = 1"),
           case(9, True, 9, 4, label="k = n: everything is sent, nothing left")],
    reference=_feedback_reference,
    harness=feedback_harness,
    rtol=1e-12, atol=0.0,
    points=2,
    hints=("acc = grad + error (grad alone when error is None, without changing grad); send the k "
          "entries of acc largest in absolute value (indices and acc's values there); the "
          "residual is acc with those entries set to 0.",),
))


# --- lesson10.powersgd_step --------------------------------------------------------------------

SHAPES = ([(6, 4), (5, 7)], [(8, 8)], [(4, 9), (4, 9), (3, 5)])


def _matrices(rank: int, shapes: list) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(100 + rank)
    return [torch.randn(1, n, m, generator=g, dtype=torch.float64) for n, m in shapes]


def _qs(shapes: list, r: int) -> list[torch.Tensor]:
    from course_lib.comm_hooks import orthogonalize_

    g = torch.Generator().manual_seed(7)
    qs = [torch.randn(1, m, r, generator=g, dtype=torch.float64) for _, m in shapes]
    for q in qs:
        orthogonalize_(q)
    return qs


def _powersgd_body(dist, rank: int, fn, shapes: list, r: int) -> dict:
    matrices, qs = _matrices(rank, shapes), _qs(shapes, r)
    fn(matrices, qs, dist=dist)
    return {"approximations": matrices, "new qs": qs, "collectives": dict(dist.calls)}


def powersgd_harness(fn, rank: int, world_size: int, k: int, shapes: list, r: int):
    return on_first_ranks(k, _powersgd_body, fn, shapes, r)


def _powersgd_reference(rank: int, world_size: int, k: int, shapes: list, r: int):
    from course_lib.comm_hooks import orthogonalize_

    if rank >= k:
        return None
    per_rank = [_matrices(q, shapes) for q in range(k)]
    out, new_qs = [], []
    for i, q in enumerate(_qs(shapes, r)):
        p = sum(torch.bmm(ms[i], q) for ms in per_rank)
        orthogonalize_(p)
        q_new = sum(torch.bmm(ms[i].transpose(1, 2), p) for ms in per_rank) / k
        out.append(torch.bmm(p, q_new.transpose(1, 2)))
        new_qs.append(q_new)
    return {"approximations": out, "new qs": new_qs, "collectives": {"all_reduce": 2}}


register_on(
    "lesson10.powersgd_step", "10_communication",
    params=("matrices", "qs"),
    cases=[case(RANK, WORLD_SIZE, k, shapes, r, label=f"{k} ranks, matrices {shapes}, rank {r}")
           for k, shapes, r in ((2, SHAPES[0], 1), (3, SHAPES[0], 2), (4, SHAPES[1], 2),
                                (3, SHAPES[2], 1), (4, SHAPES[2], 3))],
    reference=_powersgd_reference,
    harness=powersgd_harness,
    rtol=1e-9, atol=1e-11,
    points=3,
    hints=("P = M Q for every matrix, all P's in ONE all_reduce (sum), orthogonalize_ each P; "
          "then Q = M^T P, all Q's in one all_reduce, divided by the world size; write Q back "
          "into qs and P Q^T into each matrix.",),
)


# --- lesson10.terms ----------------------------------------------------------------------------

def terms_harness(fn, algorithm: str, nbytes: int, p: int):
    try:
        return tuple(float(v) for v in fn(algorithm, nbytes, p))
    except ValueError:
        return "raises ValueError"


def _terms_reference(algorithm: str, nbytes: int, p: int):
    import math

    if algorithm not in ("naive", "ring", "tree", "rabenseifner"):
        return "raises ValueError"
    if p < 2:
        return (0.0, 0.0, 0.0)
    n = float(nbytes)
    pof2 = 2 ** int(math.floor(math.log2(p)))
    lg = math.log2(pof2)
    fold = (2.0, 2 * n, n) if pof2 != p else (0.0, 0.0, 0.0)
    if algorithm == "naive":
        return (2.0 * (p - 1), 2 * (p - 1) * n, (p - 1) * n)
    if algorithm == "ring":
        return (2.0 * (p - 1), 2 * (p - 1) / p * n, (p - 1) / p * n)
    if algorithm == "tree":
        base = (lg, lg * n, lg * n)
    else:
        base = (2 * lg, 2 * (pof2 - 1) / pof2 * n, (pof2 - 1) / pof2 * n)
    return tuple(b + f for b, f in zip(base, fold))


register(Exercise(
    name="lesson10.terms",
    notebook="10_communication",
    params=("algorithm", "nbytes", "p"),
    cases=[case(a, n, p, label=f"{a}, {n} bytes, {p} ranks")
           for a in ("naive", "ring", "tree", "rabenseifner") for n, p in
           ((4096, 2), (1 << 20, 4), (1000, 3), (1 << 16, 6), (12, 8), (7, 1))]
    + [case("butterfly", 4096, 4, label="an unknown algorithm: ValueError")],
    reference=_terms_reference,
    harness=terms_harness,
    rtol=1e-12, atol=0.0,
    points=2,
    hints=("Count on the slowest rank. ring: 2(p-1) messages, 2(p-1)/p n bytes, (p-1)/p n "
          "added. tree: lg p' rounds of everything; rabenseifner: 2 lg p' messages and the "
          "ring's bytes over p'. p' is the largest power of two <= p; when p' < p, add the "
          "fold: 2 messages of n bytes and one addition of n.",),
))
