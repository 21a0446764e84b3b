"""Lesson 06 (tensor parallel): the right shard of a weight; the f and g autograd pair."""

from __future__ import annotations

from course_lib.grading import RANK, WORLD_SIZE, Exercise, case, register


def _matrix(rows: int, cols: int):
    import torch

    return torch.arange(rows * cols, dtype=torch.float32).reshape(rows, cols)


def _shard_reference(tensor, dim: int, rank: int, world_size: int, parts: int = 1):
    from course_lib.tensor_parallel import shard

    return shard(tensor, dim, rank, world_size, parts)


register(Exercise(
    name="lesson06.shard",
    notebook="06_tensor_parallel",
    params=("tensor", "dim", "rank", "world_size", "parts"),
    cases=[
        case(_matrix(4, 6), 0, 0, 2, label="rows, rank 0 of 2"),
        case(_matrix(4, 6), 0, 1, 2, label="rows, rank 1 of 2"),
        case(_matrix(4, 6), 1, 2, 3, label="columns, rank 2 of 3"),
        case(_matrix(6, 2)[:, 0].clone(), 0, 1, 3, label="a bias, rank 1 of 3"),
        case(_matrix(12, 2), 0, 1, 2, parts=3, label="packed q, k, v (parts=3), rank 1 of 2"),
    ],
    reference=_shard_reference,
    points=2,
    hint=("Rank r of p owns the r-th of p equal contiguous slices along `dim`: "
          "tensor.narrow(dim, r * size, size). With parts > 1, take that slice of each of the "
          "`parts` blocks (tensor.chunk(parts, dim)) and concatenate them."),
))


def _f_data(world_size: int, seed: int):
    """x (same on every rank, as the input of a column-parallel layer) and one weight per rank."""
    import torch

    g = torch.Generator().manual_seed(seed)
    x = torch.randn(3, 4, generator=g, dtype=torch.float64)
    return x, [torch.randn(3, 4, generator=g, dtype=torch.float64) for _ in range(world_size)]


def copy_harness(fn, rank: int, world_size: int, seed: int) -> dict:
    """y = fn(x); each rank's loss uses its own weight, like its shard of a column-parallel
    layer; the gradient of the shared x must be the sum over ranks."""
    x, weights = _f_data(world_size, seed)
    x.requires_grad_()
    y = fn(x)
    (y * weights[rank]).sum().backward()
    return {"forward": y.detach(), "grad": x.grad}


def _copy_reference(rank: int, world_size: int, seed: int) -> dict:
    x, weights = _f_data(world_size, seed)
    return {"forward": x, "grad": sum(weights)}


register(Exercise(
    name="lesson06.copy_to_parallel",
    notebook="06_tensor_parallel",
    params=("x", "dist", "group"),
    cases=[case(RANK, WORLD_SIZE, 0, label="x used by every rank's shard"),
           case(RANK, WORLD_SIZE, 1, label="another x")],
    reference=_copy_reference,
    harness=copy_harness,
    distributed=True,
    world_size=2,
    backend="gloo",
    points=2,
    hint=("f is the identity forward. Backward, every rank holds only its shard's part of "
          "dL/dx: all_reduce (SUM) the gradient so each rank gets the whole of it."),
))


def reduce_harness(fn, rank: int, world_size: int, seed: int) -> dict:
    """y = fn(x_rank), with a different partial result on each rank; one loss on the sum."""
    x, weights = _f_data(world_size, seed)
    part = (x * (rank + 1)).requires_grad_()
    y = fn(part)
    (y * weights[0]).sum().backward()
    return {"forward": y.detach(), "grad": part.grad}


def _reduce_reference(rank: int, world_size: int, seed: int) -> dict:
    x, weights = _f_data(world_size, seed)
    return {"forward": sum(x * (r + 1) for r in range(world_size)), "grad": weights[0]}


register(Exercise(
    name="lesson06.reduce_from_parallel",
    notebook="06_tensor_parallel",
    params=("x", "dist", "group"),
    cases=[case(RANK, WORLD_SIZE, 0, label="partial sums"),
           case(RANK, WORLD_SIZE, 2, label="other partial sums")],
    reference=_reduce_reference,
    harness=reduce_harness,
    distributed=True,
    world_size=2,
    backend="gloo",
    points=2,
    hint=("g sums the partial outputs forward (all_reduce into a copy: do not change the "
          "input in place). Backward, the output is the same on every rank, so each rank's "
          "partial result gets the gradient unchanged: no communication."),
))
