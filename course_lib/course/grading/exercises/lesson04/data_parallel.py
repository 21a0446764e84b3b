"""Lesson 04a's checks (data parallel): identical starting weights (`broadcast_coalesced`),
averaging gradients per parameter and in one flat buffer, buckets and their launch order.
Expected values and the reasons for wrong ones: course_lib.course.grading.references.lesson04.
"""

from __future__ import annotations

import torch

from course_lib.course.grading import RANK, WORLD_SIZE, Exercise, case, register
from course_lib.course.grading.sub_worlds import on_first_ranks, register_on_sub_worlds

PART_A = "04a_data_parallel"


def grad_of(rank: int, shape: tuple, i: int) -> torch.Tensor:
    """A gradient that differs by rank and by parameter, so sums, means and mix-ups differ."""
    n = torch.Size(shape).numel()
    return (torch.arange(n, dtype=torch.float32).reshape(shape) * (rank + 1) + 10 * i - rank)


def state_of(rank: int, specs: list) -> list:
    """This rank's tensors for `specs` of (shape, dtype name): different on every rank."""
    return [(torch.arange(torch.Size(shape).numel()).reshape(shape) * (rank + 2) + 10 * i)
            .to(getattr(torch, dt)) for i, (shape, dt) in enumerate(specs)]


def _coalesced_body(dist, rank: int, fn, specs: list, src: int) -> dict:
    tensors = state_of(rank, specs)
    fn(tensors, src, dist=dist)
    return {"tensors": tensors, "collectives": dict(dist.calls)}


def coalesced_harness(fn, rank: int, world_size: int, k: int, specs: list, src: int):
    return on_first_ranks(k, _coalesced_body, fn, specs, src)


register_on_sub_worlds(
    "lesson04.broadcast_coalesced", PART_A,
    params=("tensors", "src"),
    cases=[
        case(RANK, WORLD_SIZE, 2, [((3, 4), "float32"), ((4,), "float32")], 0,
             label="2 ranks, weight and bias from rank 0"),
        case(RANK, WORLD_SIZE, 3, [((2, 2), "float64"), ((5,), "float32"), ((3,), "float64")], 2,
             label="3 ranks, two dtypes, from rank 2"),
        case(RANK, WORLD_SIZE, 4, [((6,), "float32"), ((), "int64"), ((2, 3), "float32")], 1,
             label="4 ranks, a BatchNorm-like int64 counter, from rank 1"),
    ],
    reference="lesson04:broadcast_coalesced",
    explain="lesson04:explain_broadcast",
    harness=coalesced_harness,
    points=2,
    hints=("One message per dtype: the tensors of one dtype travel together, in their order, in "
           "one flat buffer sent from src, and every rank then copies its piece of that buffer "
           "back into each of its own tensors.",
           "Group the tensors by dtype first. For each group: allocate a buffer as long as the "
           "group's elements, fill it (a helper above does), broadcast it, then walk the group "
           "again with a running position, copying each piece back in the tensor's shape; "
           "autograd must not record any of it."),
)


def _flat_body(dist, rank: int, fn, shapes: list) -> dict:
    params = [torch.zeros(s, requires_grad=True) for s in shapes]
    for i, p in enumerate(params):
        p.grad = grad_of(rank, tuple(p.shape), i)
    fn(params, dist=dist)
    return {"grads": [p.grad for p in params], "collectives": dict(dist.calls)}


def allreduce_harness(fn, rank: int, world_size: int, k: int, shapes: list) -> dict:
    """Give each parameter this rank's gradient, let `fn` average them on the first k ranks;
    return the gradients and the collectives it made."""
    return on_first_ranks(k, _flat_body, fn, shapes)


_AVERAGE_CASES = [
    case(RANK, WORLD_SIZE, 2, [(3,), (2, 5), (4,)], label="2 ranks, three parameters"),
    case(RANK, WORLD_SIZE, 3, [(7,), (3, 3, 2)], label="3 ranks, odd sizes"),
    case(RANK, WORLD_SIZE, 4, [(4, 4), (5,), (1,)], label="4 ranks, three parameters"),
]

register_on_sub_worlds(
    "lesson04.allreduce_grads_per_param", PART_A,
    params=("params",),
    cases=_AVERAGE_CASES,
    reference="lesson04:averaged_per_param",
    explain="lesson04:explain_averaged",
    harness=allreduce_harness,
    points=1,
    hints=("Every rank must leave with the average, not the sum: all_reduce adds the ranks' "
           "tensors, so divide by the number of ranks in the group afterwards.",
           "Walk the parameters together with the gradients grads_of gives (zeros stand in for "
           "a missing one): reduce each gradient on the group, divide it, and make it the "
           "parameter's gradient."),
)

register_on_sub_worlds(
    "lesson04.allreduce_grads_flat", PART_A,
    params=("params",),
    cases=_AVERAGE_CASES,
    reference="lesson04:averaged_flat",
    explain="lesson04:explain_averaged",
    harness=allreduce_harness,
    points=2,
    hints=("One collective for all the gradients: lay them end to end in one buffer, reduce it "
           "once, divide by the world size, and give each parameter its piece back.",
           "With the helpers: take the gradients (grads_of), allocate one buffer of their total "
           "length in their dtype, fill it (flatten_into), reduce and divide it, then hand the "
           "pieces back (unflatten_to_grads)."),
)


def buckets_harness(fn, sizes: list, bucket_cap_mb: float, first_bucket_cap_mb) -> list | str:
    """Parameters of `sizes` (numel, dtype name) in registration order; the buckets `fn` makes,
    as lists of parameter indices, or the error it raised on a bad cap."""
    params = [torch.zeros(n, dtype=getattr(torch, dt)) for n, dt in sizes]
    index = {id(q): i for i, q in enumerate(params)}
    try:
        buckets = fn(params, bucket_cap_mb, first_bucket_cap_mb)
    except ValueError:
        return "raises ValueError"
    return [[index[id(q)] for q in b] for b in buckets]


_KiB = 1 / 1024  # in MiB

register(Exercise(
    name="lesson04.make_buckets",
    notebook=PART_A,
    params=("params", "bucket_cap_mb", "first_bucket_cap_mb"),
    cases=[
        case([(256, "float32")] * 6, 2 * _KiB, 1 * _KiB, label="6 x 1 KiB, caps 2 KiB, first 1 KiB"),
        case([(256, "float32")] * 6, 2 * _KiB, None, label="first_bucket_cap_mb=None: all 2 KiB"),
        case([(100, "float32"), (300, "float32"), (50, "float32"), (700, "float32"),
              (10, "float32")], 1.5 * _KiB, 0.5 * _KiB, label="uneven sizes"),
        case([(64, "float32"), (64, "float64"), (64, "float64"), (64, "float32")], 10.0, 1.0,
             label="dtypes change: a new bucket at each change"),
        case([(3000, "float32")], 1 * _KiB, 1 * _KiB, label="one parameter larger than the cap"),
        case([(10, "float32")], 0.0, 1.0, label="bucket_cap_mb=0: an error"),
    ],
    reference="lesson04:make_buckets",
    explain="lesson04:explain_buckets",
    harness=buckets_harness,
    points=2,
    hints=("Buckets follow the order in which backward produces gradients, the reverse of "
           "registration. Each bucket closes as soon as its bytes reach its cap, so it may end a "
           "little over the cap, and a parameter is never split; one bucket holds one dtype.",
           "Keep the current bucket and its byte count while you walk the parameters backwards. "
           "A change of dtype closes the bucket before the parameter joins; after a parameter "
           "joins, close the bucket once the count reaches the cap, and use the ordinary cap "
           "from then on. What is left at the end is the last bucket."),
))


def launch_harness(fn, next_bucket: int, complete: list) -> list:
    return list(fn(next_bucket, complete))


register(Exercise(
    name="lesson04.buckets_to_launch",
    notebook=PART_A,
    params=("next_bucket", "complete"),
    cases=[
        case(0, [True, True, False], label="first two complete"),
        case(0, [False, True, True], label="bucket 0 not ready: wait"),
        case(0, [True, False, True], label="a gap: stop at it"),
        case(1, [True, True, True, False], label="bucket 0 already launched"),
        case(3, [True, True, True], label="all launched"),
    ],
    reference="lesson04:buckets_to_launch",
    explain="lesson04:explain_launch_order",
    harness=launch_harness,
    points=1,
    hints=("Buckets start strictly in bucket order: the first bucket that is not complete holds "
           "back every bucket after it, complete or not.",
           "Start at the first bucket not launched yet and walk forward while the buckets are "
           "complete; the buckets you walked over are the answer, possibly none."),
))
