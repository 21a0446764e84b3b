"""Lesson 10's expected values and explanations (judge side: see this package's docstring).

Expected values come from plain PyTorch on one process (casts, sums, sorting, matrix
products with `course_lib.hook_states.orthogonalize_`, which the lesson gives), never
from `course_lib.comm_model` or `course_lib.comm_hooks`, the components being built.

Components (course_lib.ddp, ...) are imported inside the functions that use them, on
purpose: the learner's overlay decides at each call which version runs (theirs or the
reference), and a name bound at import time would keep the first one.
"""

from __future__ import annotations

import math

import torch

from course_lib.course.grading.exercises import lesson10 as ex
from course_lib.i18n import _

ALGORITHMS = ("naive", "ring", "tree", "rabenseifner")


def _close(a, b, rtol: float = 1e-9, atol: float = 1e-11) -> bool:
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_close(x, y, rtol, atol) for x, y in zip(a, b))
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        return a.shape == b.shape and torch.allclose(a.double(), b.double(), rtol=rtol, atol=atol)
    if isinstance(a, (int, float)) and isinstance(b, (int, float)):
        return math.isclose(a, b, rel_tol=rtol, abs_tol=atol)
    return False


# --- lesson10.terms ----------------------------------------------------------------------------

def _pof2(p: int) -> int:
    return 2 ** int(math.floor(math.log2(p)))


def _base_terms(algorithm: str, n: float, p: int) -> tuple[float, float, float]:
    """The counts on a power of two (or, for naive and ring, on any p), without the fold."""
    lg = math.log2(p)
    if algorithm == "naive":
        return (2.0 * (p - 1), 2 * (p - 1) * n, (p - 1) * n)
    if algorithm == "ring":
        return (2.0 * (p - 1), 2 * (p - 1) / p * n, (p - 1) / p * n)
    if algorithm == "tree":
        return (lg, lg * n, lg * n)
    return (2 * lg, 2 * (p - 1) / p * n, (p - 1) / p * n)


def terms(algorithm: str, nbytes: int, p: int):
    if algorithm not in ALGORITHMS:
        return "raises ValueError"
    if p < 2:
        return (0.0, 0.0, 0.0)
    n = float(nbytes)
    if algorithm in ("naive", "ring") or _pof2(p) == p:
        return _base_terms(algorithm, n, p)
    base = _base_terms(algorithm, n, _pof2(p))
    return tuple(b + f for b, f in zip(base, (2.0, 2 * n, n)))


def explain_terms(case, rank, expected, got) -> str | None:
    algorithm, nbytes, p = case.args
    if expected == "raises ValueError":
        return _("'{algorithm}' is none of the four algorithms: the model cannot price it, so "
                 "the call must raise ValueError", algorithm=algorithm)
    if got == "raises ValueError":
        return _("raised ValueError for {algorithm} on {p} ranks, an algorithm the model "
                 "prices", algorithm=algorithm, p=p)
    if not (isinstance(got, tuple) and len(got) == 3):
        return None
    if p < 2:
        return _("one rank has no one to talk to: all three counts are 0")
    n = float(nbytes)
    if algorithm in ("tree", "rabenseifner") and _pof2(p) != p:
        if _close(got, _base_terms(algorithm, n, _pof2(p))):
            return _("the fold is missing: {p} ranks are not a power of two, so {e} of "
                     "them hand their tensor in before the algorithm runs on {q} ranks and get "
                     "the result back after it, and the rank that takes it in is the busiest",
                     p=p, q=_pof2(p), e=p - _pof2(p))
        if _close(got, _base_terms(algorithm, n, p)):
            return _("these are the counts of {p} ranks as if {p} were a power of two: the "
                     "algorithm runs on {q} ranks, and the others fold in and out around it",
                     p=p, q=_pof2(p))
    names = (_("messages waited for"), _("bytes through the busiest rank's port"),
             _("bytes added"))
    wrong = [i for i in range(3) if not _close(got[i], expected[i], 1e-12, 0.0)]
    if algorithm == "ring" and 1 in wrong and _close(got[1], 2 * (p - 1) * n):
        return _("the ring's bytes: each of its steps moves one chunk, 1/{p} of the tensor, "
                 "not the whole tensor", p=p)
    if algorithm == "naive" and 1 in wrong and _close(got[1], (p - 1) * n):
        return _("the naive bytes: rank 0's port carries the {k} tensors it receives and then "
                 "the {k} it sends back, one after the other", k=p - 1)
    if algorithm == "tree" and 0 in wrong and _close(got[0], 2 * math.log2(_pof2(p))):
        return _("recursive doubling waits for one message per round: each round is a swap, "
                 "and a swap's send and receive run at once")
    return _("{what}: expected {e:g}, got {g:g} on the busiest rank ({algorithm}, {p} ranks)",
             what=names[wrong[0]], e=expected[wrong[0]], g=got[wrong[0]], algorithm=algorithm,
             p=p) if wrong else None


# --- lesson10.compress_hook --------------------------------------------------------------------

def compress_hook(rank: int, world_size: int, k: int, dtype_name: str, n: int, scale: float):
    if rank >= k:
        return None
    dtype = getattr(torch, dtype_name)
    total = sum(ex.grads(r, n, scale).to(dtype).div_(k).double() for r in range(k))
    return {"returned": "a future", "result dtype": "torch.float32", "result": total,
            "bucket buffer": total, "bytes sent": {"all_reduce": 2 * n}}


def explain_compress_hook(case, rank, expected, got) -> str | None:
    if expected is None or not isinstance(got, dict):
        return None
    k, dtype_name, n, scale = case.args[2:]
    if got.get("returned") != "a future":
        return _("the hook returned {what}, not a torch.futures.Future: DDP waits for the "
                 "future's value", what=got.get("returned"))
    sent = got.get("bytes sent", {})
    if sent.get("all_reduce", 0) == 4 * n:
        return _("the all_reduce carried {b} bytes, 4 per gradient: nothing travelled as "
                 "{dtype}", b=4 * n, dtype=dtype_name)
    if not sent.get("all_reduce"):
        return _("no all_reduce ran: each rank kept its own gradients ({calls})",
                 calls=sent or _("no collective at all"))
    if got.get("result dtype") != "torch.float32":
        return _("the future's value is {dtype}: DDP needs the bucket back in the gradients' "
                 "float32", dtype=got.get("result dtype"))
    result = got.get("result")
    if isinstance(result, torch.Tensor) and not torch.isfinite(result).all():
        return _("the result overflowed to inf: the sum of {k} values near {scale:g} is past "
                 "float16's largest value, 65504; their average is not", k=k, scale=scale)
    if _close(result, k * expected["result"], 4e-3, 1e-6):
        return _("the result is the sum over the {k} ranks, not their average", k=k)
    if _close(result, expected["result"], 4e-3, 1e-6) and \
            not _close(got.get("bucket buffer"), expected["bucket buffer"], 4e-3, 1e-6):
        return _("the future's value is right, but the bucket's own buffer still holds this "
                 "rank's gradients: the value must be that buffer, reduced")
    return None


# --- lesson10.compress_with_feedback -----------------------------------------------------------

def _largest(values: torch.Tensor, k: int) -> torch.Tensor:
    return values.argsort(descending=True)[:k].sort().values


def compress_with_feedback(n: int, with_error: bool, k: int, seed: int) -> dict:
    grad, error = ex.feedback_inputs(n, with_error, seed)
    acc = grad + error if error is not None else grad.clone()
    indices = _largest(acc.abs(), k)
    residual = acc.clone()
    residual[indices] = 0
    return {"indices sent": indices, "values sent": acc[indices], "residual": residual,
            "grad left unchanged": True}


def explain_compress_with_feedback(case, rank, expected, got) -> str | None:
    if not isinstance(got, dict):
        return None
    n, with_error, k, seed = case.args
    if got.get("grad left unchanged") is False:
        return _("grad was changed in place: the caller's gradient must stay as it came")
    grad, error = ex.feedback_inputs(n, with_error, seed)
    acc = grad + error if error is not None else grad
    sent = got.get("indices sent")
    if isinstance(sent, torch.Tensor) and not torch.equal(sent, expected["indices sent"]):
        if error is not None and torch.equal(sent, _largest(grad.abs(), k)):
            return _("these are the largest entries of grad alone: last step's residual must "
                     "join it before choosing")
        if torch.equal(sent, _largest(acc, k)):
            return _("these are the {k} largest values, not the {k} largest in magnitude: large "
                     "negative entries are never sent", k=k)
        return None
    residual = got.get("residual")
    if isinstance(residual, torch.Tensor) and _close(residual, acc):
        return _("the residual still holds the entries that were sent: next step would send "
                 "them again")
    if isinstance(residual, torch.Tensor) and error is not None and residual.shape == acc.shape:
        kept = grad.clone()
        kept[expected["indices sent"]] = 0
        if _close(residual, kept):
            return _("the residual leaves out last step's residual: what was not sent then is "
                     "lost now")
    return None


# --- lesson10.powersgd_step --------------------------------------------------------------------

def _step(k: int, shapes: list, r: int, *, sum_p: bool = True, orthogonal: bool = True,
          average_q: bool = True, rank: int = 0):
    """One power iteration over the case's matrices, as the k ranks would compute it together,
    seen from `rank`; the switches make the mistakes the explanations name (sum_p=False: each
    rank orthogonalizes its own P, unsummed)."""
    from course_lib.hook_states import orthogonalize_

    per_rank = [ex.matrices(q, shapes) for q in range(k)]
    out, new_qs = [], []
    for i, q in enumerate(ex.first_qs(shapes, r)):
        local = [torch.bmm(ms[i], q) for ms in per_rank]
        ps = [sum(local)] * k if sum_p else local
        if orthogonal:
            ps = [p.clone() for p in ps]
            for p in ps:
                orthogonalize_(p)
        q_new = sum(torch.bmm(ms[i].transpose(1, 2), p) for ms, p in zip(per_rank, ps))
        if average_q:
            q_new = q_new / k
        out.append(torch.bmm(ps[rank], q_new.transpose(1, 2)))
        new_qs.append(q_new)
    return out, new_qs


def powersgd_step(rank: int, world_size: int, k: int, shapes: list, r: int):
    if rank >= k:
        return None
    out, new_qs = _step(k, shapes, r)
    return {"approximations": out, "new qs": new_qs, "collectives": {"all_reduce": 2}}


def explain_powersgd_step(case, rank, expected, got) -> str | None:
    if expected is None or not isinstance(got, dict):
        return None
    k, shapes, r = case.args[2:]
    calls = got.get("collectives")
    if calls != {"all_reduce": 2}:
        return _("the step ran {calls}; a bucket's Ps travel in one all_reduce and its Qs in "
                 "another: 2 for the {m} matrices, whatever their number", calls=calls or
                 _("no collective at all"), m=len(shapes))
    qs = got.get("new qs")
    if _close(qs, [k * q for q in expected["new qs"]]):
        return _("the new Qs are the sum over the {k} ranks, not their average", k=k)
    for name, variant in ((_("P was never orthogonalized"), dict(orthogonal=False)),
                          (_("rank {rank} orthogonalized its own P, unsummed: the ranks do not "
                             "share one basis", rank=rank), dict(sum_p=False, rank=rank))):
        if _close(qs, _step(k, shapes, r, **variant)[1]):
            return name
    return None
