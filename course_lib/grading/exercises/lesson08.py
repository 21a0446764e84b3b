"""Lesson 08 (ZeRO): padded shard bounds, the gradient reduce-scatter, the ZeRO-1 step, and the
FSDP unit's gather and post-backward. Distributed checks run on the first 2, 3 and 4 ranks of
the grader's 4-rank cluster, through a counting `dist` that also checks the communication."""

from __future__ import annotations

import math

import torch

from course_lib.grading import RANK, WORLD_SIZE, Exercise, case, register
from course_lib.grading.sub_worlds import on_first_ranks
from course_lib.grading.sub_worlds import register_on_sub_worlds as register_on


def register_on_sub_worlds(name: str, **fields) -> None:
    """A lesson 08 exercise run on sub-worlds of the grader's 4-rank scratch cluster."""
    register_on(name, "08_zero", rtol=1e-12, **fields)


def _values(k: int, rank: int, n: int) -> torch.Tensor:
    """Rank `rank`'s padded flat gradient: different per rank and per element."""
    return torch.arange(n, dtype=torch.float64) * (rank + 1) + 0.5 * rank


# --- lesson08.shard_range ----------------------------------------------------------------------


def _shard_range(numel: int, world_size: int, rank: int) -> tuple:
    size = math.ceil(numel / world_size)
    return (rank * size, (rank + 1) * size)


def shard_range_harness(fn, numel: int, world_size: int) -> dict:
    """Every rank's range, and whether together they tile a padded buffer evenly."""
    return {"ranges": [tuple(int(v) for v in fn(numel, world_size, r)) for r in range(world_size)]}


def _shard_range_reference(numel: int, world_size: int) -> dict:
    return {"ranges": [_shard_range(numel, world_size, r) for r in range(world_size)]}


register(Exercise(
    name="lesson08.shard_range",
    notebook="08_zero",
    params=("numel", "world_size", "rank"),
    cases=[
        case(12, 4, label="12 elements, 4 ranks: divides"),
        case(10, 4, label="10 elements, 4 ranks: 2 of padding"),
        case(10, 3, label="10 elements, 3 ranks"),
        case(7, 2, label="7 elements, 2 ranks"),
        case(2, 4, label="2 elements, 4 ranks: ranks 2 and 3 own only padding"),
        case(1001, 3, label="1001 elements, 3 ranks"),
    ],
    reference=_shard_range_reference,
    harness=shard_range_harness,
    points=1,
    hints=("Every rank owns ceil(numel / world_size) elements, the last ones possibly padding: "
          "rank r owns [r * size, (r + 1) * size). Never give the remainder to one rank.",),
))


# --- lesson08.reduce_scatter_grads -------------------------------------------------------------


def _rs_body(dist, rank: int, fn, n_per_rank: int, async_op: bool) -> dict:
    k = dist.get_world_size()
    flat = _values(k, rank, n_per_rank * k)
    shard = torch.full((n_per_rank,), float("nan"), dtype=torch.float64)
    work = fn(flat, shard, dist=dist, async_op=async_op)
    if async_op:
        if work is None:
            return {"shard": shard, "calls": dict(dist.calls), "returned a work": False}
        work.wait()
    return {"shard": shard, "calls": dict(dist.calls), "returned a work": True}



def rs_harness(fn, rank: int, world_size: int, k: int, n_per_rank: int, async_op: bool):
    return on_first_ranks(k, _rs_body, fn, n_per_rank, async_op)


def _rs_reference(rank: int, world_size: int, k: int, n_per_rank: int, async_op: bool):
    if rank >= k:
        return None
    total = sum(_values(k, r, n_per_rank * k) for r in range(k)) / k
    return {"shard": total[rank * n_per_rank:(rank + 1) * n_per_rank],
            "calls": {"reduce_scatter": 1}, "returned a work": True}


register_on_sub_worlds(
    "lesson08.reduce_scatter_grads",
    params=("flat_grad", "shard"),
    cases=[case(RANK, WORLD_SIZE, k, n, a, label=f"{k} ranks, {n} per rank"
                + (", async" if a else ""))
           for k, n, a in ((2, 3, False), (3, 5, False), (4, 2, False), (3, 4, True),
                           (4, 1, True))],
    reference=_rs_reference,
    harness=rs_harness,
    points=2,
    hints=("One dist.reduce_scatter(shard, chunks, group=group, async_op=async_op), with the "
          "flat gradient cut into world_size equal chunks in rank order, then shard / "
          "world_size (the average, not the sum). With async_op, divide when the work is "
          "waited for: return an object whose wait() waits and then divides (see Then).",),
)


# --- lesson08.zero1_step -----------------------------------------------------------------------


def _zero1_body(dist, rank: int, fn, numels: list) -> dict:
    from course_lib.zero import FlatLayout

    k = dist.get_world_size()
    flats, shards, layouts = [], [], []
    for i, n in enumerate(numels):
        layout = FlatLayout([torch.Size([n])], k, torch.float64)
        flat = torch.arange(layout.padded_numel, dtype=torch.float64) + 100 * i
        shard = torch.nn.Parameter(layout.chunks(flat)[rank])
        shard.grad = torch.full_like(shard, float(rank + 1))  # this rank's reduced gradient
        flats.append(flat), shards.append(shard), layouts.append(layout)
    optim = torch.optim.SGD(shards, lr=0.5)
    fn(optim, flats, shards, layouts, dist=dist)
    return {"flat buffers": [f[:n] for f, n in zip(flats, numels)], "calls": dict(dist.calls)}



def zero1_harness(fn, rank: int, world_size: int, k: int, numels: list):
    return on_first_ranks(k, _zero1_body, fn, numels)


def _zero1_reference(rank: int, world_size: int, k: int, numels: list):
    if rank >= k:
        return None
    out = []
    for i, n in enumerate(numels):
        size = math.ceil(n / k)
        flat = torch.arange(size * k, dtype=torch.float64) + 100 * i
        for r in range(k):  # every rank stepped its own shard with gradient r + 1
            flat[r * size:(r + 1) * size] -= 0.5 * (r + 1)
        out.append(flat[:n])
    return {"flat buffers": out, "calls": {"all_gather": len(numels)}}


register_on_sub_worlds(
    "lesson08.zero1_step",
    params=("optimizer", "flats", "shards", "layouts"),
    cases=[case(RANK, WORLD_SIZE, k, numels, label=f"{k} ranks, buckets of {numels}")
           for k, numels in ((2, [6]), (3, [10, 4]), (4, [7, 1, 9]))],
    reference=_zero1_reference,
    harness=zero1_harness,
    points=2,
    hints=("First optimizer.step() (it updates this rank's shards, which are views of the flat "
          "buffers), then one all_gather per bucket: all_gather_params(flat, shard.detach(), "
          "layout, dist=dist, group=group), async and waited for at the end if you like.",),
)


# --- lesson08.unshard and lesson08.reduce_unit_grad --------------------------------------------


def _unit(dist, rank: int, numels: list):
    """A _FlatParam over parameters of `numels` elements whose shard values name the rank."""
    from course_lib.zero import _FlatParam

    k = dist.get_world_size()
    params = [torch.nn.Parameter(torch.arange(n, dtype=torch.float64) + 10 * i)
              for i, n in enumerate(numels)]
    mod = torch.nn.Module()
    entries = [(mod, f"p{i}", i) for i in range(len(params))]
    flat = _FlatParam(entries, params, k, rank)
    with torch.no_grad():
        flat.shard.add_(1000 * rank)  # each rank's shard now differs: the gather must use it
    return flat, mod


def _unshard_body(dist, rank: int, fn, numels: list) -> dict:
    flat, _ = _unit(dist, rank, numels)
    version = flat.full._version
    work = fn(flat, dist=dist, async_op=True)
    if work is not None:
        work.wait()
    ok = flat.full.untyped_storage().nbytes() == flat.nbytes
    full = flat.full.detach().clone() if ok else torch.empty(0)
    return {"gathered": full[:flat.layout.numel], "storage regrown": ok,
            "full's version unchanged (autograd's saved views stay valid)":
                flat.full._version == version, "calls": dict(dist.calls)}



def unshard_harness(fn, rank: int, world_size: int, k: int, numels: list):
    return on_first_ranks(k, _unshard_body, fn, numels)


def _gathered(k: int, numels: list) -> torch.Tensor:
    total = sum(numels)
    size = math.ceil(total / k)
    flat = torch.cat([torch.arange(n, dtype=torch.float64) + 10 * i for i, n in enumerate(numels)]
                     + [torch.zeros(size * k - total, dtype=torch.float64)])
    for r in range(k):
        flat[r * size:(r + 1) * size] += 1000 * r
    return flat[:total]


def _unshard_reference(rank: int, world_size: int, k: int, numels: list):
    if rank >= k:
        return None
    return {"gathered": _gathered(k, numels), "storage regrown": True,
            "full's version unchanged (autograd's saved views stay valid)": True,
            "calls": {"all_gather": 1}}


register_on_sub_worlds(
    "lesson08.unshard",
    params=("flat",),
    cases=[case(RANK, WORLD_SIZE, k, numels, label=f"{k} ranks, parameters of {numels}")
           for k, numels in ((2, [3, 4]), (3, [5, 2, 7]), (4, [6]))],
    reference=_unshard_reference,
    harness=unshard_harness,
    points=2,
    hints=("Regrow the storage (flat.full.untyped_storage().resize_(flat.nbytes)), then "
          "all_gather_params(flat.alias, flat.shard.detach(), flat.layout, ...) and return its "
          "work. Gather into flat.alias, not flat.full: writing through full bumps its version "
          "counter and autograd would refuse the tensors it saved in forward.",),
)


def _reduce_body(dist, rank: int, fn, numels: list) -> dict:
    flat, _ = _unit(dist, rank, numels)
    flat.full.untyped_storage().resize_(flat.nbytes)  # gathered, as after a forward
    flat.gathered = True
    grad = torch.arange(flat.layout.padded_numel, dtype=torch.float64) * (rank + 1)
    flat.full.grad = grad
    work, reduced, _kept = fn(flat, dist=dist)
    freed = flat.full.untyped_storage().nbytes() == 0
    work.wait()
    return {"reduced shard": reduced, "gathered parameters freed": freed,
            "full gradient dropped": flat.full.grad is None, "calls": dict(dist.calls)}



def reduce_harness(fn, rank: int, world_size: int, k: int, numels: list):
    return on_first_ranks(k, _reduce_body, fn, numels)


def _reduce_reference(rank: int, world_size: int, k: int, numels: list):
    if rank >= k:
        return None
    size = math.ceil(sum(numels) / k)
    avg = torch.arange(size * k, dtype=torch.float64) * sum(r + 1 for r in range(k)) / k
    return {"reduced shard": avg[rank * size:(rank + 1) * size], "gathered parameters freed": True,
            "full gradient dropped": True, "calls": {"reduce_scatter": 1}}


register_on_sub_worlds(
    "lesson08.reduce_unit_grad",
    params=("flat",),
    cases=[case(RANK, WORLD_SIZE, k, numels, label=f"{k} ranks, parameters of {numels}")
           for k, numels in ((2, [3, 4]), (3, [5, 2, 7]), (4, [9]))],
    reference=_reduce_reference,
    harness=reduce_harness,
    points=2,
    hints=("Take flat.full.grad and set it to None; reduce_scatter_grads it into a new tensor of "
          "flat.layout.shard_numel elements with async_op=True; flat.free(); return (work, "
          "reduced shard, the full gradient) so the gradient lives until it has been sent.",),
)
