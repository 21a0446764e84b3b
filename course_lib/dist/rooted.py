"""The collectives with a root, built from point-to-point messages only (see `collectives`):
broadcast and reduce on binomial trees (broadcast also "naive": the root sends to each rank),
scatter and gather straight from and to the root. `src`/`dst` are global ranks; the algorithms
work in group ranks.
"""

from __future__ import annotations

import torch

from course_lib.dist.collective_parts import (_average, _flat, _run, _wait, _write_back,
                                              check_host, check_list, check_op, reduce_)
from course_lib.dist.group import ProcessGroup, ReduceOp
from course_lib.dist.work import Work
from course_lib.i18n import _


def broadcast(tensor: torch.Tensor, src: int, group: ProcessGroup | None = None,
              async_op: bool = False, *, algorithm: str = "tree") -> Work | None:
    """Copy rank `src`'s tensor to every rank: "naive" (src sends p-1 times) or binomial "tree"."""
    if algorithm not in ("naive", "tree"):
        raise ValueError(_("broadcast algorithm must be 'naive' or 'tree', got {algorithm!r}",
                           algorithm=algorithm))
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

    return _run(group, "broadcast", async_op, body, tensor)


def reduce(tensor: torch.Tensor, dst: int, op: ReduceOp = ReduceOp.SUM,
           group: ProcessGroup | None = None, async_op: bool = False) -> Work | None:
    """Reduce onto rank `dst` along a binomial tree; other ranks' tensors are left unchanged."""
    op = check_op(op)
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

    return _run(group, name, async_op, body, tensor)


def gather(tensor: torch.Tensor, gather_list: list[torch.Tensor] | None = None, dst: int = 0,
           group: ProcessGroup | None = None, async_op: bool = False) -> Work | None:
    """Rank `dst` receives every rank's tensor into gather_list (in group rank order)."""
    def body(g: ProcessGroup, tag: int) -> None:
        root = g.group_rank(dst, "dst")
        if g.rank != root:
            return g.send(tensor, root, tag, "gather")
        check_list(gather_list, tensor, g.size, "gather_list")
        for i, out in enumerate(gather_list):
            if i == root:
                out.copy_(tensor)
            else:
                g.recv(out, i, tag, "gather")

    check_host(gather_list or (), "gather")
    return _run(group, "gather", async_op, body, tensor)


def scatter(tensor: torch.Tensor, scatter_list: list[torch.Tensor] | None = None, src: int = 0,
            group: ProcessGroup | None = None, async_op: bool = False) -> Work | None:
    """Rank `src` sends scatter_list[i] to group rank i, which receives it into `tensor`."""
    def body(g: ProcessGroup, tag: int) -> None:
        root = g.group_rank(src, "src")
        if g.rank != root:
            return g.recv(tensor, root, tag, "scatter")
        check_list(scatter_list, tensor, g.size, "scatter_list")
        sends = [g.isend(t, i, tag, "scatter") for i, t in enumerate(scatter_list) if i != root]
        tensor.copy_(scatter_list[root])
        _wait(sends)

    check_host(scatter_list or (), "scatter")
    return _run(group, "scatter", async_op, body, tensor)
