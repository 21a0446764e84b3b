"""Reduce-scatter and all-gather for the sharded optimizers on a gloo group, over point to point.

gloo's own `reduce_scatter` and `all_gather` are each slower on CPU than an `all_reduce` of the
same bytes, though the two together should cost what one all-reduce does. ZeRO and FSDP move
every parameter's bytes through one of each per step, so `sharded_dist(torch.distributed,
group)` hands them a `dist` whose two collectives send each rank's piece straight to its owner
(`batch_isend_irecv`, every pair at once): the bytes a ring sends, (N-1)/N of the buffer per
rank. Sums are taken in rank order, so every rank's shard is the same sum whichever rank
computes it. Everything else, and every group that is not gloo, goes to torch.distributed
unchanged (NCCL's own collectives are the fast ones there).
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import torch

from course_lib.backend import default_dist, global_rank
from course_lib.i18n import N_, _

__all__ = ["sharded_dist", "PointToPointShards"]


def sharded_dist(dist: Any = None, group: Any = None) -> Any:
    """The `dist` to use (`default_dist`'s), or, for torch.distributed on a gloo group, a
    `PointToPointShards` over it."""
    import torch.distributed as tdist

    dist = default_dist(dist)
    if dist is not tdist or not tdist.is_initialized():
        return dist
    try:
        backend = str(tdist.get_backend(group))
    except (RuntimeError, ValueError):  # not a member of `group`: the callers say so
        return dist
    return PointToPointShards(tdist) if backend == "gloo" else dist


class _Exchange:
    """The sends and receives of one collective in flight; `wait()` ends them, then runs
    `then()` once, as torch's Work does for its result. `what()` names the exchange in an error
    (built only then: an exchange is on every step's hot path)."""

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


class PointToPointShards:
    """torch.distributed, with `reduce_scatter` (SUM) and `all_gather` of CPU tensors done by
    point-to-point exchanges; every other name is torch.distributed's own."""

    def __init__(self, dist: Any):
        self._dist = dist

    def __getattr__(self, name: str) -> Any:
        return getattr(self._dist, name)

    def _rank_world(self, group: Any) -> tuple[int, int]:
        return self._dist.get_rank(group), self._dist.get_world_size(group)

    def _launch(self, what: str, sends: list[torch.Tensor], recvs: list[torch.Tensor],
                group: Any, then: Callable[[], None], async_op: bool) -> _Exchange | None:
        """Send `sends[k]` to the rank k places after this one and receive `recvs[k]` from the
        rank k places before, for k = 1 .. N-1 (index 0 unused), every pair at once; `then()`
        once they are done."""
        rank, world = self._rank_world(group)
        peers = [global_rank(self._dist, group, r) for r in range(world)]
        ops = []
        for k in range(1, world):
            to, frm = peers[(rank + k) % world], peers[(rank - k) % world]
            ops.append(self._dist.P2POp(self._dist.isend, sends[k], to, group=group))
            ops.append(self._dist.P2POp(self._dist.irecv, recvs[k], frm, group=group))
        works = self._dist.batch_isend_irecv(ops) if ops else []
        work = _Exchange(works, then, lambda: _(
            "{what} on rank {rank}, exchanging with ranks {peers}", what=what, rank=peers[rank],
            peers=[p for p in peers if p != peers[rank]]))
        if async_op:
            return work
        work.wait()
        return None

    def reduce_scatter(self, output: torch.Tensor, input_list: Sequence[torch.Tensor],
                       op: Any = None, group: Any = None, async_op: bool = False) -> Any:
        op = self._dist.ReduceOp.SUM if op is None else op
        if op != self._dist.ReduceOp.SUM or not _plain_cpu(output, *input_list):
            return self._dist.reduce_scatter(output, list(input_list), op=op, group=group,
                                             async_op=async_op)
        rank, world = self._rank_world(group)
        _check_shapes("reduce_scatter", input_list, output, world)
        sends = [input_list[(rank + k) % world].contiguous() for k in range(world)]
        recvs = [output, *(torch.empty_like(output) for _ in range(1, world))]  # [0]: unused

        def add_in_rank_order() -> None:
            # recvs[k] came from the rank k places before: rank r's piece is recvs[(me - r) % N]
            pieces = [input_list[r] if r == rank else recvs[(rank - r) % world]
                      for r in range(world)]
            if world == 1:
                output.copy_(pieces[0])
                return
            torch.add(pieces[0], pieces[1], out=output)  # one pass, not a copy and then a sum
            for piece in pieces[2:]:
                output.add_(piece)

        return self._launch("reduce_scatter", sends, recvs, group, add_in_rank_order, async_op)

    def all_gather(self, tensor_list: Sequence[torch.Tensor], tensor: torch.Tensor,
                   group: Any = None, async_op: bool = False) -> Any:
        if not _plain_cpu(*tensor_list) or tensor.device.type != "cpu":
            return self._dist.all_gather(list(tensor_list), tensor, group=group,
                                         async_op=async_op)
        rank, world = self._rank_world(group)
        _check_shapes("all_gather", tensor_list, tensor, world)
        recvs = [tensor_list[(rank - k) % world] for k in range(world)]

        def own_piece() -> None:
            if tensor_list[rank].data_ptr() != tensor.data_ptr():
                tensor_list[rank].copy_(tensor)

        return self._launch("all_gather", [tensor.contiguous()] * world, recvs, group, own_piece,
                            async_op)


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


def _plain_cpu(*tensors: torch.Tensor) -> bool:
    """Tensors this exchange can take as they are: on the CPU, and receivable in place."""
    return all(t.device.type == "cpu" and t.is_contiguous() for t in tensors)
