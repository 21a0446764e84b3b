"""Lesson 02's expected values and the reasons for wrong ones (judge side: see this package's
docstring).

Every rank's input is `payload(rank, n)`: element i is (i % 1000) + 1000 (rank + 1), so a sum
over a set S of ranks is |S| (i % 1000) + 1000 sum(r + 1 for r in S), and a value tells whose
contributions it holds (`whose`): the explanations say "rank 2 ends with chunk 1 summed over
2 of 3 ranks (1, 2)" instead of two columns of numbers.
"""

from __future__ import annotations

import math
from itertools import combinations

import torch

from course_lib.course.compare import mismatch
from course_lib.course.grading.exercises.lesson01 import payload
from course_lib.i18n import N_, _

# --- expected values ---------------------------------------------------------------------------


def tree_broadcast(rank: int, world_size: int, k: int, n: int, src: int) -> dict | None:
    if rank >= k:
        return None
    src %= k
    if rank == src:
        return {"tensor": payload(src, n), "received": 0,
                "messages sent": math.ceil(math.log2(k))}
    return {"tensor": payload(src, n), "received": 1, "sends fewer than the root": True}


def _children(v: int, p: int) -> int:
    """How many ranks send to rank v (counted from the root) in a binomial-tree reduce."""
    k, n = 1, 0
    while k < p and not v & k:
        n += v + k < p
        k *= 2
    return n


def tree_reduce(rank: int, world_size: int, k: int, n: int, dst: int) -> dict | None:
    if rank >= k:
        return None
    dst %= k
    if rank == dst:
        return {"tensor": sum(payload(r, n) for r in range(k)),
                "messages sent, received": (0, _children(0, k))}
    return {"tensor (unchanged)": payload(rank, n),
            "messages sent, received": (1, _children((rank - dst) % k, k))}


def _total(k: int, n: int, dtype: str) -> torch.Tensor:
    total = sum(payload(r, n, getattr(torch, dtype)) for r in range(k))
    return total if n else torch.empty(0, dtype=getattr(torch, dtype))


def ring_reduce_scatter(rank: int, world_size: int, k: int, n: int, dtype: str) -> dict | None:
    if rank >= k:
        return None
    mine = _total(k, n, dtype).tensor_split(k)[rank]
    return {"chunk r": mine, "messages sent": k - 1, "elements sent": n - mine.numel()}


def ring_all_reduce(rank: int, world_size: int, k: int, n: int, dtype: str) -> dict | None:
    if rank >= k:
        return None
    return {"tensor": _total(k, n, dtype), "messages sent": 2 * (k - 1),
            "elements sent: one chunk per step": True}


def _doubling_messages(rank: int, k: int) -> int:
    """Messages rank `rank` sends in recursive doubling on k ranks: lg(2**floor(lg k)) in the
    doubling; a rank that folds into its odd neighbour sends 1, that neighbour 1 more."""
    pof2 = 1 << (k.bit_length() - 1)
    extra, rounds = k - pof2, pof2.bit_length() - 1
    if rank < 2 * extra:
        return 1 if rank % 2 == 0 else rounds + 1
    return rounds


def tree_all_reduce(rank: int, world_size: int, k: int, n: int, dtype: str) -> dict | None:
    if rank >= k:
        return None
    messages = _doubling_messages(rank, k)
    return {"tensor": _total(k, n, dtype), "messages sent": messages, "elements sent": messages * n}


# --- whose contributions a value holds -------------------------------------------------------


def whose(value, index: int, k: int) -> list[tuple[int, ...]]:
    """The sets of ranks (of 0..k-1) whose inputs at element `index` sum to `value`."""
    if float(value) != int(value):
        return []
    value, found = int(value), []
    for m in range(k + 1):
        for ranks in combinations(range(k), m):
            if m * (index % 1000) + 1000 * sum(r + 1 for r in ranks) == value:
                found.append(ranks)
    return found


def summed_over(values: torch.Tensor, start: int, k: int) -> tuple[int | None, dict] | None:
    """What `values` (elements start, start + 1, ... of a result) are summed over: (None, the
    set) when all of them agree, (j, the set of element j) for the first element that is not
    the sum over all k ranks when they do not; None when they read as no set (or several of
    different sizes), or are all complete. The set as `_named` gives it."""
    found = [whose(v, start + j, k) for j, v in enumerate(values.reshape(-1).tolist())]
    if not found or any(not sets for sets in found):
        return None
    complete = (tuple(range(k)),)
    common = set(found[0]).intersection(*found[1:])
    if common and tuple(common) != complete:
        return None, _named(sorted(common), k)
    j = next((j for j, sets in enumerate(found) if tuple(sets) != complete), None)
    return None if j is None else (j, _named(found[j], k))


def _named(sets: list[tuple[int, ...]], k: int) -> dict | None:
    """The fields of a reason: how many ranks, and which (" (0, 2)") where the value says."""
    if len({len(s) for s in sets}) != 1:
        return None
    ranks = f" ({', '.join(map(str, sets[0]))})" if len(sets) == 1 and sets[0] else ""
    return {"m": len(sets[0]), "k": k, "ranks": ranks}


def _chunk_reason(rank: int, chunk: int, values: torch.Tensor, start: int, k: int) -> str | None:
    read = summed_over(values, start, k)
    if read is None or read[1] is None:
        return None
    j, said = read
    if j is None:
        return _("rank {rank} ends with chunk {chunk} summed over {m} of {k} ranks{ranks}",
                 rank=rank, chunk=chunk, **said)
    return _("rank {rank} ends with chunk {chunk} summed over all {k} ranks except its "
             "element {j}: over {m}{ranks}", rank=rank, chunk=chunk, j=j, **said)


def _whole_reason(rank: int, values: torch.Tensor, k: int, text: str) -> str | None:
    read = summed_over(values, 0, k)
    if read is None or read[1] is None:
        return None
    j, said = read
    if j is None:
        return _(text, rank=rank, **said)
    return _("rank {rank} ends with the sum over all {k} ranks except at element {j}: over "
             "{m}{ranks}", rank=rank, j=j, **said)


def _chunks(n: int, k: int) -> list[tuple[int, int]]:
    """(start, size) of each chunk of tensor_split(k) of n elements."""
    sizes = [c.numel() for c in torch.empty(n).tensor_split(k)]
    return [(sum(sizes[:i]), sizes[i]) for i in range(k)]


# --- explanations --------------------------------------------------------------------------


def _differs(expected: dict, got, key: str) -> bool:
    """Whether the field `key` is what is wrong (as the check compares it)."""
    if not isinstance(got, dict) or key not in got or key not in expected:
        return False
    return mismatch(got[key], expected[key], 1e-5, 1e-8) is not None


def explain_tree_broadcast(c, rank: int, expected, got) -> str | None:
    k, n, src = c.args[2:]
    src %= k
    depth = math.ceil(math.log2(k))
    if _differs(expected, got, "tensor"):
        t = got["tensor"]
        if isinstance(t, torch.Tensor) and not t.any():
            if rank == src:
                return _("rank {rank} is the root, but its tensor ends as zeros: it received "
                         "over its own data instead of sending it", rank=rank)
            return _("rank {rank} never received the data of rank {src}, the root: its tensor "
                     "is still zeros", rank=rank, src=src)
        return None
    if _differs(expected, got, "received"):
        if rank == src:
            return _("rank {rank} is the root and received {got} message(s): the root only "
                     "sends", rank=rank, got=got["received"])
        return _("rank {rank} received {got} messages: in a broadcast every rank but the root "
                 "receives exactly once", rank=rank, got=got["received"])
    if _differs(expected, got, "messages sent"):
        return _("rank {rank}, the root, sent {got} message(s): on {k} ranks a binomial tree "
                 "takes {depth} round(s), and the root sends once in each", rank=rank,
                 got=got["messages sent"], k=k, depth=depth)
    if _differs(expected, got, "sends fewer than the root"):
        return _("rank {rank} sent as many messages as the root sends, or more: a rank that "
                 "receives in some round of the tree only sends in the rounds after it",
                 rank=rank)
    return None


def explain_tree_reduce(c, rank: int, expected, got) -> str | None:
    k, n, dst = c.args[2:]
    dst %= k
    key = "tensor" if rank == dst else "tensor (unchanged)"
    if _differs(expected, got, key):
        if not isinstance(got[key], torch.Tensor):
            return None
        if rank == dst:
            return _whole_reason(rank, got[key], k, N_("rank {rank}, the root, ends with the "
                                                       "sum over {m} of {k} ranks{ranks}"))
        read = summed_over(got[key], 0, k)
        if read is None and mismatch(got[key], tree_reduce(dst, k, k, n, dst)["tensor"],
                                     1e-5, 1e-8) is None:
            read = (None, _named([tuple(range(k))], k))  # the whole sum, as the root's
        if read is not None and read[0] is None and read[1] is not None:
            return _("rank {rank}'s tensor changed to the sum over {m} of {k} ranks{ranks}: "
                     "a reduce changes only the root's tensor", rank=rank, **read[1])
        return _("rank {rank}'s tensor changed: a reduce changes only the root's tensor",
                 rank=rank)
    key = "messages sent, received"
    if _differs(expected, got, key):
        (es, er), (gs, gr) = expected[key], got[key]
        return _("rank {rank} sent {gs} and received {gr} message(s); in a binomial tree on {k} "
                 "ranks rooted at rank {dst} it sends {es} and receives {er}, one partial sum "
                 "from each rank that reports to it", rank=rank, gs=gs, gr=gr, k=k, dst=dst,
                 es=es, er=er)
    return None


def explain_ring_reduce_scatter(c, rank: int, expected, got) -> str | None:
    k, n, dtype = c.args[2:]
    if _differs(expected, got, "chunk r"):
        t = got["chunk r"]
        start, size = _chunks(n, k)[rank]
        if not isinstance(t, torch.Tensor) or t.numel() != size:
            return None
        return _chunk_reason(rank, rank, t, start, k)
    if _differs(expected, got, "messages sent"):
        return _("rank {rank} sent {got} message(s): the ring reduce-scatter on {k} ranks takes "
                 "{steps} step(s), one message each", rank=rank, got=got["messages sent"], k=k,
                 steps=k - 1)
    if _differs(expected, got, "elements sent"):
        return _("rank {rank} sent {got} elements: in each step a rank passes on one chunk, "
                 "{want} elements in all on {k} ranks (every chunk but its own, once)",
                 rank=rank, got=got["elements sent"], want=expected["elements sent"], k=k)
    return None


def explain_ring_all_reduce(c, rank: int, expected, got) -> str | None:
    k, n, dtype = c.args[2:]
    if _differs(expected, got, "tensor"):
        t = got["tensor"]
        if not isinstance(t, torch.Tensor) or t.numel() != n:
            return None
        for chunk, (start, size) in enumerate(_chunks(n, k)):
            why = _chunk_reason(rank, chunk, t.reshape(-1)[start:start + size], start, k)
            if why:
                return why
        return None
    if _differs(expected, got, "messages sent"):
        return _("rank {rank} sent {got} message(s): the ring all_reduce on {k} ranks sends "
                 "{want}, {steps} in the reduce-scatter and {steps} in the all-gather",
                 rank=rank, got=got["messages sent"], k=k, want=2 * (k - 1), steps=k - 1)
    if _differs(expected, got, "elements sent: one chunk per step"):
        sizes = [size for _, size in _chunks(n, k)]
        want = 2 * n - sizes[rank] - sizes[(rank + 1) % k]
        return _("rank {rank} sent more or fewer elements than the ring's one chunk per step: on "
                 "{k} ranks and {n} elements a ring sends {want} from this rank", rank=rank, k=k,
                 n=n, want=want)
    return None


def explain_tree_all_reduce(c, rank: int, expected, got) -> str | None:
    k, n, dtype = c.args[2:]
    if _differs(expected, got, "tensor"):
        t = got["tensor"]
        if not isinstance(t, torch.Tensor) or t.numel() != n:
            return None
        return _whole_reason(rank, t, k, N_("rank {rank} ends with the sum over {m} of {k} "
                                                "ranks{ranks}"))
    if _differs(expected, got, "messages sent") or _differs(expected, got, "elements sent"):
        return _("rank {rank} sent {gm} message(s), {ge} elements: recursive doubling on {k} "
                 "ranks sends {em} whole tensor(s) of {n} from this rank", rank=rank,
                 gm=got["messages sent"], ge=got["elements sent"], k=k,
                 em=expected["messages sent"], n=n)
    return None
