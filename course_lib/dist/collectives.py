"""Collectives built from point-to-point messages only, with torch.distributed's signatures.

Lessons 02a and 02b teach these algorithms with `dist.send`/`dist.recv`; this module is what
`dist.broadcast`, `dist.all_reduce` and the rest run. The same algorithms, written on the
group's own point-to-point calls:

- every call takes a fresh tag in call order (`_run`), so consecutive or asynchronous
  collectives never mix their messages; `async_op=True` runs the body on the group's worker;
- `src`/`dst` are global ranks, the algorithms work in group ranks;
- a receive can reduce straight into its destination (`combine=reducer(op)`), and large
  messages travel in segments of SEGMENT_BYTES, so that sending one overlaps receiving the next;
- broadcast and reduce: binomial trees; scatter and gather: straight from and to the root;
  all_gather and reduce_scatter: the ring's two halves; barrier: dissemination;
- all_reduce: "naive" (through rank 0), "ring" (reduce-scatter, then all-gather) and "tree"
  (recursive doubling, extra ranks folded in and out), plus what `course_lib.dist.tuned`
  adds in lesson 10 (Rabenseifner, shared memory, and the choice "auto" makes).

Here: the ring's two halves and the collectives on them (all_gather, reduce_scatter), all_reduce
and its algorithms, and barrier; beside it, `rooted` (broadcast, reduce, scatter, gather) and
`collective_parts` (what they are all written with), whose names are importable from here too.
"""

from __future__ import annotations

import functools
from typing import Sequence

import torch

from course_lib.dist import tuned
from course_lib.dist.collective_parts import (_average, _flat, _run, _wait, _write_back,
                                              check_host, check_list, check_op, reduce_,
                                              reducer)
# Reached here by the tests (test_dist_faults swaps a reduction).
from course_lib.dist.collective_parts import _REDUCERS  # noqa: F401
from course_lib.dist.group import ProcessGroup, ReduceOp, resolve
from course_lib.dist.rooted import broadcast, gather, reduce, scatter
# Lesson 10's names, imported from here by lesson 10 and the tests: course_lib.dist.tuned.
from course_lib.dist.tuned import (ALGORITHMS, AUTO_TREE_MAX_BYTES, set_all_reduce_table,
                                   table_choice)
from course_lib.dist.work import Work
from course_lib.i18n import _

__all__ = ["SEGMENT_BYTES", "AUTO_TREE_MAX_BYTES", "ALGORITHMS", "check_op", "reduce_", "reducer",
    "broadcast", "reduce", "check_list", "gather", "scatter", "ring_reduce_scatter_",
    "ring_all_gather_", "all_gather", "reduce_scatter", "all_reduce", "table_choice",
    "set_all_reduce_table", "barrier"]

SEGMENT_BYTES = 1024 * 1024  # pipelining unit for large messages (gloo also uses 1 MiB)


def _segments(flat: torch.Tensor) -> tuple[torch.Tensor, ...]:
    seg = max(1, SEGMENT_BYTES // flat.element_size())
    return (flat,) if flat.numel() <= seg else flat.split(seg)


def ring_reduce_scatter_(g: ProcessGroup, chunks: Sequence[torch.Tensor], op: ReduceOp,
                         tag: int, name: str, forward_last: bool = False) -> list[Work]:
    """Ring reduce-scatter in place over 1-D `chunks`: rank r ends with chunks[r] reduced.

    Returns the sends still in flight. With `forward_last`, the finished chunk is also sent on
    (the first step of the all-gather that follows in all_reduce).
    """
    p, r = g.size, g.rank
    nxt, prv = (r + 1) % p, (r - 1) % p
    sends = [g.isend(seg, nxt, tag, name) for seg in _segments(chunks[prv])]
    for step in range(p - 1):
        for seg in _segments(chunks[(r - step - 2) % p]):
            # Reduced into place as it arrives (from shared memory, without a temporary): no
            # send of this segment is in flight until it is complete.
            g.recv(seg, prv, tag, name, combine=reducer(op))
            if step < p - 2 or forward_last:
                sends.append(g.isend(seg, nxt, tag, name))
    return sends


def ring_all_gather_(g: ProcessGroup, chunks: Sequence[torch.Tensor], tag: int, name: str,
                     first_sent: bool = False) -> list[Work]:
    """Ring all-gather in place over 1-D `chunks`: rank r starts with chunks[r], ends with all."""
    p, r = g.size, g.rank
    nxt, prv = (r + 1) % p, (r - 1) % p
    sends = [] if first_sent else [g.isend(seg, nxt, tag, name) for seg in _segments(chunks[r])]
    for step in range(p - 1):
        for seg in _segments(chunks[(r - step - 1) % p]):
            g.recv(seg, prv, tag, name)
            if step < p - 2:
                sends.append(g.isend(seg, nxt, tag, name))
    return sends


def all_gather(tensor_list: list[torch.Tensor], tensor: torch.Tensor,
               group: ProcessGroup | None = None, async_op: bool = False) -> Work | None:
    """Every rank receives every rank's tensor into tensor_list (ring, p-1 steps)."""
    def body(g: ProcessGroup, tag: int) -> None:
        check_list(tensor_list, tensor, g.size, "tensor_list")
        tensor_list[g.rank].copy_(tensor)
        if g.size == 1 or tensor.numel() == 0:
            return
        chunks = [_flat(t) for t in tensor_list]
        _wait(ring_all_gather_(g, chunks, tag, "all_gather"))
        for t, flat in zip(tensor_list, chunks):
            _write_back(t, flat)

    return _run(group, "all_gather", async_op, body, tensor, tensor_list)


def reduce_scatter(output: torch.Tensor, input_list: list[torch.Tensor],
                   op: ReduceOp = ReduceOp.SUM, group: ProcessGroup | None = None,
                   async_op: bool = False) -> Work | None:
    """output on rank i = input_list[i] reduced over all ranks (ring, p-1 steps)."""
    op = check_op(op)

    def body(g: ProcessGroup, tag: int) -> None:
        check_list(input_list, output, g.size, "input_list")
        chunks = [t.detach().reshape(-1).clone() for t in input_list]  # inputs stay unchanged
        if g.size > 1 and output.numel() > 0:
            _wait(ring_reduce_scatter_(g, chunks, op, tag, "reduce_scatter"))
        _average(chunks[g.rank], g.size, op)
        output.copy_(chunks[g.rank].view(output.shape))

    check_host(input_list or (), "reduce_scatter")
    return _run(group, "reduce_scatter", async_op, body, output)


def _all_reduce_ring(g: ProcessGroup, flat: torch.Tensor, op: ReduceOp, tag: int,
                     name: str) -> None:
    """reduce_scatter then all_gather: each rank sends 2(p-1)/p of the data."""
    chunks = flat.tensor_split(g.size)
    sends = ring_reduce_scatter_(g, chunks, op, tag, name, forward_last=True)
    # No wait in between: the all-gather's data for a chunk cannot arrive before our
    # reduce-scatter sends of it have left, and waiting here would let both sides block.
    sends += ring_all_gather_(g, chunks, tag, name, first_sent=True)
    _wait(sends)


def _power_of_two_below(p: int) -> int:
    return 1 << (p.bit_length() - 1)


def _fold_in(g: ProcessGroup, flat: torch.Tensor, op: ReduceOp, tag: int,
             name: str) -> int | None:
    """Shrink a group that is not a power of two p' before recursive doubling or halving: of
    the first 2(p - p') ranks each even one hands its data to the odd one after it, which
    reduces it in. Returns this rank's index among the p' ranks that go on (None: sits out)."""
    extra = g.size - _power_of_two_below(g.size)
    if g.rank >= 2 * extra:
        return g.rank - extra
    if g.rank % 2 == 0:
        g.send(flat, g.rank + 1, tag, name)
        return None
    g.recv(flat, g.rank - 1, tag, name, combine=reducer(op))
    return g.rank // 2


def _fold_out(g: ProcessGroup, flat: torch.Tensor, tag: int, name: str) -> None:
    """After `_fold_in`: each odd rank of the first 2(p - p') gives its even one the result."""
    if g.rank < 2 * (g.size - _power_of_two_below(g.size)):
        if g.rank % 2:
            g.send(flat, g.rank - 1, tag, name)
        else:
            g.recv(flat, g.rank + 1, tag, name)


def _group_rank(index: int, p: int) -> int:
    """The group rank of the `index`-th of the ranks that `_fold_in` keeps going."""
    extra = p - _power_of_two_below(p)
    return index * 2 + 1 if index < extra else index + extra


def _all_reduce_tree(g: ProcessGroup, flat: torch.Tensor, op: ReduceOp, tag: int,
                     name: str) -> None:
    """Recursive doubling: lg p exchanges of the whole tensor; extra ranks fold in and out."""
    index = _fold_in(g, flat, op, tag, name)
    if index is not None:
        combine, mask, pof2 = reducer(op), 1, _power_of_two_below(g.size)
        while mask < pof2:
            partner = _group_rank(index ^ mask, g.size)
            # Send flat and reduce the partner's message into it (a temporary holds the message
            # only if our bytes are not out yet). a (op) b == b (op) a bit for bit, so both
            # sides agree whichever way they reduce.
            g.sendrecv(flat, partner, flat, partner, tag, name, combine=combine)
            mask <<= 1
    _fold_out(g, flat, tag, name)


def _all_reduce_naive(g: ProcessGroup, flat: torch.Tensor, op: ReduceOp, tag: int,
                      name: str) -> None:
    """Everyone sends to rank 0, which reduces and sends the result back: root-bound."""
    if g.rank != 0:
        g.send(flat, 0, tag, name)
        g.recv(flat, 0, tag, name)
        return
    for peer_rank in range(1, g.size):
        g.recv(flat, peer_rank, tag, name, combine=reducer(op))
    _wait([g.isend(flat, peer_rank, tag, name) for peer_rank in range(1, g.size)])


def _all_reduce_rabenseifner(g: ProcessGroup, flat: torch.Tensor, op: ReduceOp, tag: int,
                             name: str) -> None:
    """Halving then doubling (`tuned.halve_then_double`) among the ranks that folding leaves:
    lg p rounds each way, the ring's 2(p-1)/p n bytes."""
    index = _fold_in(g, flat, op, tag, name)
    if index is not None:
        tuned.halve_then_double(g, flat, reducer(op), tag, name, index,
                                _power_of_two_below(g.size), lambda i: _group_rank(i, g.size))
    _fold_out(g, flat, tag, name)


def _all_reduce_shared(g: ProcessGroup, flat: torch.Tensor, op: ReduceOp, tag: int,
                       name: str) -> None:
    tuned.all_reduce_shared(g, flat, reducer(op), tag, name)


def _all_reduce_one_shot(g: ProcessGroup, flat: torch.Tensor, op: ReduceOp, tag: int,
                         name: str, turn: int = 0) -> None:
    """Through the group's staging buffer (`tuned.one_shot`); if the first call cannot make
    the buffer, every rank runs recursive doubling instead."""
    if not tuned.one_shot(g, flat, reducer(op), tag, name, turn):
        _all_reduce_tree(g, flat, op, tag, name)


_ALL_REDUCE = {"ring": _all_reduce_ring, "tree": _all_reduce_tree, "naive": _all_reduce_naive,
               "rabenseifner": _all_reduce_rabenseifner, "shared": _all_reduce_shared,
               "one_shot": _all_reduce_one_shot}
assert set(_ALL_REDUCE) == set(ALGORITHMS) - {"auto"}


def all_reduce(tensor: torch.Tensor, op: ReduceOp = ReduceOp.SUM,
               group: ProcessGroup | None = None, async_op: bool = False, *,
               algorithm: str = "auto") -> Work | None:
    """Reduce `tensor` across the group, in place on every rank.

    algorithm: "naive" (via rank 0), "ring" (bandwidth-optimal), "tree" (recursive doubling,
    latency-optimal), "rabenseifner" (halving then doubling: lg p rounds, ring's bytes),
    "shared" (a buffer from `dist.shared_zeros`: peers' copies read in place, lesson 10),
    "one_shot" (every rank on this machine: through the group's shared-memory staging buffer,
    lesson 10), or "auto": `tuned.choose`: "shared" for such a buffer, else the group's
    table's choice for this size and world size (`set_all_reduce_table`). With no table:
    "one_shot" up to ONE_SHOT_MAX_BYTES where the ranks share memory, then tree up to
    AUTO_TREE_MAX_BYTES and ring above (on 2 ranks tree up to 1 MiB, Rabenseifner above).
    """
    op = check_op(op)
    check_host([tensor], "all_reduce")  # before the algorithm looks at its memory
    if algorithm not in ALGORITHMS:
        raise ValueError(_("algorithm must be one of {algorithms}, got {algorithm!r}",
                           algorithms=ALGORITHMS, algorithm=algorithm))
    group = resolve(group, "all_reduce")
    if algorithm == "auto":
        algorithm = tuned.choose(group, tensor)
    impl, name = _ALL_REDUCE[algorithm], f"all_reduce({algorithm})"
    if algorithm == "one_shot" and group.size > 1 and tensor.numel():  # its turn, in call order
        impl = functools.partial(impl, turn=tuned.staging_turn(group, name))

    def body(g: ProcessGroup, tag: int) -> None:
        if g.size == 1 or tensor.numel() == 0:
            return
        flat = _flat(tensor)
        impl(g, flat, op, tag, name)
        _average(flat, g.size, op)
        _write_back(tensor, flat)

    return _run(group, "all_reduce", async_op, body, tensor, algorithm=algorithm)


def barrier(group: ProcessGroup | None = None, async_op: bool = False) -> Work | None:
    """Return once every rank has entered: dissemination, lg p rounds of empty messages."""
    def body(g: ProcessGroup, tag: int) -> None:
        p, r = g.size, g.rank
        token, got = torch.empty(0), torch.empty(0)
        k = 1
        while k < p:
            g.sendrecv(token, (r + k) % p, got, (r - k) % p, tag, "barrier")
            k <<= 1

    return _run(group, "barrier", async_op, body)
