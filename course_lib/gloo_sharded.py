"""Reduce-scatter and all-gather for ZeRO and FSDP on gloo: each piece straight to its owner.

gloo's own `reduce_scatter` and `all_gather` are each slower on CPU than an `all_reduce` of the
same bytes, though the two together should cost what one all-reduce does. ZeRO and FSDP move
every parameter's bytes through one of each per step (FSDP once per unit and pass), so
`sharded_dist(torch.distributed, group)` hands them a `dist` whose two collectives send each
rank's piece straight to its owner: the bytes a ring sends, (N-1)/N of the buffer per rank.

Two ways, chosen by measurement (`python -m course_lib.course.bench zero --unit-blocks K`, worlds
2 and 4). Point to point, every pair at once, from the caller's thread, with no staging copy: for
ZeRO's buckets, which the caller waits for, and FSDP's larger units. One `all_to_all_single`,
which the group's worker thread moves while the caller computes: for FSDP's small units, where
point to point would cost the caller a handshake with every peer per exchange, more than the
exchange's bytes; its staging copies lose for large buffers. A rank at either end of the group
leaves itself out of the all-to-all: its peers' pieces of the buffer are then one block, so it
sends and receives only theirs, and at world 2 stages nothing.

Sums are taken in rank order, so every rank's shard is the same sum whichever rank computes it.
Everything else, and every group that is not gloo, goes to torch.distributed unchanged (NCCL's
own collectives are the fast ones there).
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import torch

from course_lib.backend import default_dist, global_rank
from course_lib.i18n import N_, _

__all__ = ["sharded_dist", "ShardExchanges", "ALL_TO_ALL_MAX_BYTES"]

# Overlapped collectives of buffers up to this size go as one all-to-all: with bench zero's units
# of 1, 2 and 4 blocks, the all-to-all was faster for units of 2 MiB (pieces of 1 MiB at world 2,
# 0.5 MiB at world 4), point to point for units of 4 MiB and more.
ALL_TO_ALL_MAX_BYTES = 3 * 2**20


def sharded_dist(dist: Any = None, group: Any = None, *, overlapped: bool = False) -> Any:
    """The `dist` to use (`default_dist`'s), or, for torch.distributed on a gloo group, a
    `ShardExchanges` over it; `overlapped`: the caller computes while they are in flight."""
    import torch.distributed as tdist

    dist = default_dist(dist)
    if dist is not tdist or not tdist.is_initialized():
        return dist
    try:
        backend = str(tdist.get_backend(group))
    except (RuntimeError, ValueError):  # not a member of `group`: the callers say so
        return dist
    return ShardExchanges(tdist, overlapped) if backend == "gloo" else dist


class _Exchange:
    """A collective in flight; `wait()` ends it, then runs `then()` once, as torch's Work does
    for its result. `what()` names the exchange in an error (built only then: an exchange is on
    every step's hot path)."""

    def __init__(self, works: list[Any], then: Callable[[], None], what: Callable[[], str]):
        self.works, self.then, self.what, self.done = works, then, what, False

    def wait(self, timeout: Any = None) -> bool:
        if not self.done:
            try:
                for work in self.works:
                    work.wait() if timeout is None else work.wait(timeout)
            except RuntimeError as exc:
                raise RuntimeError(f"{self.what()}: {exc}") from exc
            self.then()
            self.done = True
        return True


class ShardExchanges:
    """torch.distributed, with `reduce_scatter` (SUM) and `all_gather` of CPU tensors sent
    straight to their owners (as one all-to-all if `overlapped` and small, else point to point);
    every other name is torch.distributed's own."""

    def __init__(self, dist: Any, overlapped: bool = False):
        self._dist, self.overlapped = dist, overlapped

    def __getattr__(self, name: str) -> Any:
        return getattr(self._dist, name)

    def _rank_world(self, group: Any) -> tuple[int, int]:
        return self._dist.get_rank(group), self._dist.get_world_size(group)

    def _peers(self, group: Any) -> list[int]:
        """The group's ranks as global ranks, in group order."""
        return [global_rank(self._dist, group, r) for r in range(self._rank_world(group)[1])]

    def _as_all_to_all(self, piece: torch.Tensor, world: int) -> bool:
        return (world > 1 and self.overlapped
                and world * piece.numel() * piece.element_size() <= ALL_TO_ALL_MAX_BYTES)

    def _all_to_all(self, output: torch.Tensor, input: torch.Tensor, group: Any,
                    sizes: list[int] | None = None) -> list[Any]:
        """Send `input`'s r-th piece to rank r and receive rank r's into `output`'s r-th (pieces
        of `sizes` elements, or equal ones), on the group's worker thread."""
        return [self._dist.all_to_all_single(output, input, sizes, sizes, group=group,
                                             async_op=True)]

    def _pairwise(self, sends: list[torch.Tensor], recvs: list[torch.Tensor],
                  group: Any) -> list[Any]:
        """Send `sends[k]` to the rank k places after this one and receive `recvs[k]` from the
        rank k places before, for k = 1 .. N-1 (index 0 unused), every pair at once."""
        rank, world = self._rank_world(group)
        peers = self._peers(group)
        ops = []
        for k in range(1, world):
            to, frm = peers[(rank + k) % world], peers[(rank - k) % world]
            ops.append(self._dist.P2POp(self._dist.isend, sends[k], to, group=group))
            ops.append(self._dist.P2POp(self._dist.irecv, recvs[k], frm, group=group))
        return self._dist.batch_isend_irecv(ops) if ops else []

    def _finish(self, what: str, works: list[Any], group: Any, then: Callable[[], None],
                async_op: bool) -> _Exchange | None:
        """The exchange in flight (`async_op`), or None once it is done and `then()` has run."""
        def what_failed() -> str:
            rank, peers = self._dist.get_rank(group), self._peers(group)
            return _("{what} on rank {rank}, exchanging with ranks {peers}", what=what,
                     rank=peers[rank], peers=[p for p in peers if p != peers[rank]])

        exchange = _Exchange(works, then, what_failed)
        if async_op:
            return exchange
        exchange.wait()
        return None

    def reduce_scatter(self, output: torch.Tensor, input_list: Sequence[torch.Tensor],
                       op: Any = None, group: Any = None, async_op: bool = False) -> Any:
        op = self._dist.ReduceOp.SUM if op is None else op
        if op != self._dist.ReduceOp.SUM or not _plain_cpu(output, *input_list):
            return self._dist.reduce_scatter(output, list(input_list), op=op, group=group,
                                             async_op=async_op)
        rank, world = self._rank_world(group)
        _check_shapes("reduce_scatter", input_list, output, world)
        if self._as_all_to_all(output, world):
            send = _as_one(input_list)
            if send is not None and _at_an_end(rank, world) and output.numel():
                m = output.numel()
                got_flat = output.new_empty((world - 1) * m)
                works = self._all_to_all(got_flat, _others(send.view(-1), rank, world, m),
                                         group, _sizes_to_peers(rank, world, m))
                got = list(got_flat.view(world - 1, *output.shape).unbind(0))
                got.insert(rank, None)  # got[r]: from rank r
            else:
                send = send if send is not None else torch.stack(list(input_list))
                got = output.new_empty((world, *output.shape))  # got[r]: from rank r
                works = self._all_to_all(got, send, group)
        else:
            sends = [input_list[(rank + k) % world].contiguous() for k in range(world)]
            recvs = [output, *(torch.empty_like(output) for _ in range(1, world))]  # [0]: unused
            works = self._pairwise(sends, recvs, group)
            got = [recvs[(rank - r) % world] for r in range(world)]  # recvs[k]: k places before
        pieces = [input_list[r] if r == rank else got[r] for r in range(world)]

        def add_in_rank_order() -> None:
            if world == 1:
                output.copy_(pieces[0])
                return
            torch.add(pieces[0], pieces[1], out=output)  # one pass, not a copy and then a sum
            for piece in pieces[2:]:
                output.add_(piece)

        return self._finish("reduce_scatter", works, group, add_in_rank_order, async_op)

    def all_gather(self, tensor_list: Sequence[torch.Tensor], tensor: torch.Tensor,
                   group: Any = None, async_op: bool = False) -> Any:
        if not _plain_cpu(*tensor_list) or tensor.device.type != "cpu":
            return self._dist.all_gather(list(tensor_list), tensor, group=group,
                                         async_op=async_op)
        rank, world = self._rank_world(group)
        _check_shapes("all_gather", tensor_list, tensor, world)
        if self._as_all_to_all(tensor, world):
            together = _as_one(tensor_list)  # the pieces land in place when they are one buffer
            into = together if together is not None else tensor.new_empty((world, *tensor.shape))
            m = tensor.numel()
            if _at_an_end(rank, world) and m:
                mine = tensor.reshape(-1)
                if world > 2:  # one per peer
                    mine = mine.unsqueeze(0).expand(world - 1, m).reshape(-1)
                works = self._all_to_all(_others(into.view(-1), rank, world, m), mine, group,
                                         _sizes_to_peers(rank, world, m))
                into[rank].copy_(tensor)  # while the peers' pieces travel
            else:
                mine = tensor.unsqueeze(0).expand(world, *tensor.shape).contiguous()  # one each
                works = self._all_to_all(into, mine, group)

            def place() -> None:  # the all-to-all put the own piece in place too
                if together is None:
                    for piece, got in zip(tensor_list, into):
                        piece.copy_(got)
        else:
            recvs = [tensor_list[(rank - k) % world] for k in range(world)]
            works = self._pairwise([tensor.contiguous()] * world, recvs, group)

            def place() -> None:
                if tensor_list[rank].data_ptr() != tensor.data_ptr():
                    tensor_list[rank].copy_(tensor)

        return self._finish("all_gather", works, group, place, async_op)


_SHAPES = {  # what a collective's list of tensors and its single one must agree on
    "reduce_scatter": N_("reduce_scatter: {n} inputs of shapes {shapes} for a group of {world} "
                         "and an output of shape {shape}"),
    "all_gather": N_("all_gather: {n} outputs of shapes {shapes} for a group of {world} and an "
                     "input of shape {shape}"),
}


def _check_shapes(what: str, pieces: Sequence[torch.Tensor], one: torch.Tensor,
                  world: int) -> None:
    """One piece per rank, each of `one`'s shape, or a clear error naming them."""
    if len(pieces) != world or any(t.shape != one.shape for t in pieces):
        raise ValueError(_(_SHAPES[what], n=len(pieces), shapes=[tuple(t.shape) for t in pieces],
                           world=world, shape=tuple(one.shape)))


def _at_an_end(rank: int, world: int) -> bool:
    """Whether the peers' pieces of a flat buffer are one block beside this rank's own."""
    return rank in (0, world - 1)


def _others(flat: torch.Tensor, rank: int, world: int, m: int) -> torch.Tensor:
    """The block of a flat buffer of `world` pieces of `m` elements that is not the piece of
    `rank`, at either end."""
    return flat[m:] if rank == 0 else flat[:(world - 1) * m]


def _sizes_to_peers(rank: int, world: int, m: int) -> list[int]:
    """all_to_all_single's split sizes that leave this rank out: `m` to or from each peer."""
    return [0 if r == rank else m for r in range(world)]


def _as_one(pieces: Sequence[torch.Tensor]) -> torch.Tensor | None:
    """The pieces as one tensor of shape (N, *piece) over their own memory, when they lie
    back to back in one storage (a flat buffer's chunks), else None."""
    first = pieces[0]
    step = first.numel() * first.element_size()
    if not all(t.is_contiguous() and t.untyped_storage().data_ptr()
               == first.untyped_storage().data_ptr()
               and t.data_ptr() == first.data_ptr() + k * step for k, t in enumerate(pieces)):
        return None
    return first.new_empty(0).set_(first.untyped_storage(), first.storage_offset(),
                                   (len(pieces), *first.shape))


def _plain_cpu(*tensors: torch.Tensor) -> bool:
    """Tensors this exchange can take as they are: on the CPU, and receivable in place."""
    return all(t.device.type == "cpu" and t.is_contiguous() for t in tensors)
