"""Lesson 04 (data parallel): averaging gradients in one flat buffer; launching buckets in order."""

from __future__ import annotations

from course_lib.grading import RANK, WORLD_SIZE, Exercise, case, register


def _grad(rank: int, shape: tuple, i: int):
    """A gradient that differs by rank and by parameter, so sums, means and mix-ups differ."""
    import torch

    n = 1
    for s in shape:
        n *= s
    return (torch.arange(n, dtype=torch.float32).reshape(shape) * (rank + 1) + 10 * i - rank)


def allreduce_harness(fn, rank: int, world_size: int, shapes: list) -> list:
    """Give each parameter this rank's gradient, let `fn` average them, return the gradients."""
    import torch

    params = [torch.zeros(s, requires_grad=True) for s in shapes]
    for i, p in enumerate(params):
        p.grad = _grad(rank, tuple(s for s in p.shape), i)
    fn(params)
    return [p.grad for p in params]


def _average(rank: int, world_size: int, shapes: list) -> list:
    return [sum(_grad(r, tuple(s), i) for r in range(world_size)) / world_size
            for i, s in enumerate(shapes)]


register(Exercise(
    name="lesson04.allreduce_grads_flat",
    notebook="04_data_parallel",
    params=("params",),
    cases=[
        case(RANK, WORLD_SIZE, [(3,), (2, 5)], label="two parameters"),
        case(RANK, WORLD_SIZE, [(7,), (1,), (3, 3, 2)], label="odd sizes"),
    ],
    reference=_average,
    harness=allreduce_harness,
    distributed=True,
    world_size=2,
    backend="gloo",
    points=2,
    hint=("Copy every gradient into one flat buffer, all_reduce it once (a SUM), divide by the "
          "world size, and copy each slice back into its parameter's .grad."),
))


def _in_order(next_bucket: int, complete: list) -> list:
    end = next_bucket
    while end < len(complete) and complete[end]:
        end += 1
    return list(range(next_bucket, end))


def launch_harness(fn, next_bucket: int, complete: list) -> list:
    return list(fn(next_bucket, complete))


register(Exercise(
    name="lesson04.buckets_to_launch",
    notebook="04_data_parallel",
    params=("next_bucket", "complete"),
    cases=[
        case(0, [True, True, False], label="first two complete"),
        case(0, [False, True, True], label="bucket 0 not ready: wait"),
        case(0, [True, False, True], label="a gap: stop at it"),
        case(1, [True, True, True, False], label="bucket 0 already launched"),
        case(3, [True, True, True], label="all launched"),
    ],
    reference=_in_order,
    harness=launch_harness,
    points=1,
    hint=("Start at next_bucket and keep going while the bucket is complete; never skip an "
          "incomplete bucket, or ranks could start different all_reduces at the same time."),
))
