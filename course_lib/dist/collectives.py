"""Collectives built from point-to-point messages only, with torch.distributed's signatures.

`src`/`dst` are global ranks. Large messages travel in segments so that sending one segment
overlaps receiving (and reducing) the next. Every call gets its own tag, so consecutive or
asynchronous collectives never mix their messages.
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch

from course_lib.dist.group import ProcessGroup, ReduceOp, resolve
from course_lib.dist.peer import Work

SEGMENT_BYTES = 1024 * 1024  # pipelining unit for large messages (gloo also uses 1 MiB)
AUTO_TREE_MAX_BYTES = 256 * 1024  # all_reduce "auto": recursive doubling up to here, ring above
ALGORITHMS = ("auto", "naive", "ring", "tree")


def _run(group: ProcessGroup | None, name: str, async_op: bool,
         body: Callable[[ProcessGroup, int], None]) -> Work | None:
    """Run `body(group, tag)` now, or on the group's worker thread when `async_op`."""
    g = resolve(group, name)
    tag = g.collective_tag()  # taken in call order, so every rank agrees on it
    if async_op:
        return g.submit(lambda: body(g, tag), name)
    body(g, tag)
    return None


def _check_op(op) -> ReduceOp:
    """Our ReduceOp, also accepting torch.distributed.ReduceOp.SUM etc. by name."""
    if isinstance(op, ReduceOp):
        return op
    name = str(op).rsplit(".", 1)[-1].upper()
    if name in ReduceOp.__members__:
        return ReduceOp[name]
    raise TypeError(f"op must be a course_lib.dist.ReduceOp, got {op!r}")


def reduce_(acc: torch.Tensor, other: torch.Tensor, op: ReduceOp) -> None:
    """acc = acc (op) other, in place (AVG sums; the caller divides at the end)."""
    if op in (ReduceOp.SUM, ReduceOp.AVG):
        if acc.dtype == torch.bool:
            acc.logical_or_(other)
        else:
            acc.add_(other)
    elif op is ReduceOp.PRODUCT:
        if acc.dtype == torch.bool:
            acc.logical_and_(other)
        else:
            acc.mul_(other)
    elif op is ReduceOp.MAX:
        torch.maximum(acc, other, out=acc)
    else:
        torch.minimum(acc, other, out=acc)


def _average(t: torch.Tensor, n: int, op: ReduceOp) -> None:
    """AVG's final division; integers round down (floor), as `sum // n` does."""
    if op is ReduceOp.AVG and n > 1:
        if t.is_floating_point() or t.is_complex():
            t.div_(n)
        else:
            t.copy_(torch.div(t, n, rounding_mode="floor"))


def _flat(t: torch.Tensor) -> torch.Tensor:
    """A 1-D contiguous view of `t` (a copy only if `t` is not contiguous; see `_write_back`)."""
    return t.detach().reshape(-1) if t.is_contiguous() else t.detach().contiguous().view(-1)


def _write_back(t: torch.Tensor, flat: torch.Tensor) -> None:
    if flat.data_ptr() != t.data_ptr() or not t.is_contiguous():
        t.copy_(flat.view(t.shape))


def _segments(flat: torch.Tensor) -> tuple[torch.Tensor, ...]:
    seg = max(1, SEGMENT_BYTES // flat.element_size())
    return (flat,) if flat.numel() <= seg else flat.split(seg)


def _wait(works: Sequence[Work]) -> None:
    for w in works:
        w.wait()


# --- ring building blocks -----------------------------------------------------------------

def ring_reduce_scatter_(g: ProcessGroup, chunks: Sequence[torch.Tensor], op: ReduceOp,
                         tag: int, name: str, forward_last: bool = False) -> list[Work]:
    """Ring reduce-scatter in place over 1-D `chunks`: rank r ends with chunks[r] reduced.

    Returns the sends still in flight. With `forward_last`, the finished chunk is also sent on
    (the first step of the all-gather that follows in all_reduce).
    """
    p, r = g.size, g.rank
    nxt, prv = (r + 1) % p, (r - 1) % p
    sends = [g.isend(seg, nxt, tag, name) for seg in _segments(chunks[prv])]
    seg_elems = max(1, SEGMENT_BYTES // chunks[0].element_size())
    tmp = torch.empty(min(seg_elems, max(c.numel() for c in chunks)), dtype=chunks[0].dtype)
    for step in range(p - 1):
        for seg in _segments(chunks[(r - step - 2) % p]):
            incoming = tmp[:seg.numel()]
            g.recv(incoming, prv, tag, name)
            reduce_(seg, incoming, op)
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


# --- all_reduce -----------------------------------------------------------------------------

def _all_reduce_ring(g: ProcessGroup, flat: torch.Tensor, op: ReduceOp, tag: int,
                     name: str) -> None:
    """reduce_scatter then all_gather: each rank sends 2(p-1)/p of the data."""
    chunks = flat.tensor_split(g.size)
    sends = ring_reduce_scatter_(g, chunks, op, tag, name, forward_last=True)
    # No wait in between: the all-gather's data for a chunk cannot arrive before our
    # reduce-scatter sends of it have left, and waiting here would let both sides block.
    sends += ring_all_gather_(g, chunks, tag, name, first_sent=True)
    _wait(sends)


def _all_reduce_tree(g: ProcessGroup, flat: torch.Tensor, op: ReduceOp, tag: int,
                     name: str) -> None:
    """Recursive doubling: lg p exchanges of the whole tensor; extra ranks fold in and out."""
    p, r = g.size, g.rank
    pof2 = 1 << (p.bit_length() - 1)
    extra = p - pof2  # ranks 0..2*extra-1 pair up: evens hand their data to the odd neighbour
    tmp = torch.empty_like(flat)
    if r < 2 * extra and r % 2 == 0:
        g.send(flat, r + 1, tag, name)
        g.recv(flat, r + 1, tag, name)
        return
    if r < 2 * extra:
        g.recv(tmp, r - 1, tag, name)
        reduce_(flat, tmp, op)
    vrank = r // 2 if r < 2 * extra else r - extra
    mask = 1
    while mask < pof2:
        vpeer = vrank ^ mask
        peer = vpeer * 2 + 1 if vpeer < extra else vpeer + extra
        work = g.isend(flat, peer, tag, name)
        g.recv(tmp, peer, tag, name)
        work.wait()
        reduce_(flat, tmp, op)  # a (op) b == b (op) a bit for bit, so both sides agree
        mask <<= 1
    if r < 2 * extra:
        g.send(flat, r - 1, tag, name)


def _all_reduce_naive(g: ProcessGroup, flat: torch.Tensor, op: ReduceOp, tag: int,
                      name: str) -> None:
    """Everyone sends to rank 0, which reduces and sends the result back: root-bound."""
    if g.rank != 0:
        g.send(flat, 0, tag, name)
        g.recv(flat, 0, tag, name)
        return
    tmp = torch.empty_like(flat)
    for peer in range(1, g.size):
        g.recv(tmp, peer, tag, name)
        reduce_(flat, tmp, op)
    _wait([g.isend(flat, peer, tag, name) for peer in range(1, g.size)])


_ALL_REDUCE = {"ring": _all_reduce_ring, "tree": _all_reduce_tree, "naive": _all_reduce_naive}


def all_reduce(tensor: torch.Tensor, op: ReduceOp = ReduceOp.SUM,
               group: ProcessGroup | None = None, async_op: bool = False, *,
               algorithm: str = "auto") -> Work | None:
    """Reduce `tensor` across the group, in place on every rank.

    algorithm: "naive" (via rank 0), "ring" (bandwidth-optimal), "tree" (recursive doubling,
    latency-optimal), or "auto" (tree up to AUTO_TREE_MAX_BYTES, ring above).
    """
    op = _check_op(op)
    if algorithm not in ALGORITHMS:
        raise ValueError(f"algorithm must be one of {ALGORITHMS}, got {algorithm!r}")
    if algorithm == "auto":
        small = tensor.numel() * tensor.element_size() <= AUTO_TREE_MAX_BYTES
        algorithm = "tree" if small else "ring"
    impl = _ALL_REDUCE[algorithm]

    def body(g: ProcessGroup, tag: int) -> None:
        if g.size == 1 or tensor.numel() == 0:
            return
        flat = _flat(tensor)
        impl(g, flat, op, tag, f"all_reduce({algorithm})")
        _average(flat, g.size, op)
        _write_back(tensor, flat)

    return _run(group, "all_reduce", async_op, body)


# --- the other collectives ------------------------------------------------------------------

def broadcast(tensor: torch.Tensor, src: int, group: ProcessGroup | None = None,
              async_op: bool = False, *, algorithm: str = "tree") -> Work | None:
    """Copy rank `src`'s tensor to every rank: "naive" (src sends p-1 times) or binomial "tree"."""
    if algorithm not in ("naive", "tree"):
        raise ValueError(f"broadcast algorithm must be 'naive' or 'tree', got {algorithm!r}")
    name = f"broadcast({algorithm})"

    def body(g: ProcessGroup, tag: int) -> None:
        p, root = g.size, g.group_rank(src, "src")
        vrank = (g.rank - root) % p
        if algorithm == "naive":
            if vrank == 0:
                _wait([g.isend(tensor, i, tag, name) for i in range(p) if i != root])
            else:
                g.recv(tensor, root, tag, name)
            return
        mask = 1
        while mask < p:  # receive from the parent: clear our lowest set bit
            if vrank & mask:
                g.recv(tensor, (vrank - mask + root) % p, tag, name)
                break
            mask <<= 1
        mask >>= 1
        sends = []
        while mask > 0:  # then send to the children below that bit
            if vrank + mask < p:
                sends.append(g.isend(tensor, (vrank + mask + root) % p, tag, name))
            mask >>= 1
        _wait(sends)

    return _run(group, "broadcast", async_op, body)


def reduce(tensor: torch.Tensor, dst: int, op: ReduceOp = ReduceOp.SUM,
           group: ProcessGroup | None = None, async_op: bool = False) -> Work | None:
    """Reduce onto rank `dst` along a binomial tree; other ranks' tensors are left unchanged."""
    op = _check_op(op)
    name = "reduce"

    def body(g: ProcessGroup, tag: int) -> None:
        p, root = g.size, g.group_rank(dst, "dst")
        vrank = (g.rank - root) % p
        acc = _flat(tensor) if vrank == 0 else tensor.detach().reshape(-1).clone()
        tmp = torch.empty_like(acc)
        mask = 1
        while mask < p:
            if vrank & mask:
                g.send(acc, (vrank - mask + root) % p, tag, name)
                return
            if vrank + mask < p:
                g.recv(tmp, (vrank + mask + root) % p, tag, name)
                reduce_(acc, tmp, op)
            mask <<= 1
        _average(acc, p, op)
        _write_back(tensor, acc)

    return _run(group, name, async_op, body)


def _check_list(tensors: Sequence[torch.Tensor] | None, like: torch.Tensor, p: int,
                what: str) -> None:
    if tensors is None or len(tensors) != p:
        raise ValueError(f"{what} must hold one tensor per rank of the group ({p})")
    for t in tensors:
        if t.shape != like.shape or t.dtype != like.dtype:
            raise ValueError(f"{what}: every tensor must be {like.dtype} {list(like.shape)}, "
                             f"got {t.dtype} {list(t.shape)}")


def gather(tensor: torch.Tensor, gather_list: list[torch.Tensor] | None = None, dst: int = 0,
           group: ProcessGroup | None = None, async_op: bool = False) -> Work | None:
    """Rank `dst` receives every rank's tensor into gather_list (in group rank order)."""
    def body(g: ProcessGroup, tag: int) -> None:
        root = g.group_rank(dst, "dst")
        if g.rank != root:
            return g.send(tensor, root, tag, "gather")
        _check_list(gather_list, tensor, g.size, "gather_list")
        for i, out in enumerate(gather_list):
            if i == root:
                out.copy_(tensor)
            else:
                g.recv(out, i, tag, "gather")

    return _run(group, "gather", async_op, body)


def scatter(tensor: torch.Tensor, scatter_list: list[torch.Tensor] | None = None, src: int = 0,
            group: ProcessGroup | None = None, async_op: bool = False) -> Work | None:
    """Rank `src` sends scatter_list[i] to group rank i, which receives it into `tensor`."""
    def body(g: ProcessGroup, tag: int) -> None:
        root = g.group_rank(src, "src")
        if g.rank != root:
            return g.recv(tensor, root, tag, "scatter")
        _check_list(scatter_list, tensor, g.size, "scatter_list")
        sends = [g.isend(t, i, tag, "scatter") for i, t in enumerate(scatter_list) if i != root]
        tensor.copy_(scatter_list[root])
        _wait(sends)

    return _run(group, "scatter", async_op, body)


def all_gather(tensor_list: list[torch.Tensor], tensor: torch.Tensor,
               group: ProcessGroup | None = None, async_op: bool = False) -> Work | None:
    """Every rank receives every rank's tensor into tensor_list (ring, p-1 steps)."""
    def body(g: ProcessGroup, tag: int) -> None:
        _check_list(tensor_list, tensor, g.size, "tensor_list")
        tensor_list[g.rank].copy_(tensor)
        if g.size == 1 or tensor.numel() == 0:
            return
        chunks = [_flat(t) for t in tensor_list]
        _wait(ring_all_gather_(g, chunks, tag, "all_gather"))
        for t, flat in zip(tensor_list, chunks):
            _write_back(t, flat)

    return _run(group, "all_gather", async_op, body)


def reduce_scatter(output: torch.Tensor, input_list: list[torch.Tensor],
                   op: ReduceOp = ReduceOp.SUM, group: ProcessGroup | None = None,
                   async_op: bool = False) -> Work | None:
    """output on rank i = input_list[i] reduced over all ranks (ring, p-1 steps)."""
    op = _check_op(op)

    def body(g: ProcessGroup, tag: int) -> None:
        _check_list(input_list, output, g.size, "input_list")
        chunks = [t.detach().reshape(-1).clone() for t in input_list]  # inputs stay unchanged
        if g.size > 1 and output.numel() > 0:
            _wait(ring_reduce_scatter_(g, chunks, op, tag, "reduce_scatter"))
        _average(chunks[g.rank], g.size, op)
        output.copy_(chunks[g.rank].view(output.shape))

    return _run(group, "reduce_scatter", async_op, body)


def barrier(group: ProcessGroup | None = None, async_op: bool = False) -> Work | None:
    """Return once every rank has entered: dissemination, lg p rounds of empty messages."""
    def body(g: ProcessGroup, tag: int) -> None:
        p, r = g.size, g.rank
        token, got = torch.empty(0), torch.empty(0)
        k = 1
        while k < p:
            work = g.isend(token, (r + k) % p, tag, "barrier")
            g.recv(got, (r - k) % p, tag, "barrier")
            work.wait()
            k <<= 1

    return _run(group, "barrier", async_op, body)
