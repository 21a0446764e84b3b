"""all_to_all and all_to_all_single from point-to-point messages: the collective expert
parallelism runs on, with torch.distributed's signatures.

Rank r's input is p blocks, block j meant for rank j; afterwards block i of rank r's output is
what rank i held for rank r: the p x p matrix of blocks is transposed across the ranks. Block
sizes may differ (`input_split_sizes` / `output_split_sizes`, 0 included); a rank's own block
is copied, never sent. Two algorithms, written like `course_lib.dist.collectives` on the
group's own point-to-point calls (one fresh tag per call, the flight recorder, `_run`).
Lesson 13 (experts) builds the pairwise schedule; this module is its reference:

- "pairwise" (default): p - 1 rounds, one message out and one in per rank per round
  (`pairwise_peers`). When p is a power of two, round s pairs r with r XOR s both ways: each
  round is a perfect matching in which pairs swap blocks over one link (MPICH's choice). For
  other p, XOR would name ranks >= p, so round s sends to (r + s) % p and receives from
  (r - s) % p, a shift.
  Why it never deadlocks: in round s, rank r waits for one message only, from
  q = recv_from(r, s); and send_to(q, s) == r, so q sends it in the same round, started before
  q waits for anything (MPI_Sendrecv's order). If every rank finishes round s - 1, every rank
  starts round s, so every rank finishes it: by induction, all p - 1 rounds end.
  `check_schedule` proves this for a given p, and that every pair exchanges exactly once.
- "naive": every rank starts all p - 1 sends at once, in rank order (so every rank's first
  message heads for rank 0: incast), then receives in rank order. Deadlock-free as well (no
  rank waits before all its sends are started), but p - 1 messages per rank in flight at once.

Alpha-beta models: `pairwise_time`, `naive_time` (and `even_time` for equal blocks).
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch

from course_lib.dist.collective_parts import _run, _wait
from course_lib.dist.group import ProcessGroup, resolve
from course_lib.dist.peer import overlaps
from course_lib.dist.work import Work
from course_lib.i18n import _

ALGORITHMS = ("pairwise", "naive")

__all__ = ["ALGORITHMS", "all_to_all", "all_to_all_single", "pairwise_peers", "schedule",
           "check_schedule", "pairwise_time", "naive_time", "even_time", "sent_bytes"]


# --- the schedule ------------------------------------------------------------------------------

def is_power_of_two(p: int) -> bool:
    """Whether p is 1, 2, 4, 8, ..."""
    return p > 0 and p & (p - 1) == 0


Peers = Callable[[int, int, int], tuple[int, int]]  # (rank, world_size, step) -> (to, from)


def pairwise_peers(rank: int, world_size: int, step: int) -> tuple[int, int]:
    """(send_to, recv_from) of `rank` in round `step` (1 .. p - 1) of the pairwise exchange."""
    if is_power_of_two(world_size):
        partner = rank ^ step
        return partner, partner
    return (rank + step) % world_size, (rank - step) % world_size


def schedule(world_size: int, peers: Peers = pairwise_peers) -> list[list[tuple[int, int]]]:
    """Round by round, each rank's (send_to, recv_from): what a picture of the exchange draws."""
    return [[peers(r, world_size, s) for r in range(world_size)] for s in range(1, world_size)]


def check_schedule(world_size: int, peers: Peers = pairwise_peers) -> list[str]:
    """What keeps `peers` from being a deadlock-free all_to_all on `world_size` ranks ([]: none).

    Deadlock-free: in every round, the rank r sends to receives from r in that same round.
    Complete: over the rounds, each rank sends to every other rank once and receives once.
    """
    p, problems = world_size, []
    sent = {r: [] for r in range(p)}
    got = {r: [] for r in range(p)}
    for s, pairs in enumerate(schedule(p, peers), start=1):
        for r, (to, frm) in enumerate(pairs):
            if not (0 <= to < p and 0 <= frm < p) or r in (to, frm):
                problems.append(_("round {s}: rank {r} sends to {to} and receives from {frm}: "
                                  "not another rank of 0..{last}", s=s, r=r, to=to, frm=frm,
                                  last=p - 1))
                continue
            sent[r].append(to)
            got[r].append(frm)
            their_frm = pairs[to][1]
            if their_frm != r:
                problems.append(_("round {s}: rank {r} sends to rank {to}, which receives "
                                  "from rank {their_frm} in that round: rank {r}'s message "
                                  "waits, and rank {to} waits for a message rank {their_frm} "
                                  "does not send then", s=s, r=r, to=to, their_frm=their_frm))
    for r in range(p):
        others = sorted(set(range(p)) - {r})
        if sorted(sent[r]) != others:
            problems.append(_("rank {r} sends to {sent}, not once to each of {others}", r=r,
                              sent=sorted(sent[r]), others=others))
        if sorted(got[r]) != others:
            problems.append(_("rank {r} receives from {got}, not once from each of {others}",
                              r=r, got=sorted(got[r]), others=others))
    return problems


# --- the exchange, on a ProcessGroup -------------------------------------------------------------

def _exchange_pairwise(g: ProcessGroup, outputs: Sequence[torch.Tensor],
                       inputs: Sequence[torch.Tensor], tag: int, name: str) -> None:
    """p - 1 rounds of one send and one receive each (`pairwise_peers`)."""
    for step in range(1, g.size):
        to, frm = pairwise_peers(g.rank, g.size, step)
        g.sendrecv(inputs[to], to, outputs[frm], frm, tag, name)


def _exchange_naive(g: ProcessGroup, outputs: Sequence[torch.Tensor],
                    inputs: Sequence[torch.Tensor], tag: int, name: str) -> None:
    """Every send started at once, in rank order; then every receive, in rank order."""
    others = [q for q in range(g.size) if q != g.rank]
    sends = [g.isend(inputs[q], q, tag, name) for q in others]
    for q in others:
        g.recv(outputs[q], q, tag, name)
    _wait(sends)


_EXCHANGE = {"pairwise": _exchange_pairwise, "naive": _exchange_naive}


def _body(outputs: Sequence[torch.Tensor], inputs: Sequence[torch.Tensor], algorithm: str,
          name: str, finish=None):
    """The collective's body for `_run`: own block copied, the others exchanged."""
    def body(g: ProcessGroup, tag: int) -> None:
        outputs[g.rank].copy_(inputs[g.rank])
        if g.size > 1:
            _EXCHANGE[algorithm](g, outputs, inputs, tag, name)
        if finish is not None:
            finish()
    return body


def _check_algorithm(algorithm: str) -> None:
    if algorithm not in ALGORITHMS:
        raise ValueError(_("all_to_all algorithm must be one of {algorithms}, got {algorithm!r}",
                           algorithms=ALGORITHMS, algorithm=algorithm))


def _sendable(t: torch.Tensor) -> torch.Tensor:
    """`t` as a message: detached from autograd, contiguous."""
    t = t.detach()
    return t if t.is_contiguous() else t.contiguous()


def check_lists(output_tensor_list: Sequence[torch.Tensor],
                input_tensor_list: Sequence[torch.Tensor], size: int, group_rank: int,
                rank: int) -> None:
    """all_to_all's argument errors, on a group of `size` ranks in which this process is
    `group_rank` (`rank` in the world, the number the errors name)."""
    for what, tensors in (("output_tensor_list", output_tensor_list),
                          ("input_tensor_list", input_tensor_list)):
        if len(tensors) != size:
            raise ValueError(_("all_to_all: {what} must hold one tensor per rank of the group "
                               "({size}), got {n}", what=what, size=size, n=len(tensors)))
    dtypes = {t.dtype for t in (*output_tensor_list, *input_tensor_list)}
    if len(dtypes) > 1:
        raise ValueError(_("all_to_all: every tensor must have one dtype, got {dtypes}",
                           dtypes=sorted(map(str, dtypes))))
    mine_in, mine_out = input_tensor_list[group_rank], output_tensor_list[group_rank]
    if mine_in.shape != mine_out.shape:
        raise ValueError(_("all_to_all: rank {rank}'s own block is {in_shape} in "
                           "input_tensor_list but {out_shape} in output_tensor_list", rank=rank,
                           in_shape=list(mine_in.shape), out_shape=list(mine_out.shape)))


def all_to_all(output_tensor_list: list[torch.Tensor], input_tensor_list: list[torch.Tensor],
               group: ProcessGroup | None = None, async_op: bool = False, *,
               algorithm: str = "pairwise") -> Work | None:
    """input_tensor_list[j] of rank i lands in output_tensor_list[i] of rank j."""
    _check_algorithm(algorithm)
    g = resolve(group, "all_to_all")
    check_lists(output_tensor_list, input_tensor_list, g.size, g.rank, g.transport.rank)
    inputs = [_sendable(t) for t in input_tensor_list]
    outputs = [t.detach() for t in output_tensor_list]  # a receive fills a stand-in if strided
    name = f"all_to_all({algorithm})"
    return _run(g, "all_to_all", async_op, _body(outputs, inputs, algorithm, name),
                None, output_tensor_list, algorithm)


def _splits(sizes: Sequence[int] | None, tensor: torch.Tensor, p: int, what: str) -> list[int]:
    """The block sizes along dim 0 (even when None), checked against `tensor`."""
    n = tensor.shape[0] if tensor.dim() else 1
    if sizes is None or len(sizes) == 0:  # torch accepts [] for "even" too
        if n % p:
            raise ValueError(_("all_to_all_single: {what} has {n} rows, which {p} ranks cannot "
                               "split evenly; pass {what}_split_sizes", what=what, n=n, p=p))
        return [n // p] * p
    sizes = [int(s) for s in sizes]
    if len(sizes) != p or min(sizes) < 0:
        raise ValueError(_("all_to_all_single: {what}_split_sizes must be {p} non-negative "
                           "ints, got {sizes}", what=what, p=p, sizes=sizes))
    if sum(sizes) != n:
        raise ValueError(_("all_to_all_single: {what}_split_sizes {sizes} add up to {total}, "
                           "but {what} has {n} rows", what=what, sizes=sizes, total=sum(sizes),
                           n=n))
    return sizes


def check_single(output: torch.Tensor, input: torch.Tensor,
                 output_split_sizes: Sequence[int] | None,
                 input_split_sizes: Sequence[int] | None, size: int, group_rank: int,
                 rank: int) -> tuple[list[int], list[int]]:
    """all_to_all_single's argument errors (as `check_lists`); returns (in_sizes, out_sizes),
    the rows of each block of `input` and of `output`."""
    if input.dtype != output.dtype or input.shape[1:] != output.shape[1:]:
        raise ValueError(_("all_to_all_single: input {in_dtype} {in_shape} and output "
                           "{out_dtype} {out_shape} must share dtype and trailing dims",
                           in_dtype=input.dtype, in_shape=list(input.shape),
                           out_dtype=output.dtype, out_shape=list(output.shape)))
    in_sizes = _splits(input_split_sizes, input, size, "input")
    out_sizes = _splits(output_split_sizes, output, size, "output")
    if in_sizes[group_rank] != out_sizes[group_rank]:
        raise ValueError(_("all_to_all_single: rank {rank} keeps {kept} rows of its input but "
                           "expects {expected}", rank=rank, kept=in_sizes[group_rank],
                           expected=out_sizes[group_rank]))
    return in_sizes, out_sizes


def all_to_all_single(output: torch.Tensor, input: torch.Tensor,
                      output_split_sizes: Sequence[int] | None = None,
                      input_split_sizes: Sequence[int] | None = None,
                      group: ProcessGroup | None = None, async_op: bool = False, *,
                      algorithm: str = "pairwise") -> Work | None:
    """Split `input` along dim 0 by input_split_sizes, block j to rank j; `output` gathers the
    blocks from ranks 0..p-1 in order, sized by output_split_sizes (even splits when None)."""
    _check_algorithm(algorithm)
    g = resolve(group, "all_to_all_single")
    in_sizes, out_sizes = check_single(output, input, output_split_sizes, input_split_sizes,
                                       g.size, g.rank, g.transport.rank)
    source = _sendable(input)
    if overlaps(source, output):
        source = source.clone()  # in place: the blocks we send must not be overwritten first
    out = output.detach()
    landing = out if out.is_contiguous() else torch.empty_like(
        out, memory_format=torch.contiguous_format)
    finish = None if landing is out else (lambda: out.copy_(landing))
    inputs = source.reshape(-1, *input.shape[1:]).split(in_sizes)
    outputs = landing.reshape(-1, *output.shape[1:]).split(out_sizes)
    name = f"all_to_all_single({algorithm})"
    return _run(g, "all_to_all_single", async_op, _body(outputs, inputs, algorithm, name, finish),
                None, [output], algorithm)


# --- the alpha-beta models ---------------------------------------------------------------------

def pairwise_time(block_bytes: Sequence[Sequence[float]], alpha: float, beta: float) -> float:
    """Modelled seconds of the pairwise exchange, block_bytes[i][j] being what rank i sends rank
    j: p - 1 rounds, each as long as its largest message, alpha + beta * bytes (a round waits on
    its partner, so rounds run in step: exact for equal blocks, an upper bound otherwise)."""
    p = len(block_bytes)
    rounds = (max(block_bytes[r][pairwise_peers(r, p, s)[0]] for r in range(p))
              for s in range(1, p))
    return sum(alpha + beta * b for b in rounds)


def naive_time(block_bytes: Sequence[Sequence[float]], alpha: float, beta: float) -> float:
    """Modelled seconds of the naive exchange: each rank starts p - 1 messages, alpha each, then
    its one port carries its outgoing and incoming bytes (full duplex); the busiest port
    decides. A lower bound: it leaves out incast (everyone's first message to rank 0)."""
    p = len(block_bytes)
    out = [sum(block_bytes[r]) - block_bytes[r][r] for r in range(p)]
    inc = [sum(block_bytes[i][r] for i in range(p)) - block_bytes[r][r] for r in range(p)]
    return (p - 1) * alpha + beta * max(max(out), max(inc)) if p > 1 else 0.0


def even_time(nbytes: float, world_size: int, alpha: float, beta: float) -> float:
    """Either algorithm with equal blocks, `nbytes` being each rank's whole input:
    (p - 1) (alpha + beta nbytes / p)."""
    p = world_size
    return (p - 1) * (alpha + beta * nbytes / p)


def sent_bytes(input_split_sizes: Sequence[int], rank: int, row_bytes: int) -> int:
    """Bytes `rank` sends to other ranks (its own block stays): the count a test compares."""
    return sum(n for j, n in enumerate(input_split_sizes) if j != rank) * row_bytes
