"""The all_reduce algorithms lesson 10 adds, and the choice all_reduce(algorithm="auto") makes.

Lesson 02 builds the classic algorithms (`course_lib.dist.collectives`: naive, ring, recursive
doubling); `collectives.all_reduce` dispatches to these as well. Lesson 10 measures where a
message's time goes and adds:

- `halve_then_double`: Rabenseifner's algorithm, reduce-scatter by recursive halving then
  all-gather by recursive doubling: 2 lg p messages, like recursive doubling, and 2(p-1)/p n
  bytes, like the ring (MPICH's choice for large messages);
- `all_reduce_shared`: a buffer from `dist.shared_zeros`, read in place by every rank;
- `one_shot`: a small tensor through the group's shared-memory staging buffer;
- `choose`, `table_choice`, `set_all_reduce_table`: what "auto" runs, by size and world size,
  from a default or from a table fitted to measurements (MPICH's JSON tuning files).

Each algorithm takes the group, the flat tensor, `combine(acc, other)` (the ReduceOp's in-place
reduction), the call's tag and its name; it imports nothing from `collectives`, which imports it.
"""

from __future__ import annotations

import hashlib
import json
from typing import Callable

import torch

from course_lib.dist import symmetric
from course_lib.dist.group import ProcessGroup, resolve
from course_lib.i18n import _

Combine = Callable[[torch.Tensor, torch.Tensor], None]

AUTO_TREE_MAX_BYTES = 256 * 1024  # all_reduce "auto": recursive doubling up to here, ring above
ALGORITHMS = ("auto", "naive", "ring", "tree", "rabenseifner", "shared", "one_shot")


def halve_then_double(g: ProcessGroup, flat: torch.Tensor, combine: Combine, tag: int, name: str,
                      index: int, pof2: int, group_rank: Callable[[int], int]) -> None:
    """Rabenseifner's two phases among the pof2 ranks that folding leaves (`collectives` folds
    the others in and out), this one the `index`-th; `group_rank(i)` is the i-th one's rank."""
    bounds = [0]
    for chunk in flat.tensor_split(pof2):
        bounds.append(bounds[-1] + chunk.numel())
    lo, hi = 0, pof2  # the chunks this rank is responsible for; halves each round
    mask = pof2 // 2
    while mask > 0:
        mid = (lo + hi) // 2
        keep, give = ((mid, hi), (lo, mid)) if index & mask else ((lo, mid), (mid, hi))
        kept = flat[bounds[keep[0]]:bounds[keep[1]]]
        partner = group_rank(index ^ mask)
        g.sendrecv(flat[bounds[give[0]]:bounds[give[1]]], partner, kept, partner, tag, name,
                   combine=combine)
        lo, hi = keep
        mask >>= 1
    mask = 1
    while mask < pof2:  # all-gather: swap windows with the partner, each window doubles
        size = hi - lo
        other = (lo - size, lo) if index & mask else (hi, hi + size)
        partner = group_rank(index ^ mask)
        g.sendrecv(flat[bounds[lo]:bounds[hi]], partner, flat[bounds[other[0]]:bounds[other[1]]],
                   partner, tag, name)
        lo, hi = min(lo, other[0]), max(hi, other[1])
        mask <<= 1


def all_reduce_shared(g: ProcessGroup, flat: torch.Tensor, combine: Combine, tag: int,
                      name: str) -> None:
    """A buffer from `dist.shared_zeros`: each rank reads its peers' copies in place."""
    buf = symmetric.holds(g, flat)
    if buf is None:
        raise ValueError(_("rank {rank}: {name}: the tensor is not a whole buffer from "
                           "dist.shared_zeros on this group", rank=g.transport.rank, name=name))
    buf.all_reduce_(combine, name)


def staging_turn(g: ProcessGroup, name: str) -> int:
    """The turn of a one-shot all_reduce in the group's staging buffer, taken in call order
    (async or not); every rank of the group must be on this machine."""
    if not symmetric.may_stage(g):
        raise ValueError(_("rank {rank}: {name} needs every rank of the group on this "
                           "machine, with shared memory on (COURSE_DIST_SHM)",
                           rank=g.transport.rank, name=name))
    return g.staging.take()


def one_shot(g: ProcessGroup, flat: torch.Tensor, combine: Combine, tag: int, name: str,
             turn: int) -> bool:
    """Through the group's staging buffer: each rank copies its tensor in, then adds up every
    rank's copy. False on every rank if the first call cannot make the buffer (the caller then
    sends messages instead)."""
    return g.staging.all_reduce_(flat, combine, name, turn, tag)


def choose(group: ProcessGroup, tensor: torch.Tensor) -> str:
    """What all_reduce(algorithm="auto") runs: the same on every rank given the same tensors."""
    if symmetric.holds(group, tensor) is not None:
        return "shared"
    if (group.all_reduce_table is None and tensor.nbytes <= symmetric.ONE_SHOT_MAX_BYTES
            and group.size > 1 and symmetric.may_stage(group)):
        return "one_shot"
    return table_choice(group.all_reduce_table, tensor.nbytes, group.size)


def table_choice(table: dict | None, nbytes: int, world_size: int) -> str:
    """The algorithm a table picks for `nbytes` on `world_size` ranks. A table maps a world
    size (or 0, any other) to [max_bytes, algorithm] rows in increasing size, the last with
    max_bytes None (no limit), as MPICH's JSON tuning files do; None is the default (measured
    on 2 ranks of one host: recursive doubling up to 1 MiB, then Rabenseifner, whose halves
    are reduced straight from shared memory)."""
    if table is None:
        if world_size == 2:
            return "tree" if nbytes <= 4 * AUTO_TREE_MAX_BYTES else "rabenseifner"
        return "tree" if nbytes <= AUTO_TREE_MAX_BYTES else "ring"
    rows = table.get(world_size, table.get(0))
    if rows is None:
        raise ValueError(_("all_reduce table has no row for world size {world_size} and no 0 "
                           "row", world_size=world_size))
    for max_bytes, algorithm in rows:
        if max_bytes is None or nbytes <= max_bytes:
            return algorithm
    raise ValueError(_("all_reduce table for world size {world_size} ends below {nbytes} "
                       "bytes; its last row needs max_bytes None", world_size=world_size,
                       nbytes=nbytes))


def set_all_reduce_table(table: dict | None, group: ProcessGroup | None = None) -> None:
    """Make `table` what all_reduce(algorithm="auto") follows on `group` (None: the default).
    Collective: every rank must pass the same table, else every rank fails here (different
    algorithms at the same call would hang or mix messages)."""
    g = resolve(group, "set_all_reduce_table")
    if table is not None:  # keys as ints, also when read from a JSON file
        table = {int(size): [(b, a) for b, a in rows] for size, rows in table.items()}
        for size, rows in table.items():
            for max_bytes, algorithm in rows:
                if algorithm not in ALGORITHMS or algorithm == "auto":
                    raise ValueError(_("all_reduce table: unknown algorithm {algorithm!r} for "
                                       "world size {size}", algorithm=algorithm, size=size))
    text = json.dumps(table, sort_keys=True).encode()
    digest = torch.tensor(list(hashlib.sha256(text).digest()[:8]), dtype=torch.int64)
    digests: list[torch.Tensor] = []
    # An all_gather of the digests, recorded and tagged in call order like every collective.
    call = g.collective("all_gather", digest)
    call.run(lambda grp, tag: digests.extend(grp.exchange(digest, tag, "all_gather")))
    differ = [g.ranks[i] for i, d in enumerate(digests) if not torch.equal(d, digests[0])]
    if differ:
        raise ValueError(_("rank {rank}: set_all_reduce_table: ranks {differ} passed a table "
                           "different from rank {first}'s", rank=g.transport.rank,
                           differ=differ, first=g.ranks[0]))
    g.all_reduce_table = table
