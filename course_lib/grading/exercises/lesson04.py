"""Lesson 04 (data parallel): averaging gradients in one flat buffer; launching buckets in order;
the DDP core (the hook, the bucket launch, the end of backward) trained on 2, 3 and 4 ranks."""

from __future__ import annotations

import itertools

import torch
from torch import nn

from course_lib.grading import RANK, WORLD_SIZE, Exercise, case, register
from course_lib.grading.sub_worlds import SUB_WORLDS, on_first_ranks, register_on_sub_worlds


def _grad(rank: int, shape: tuple, i: int):
    """A gradient that differs by rank and by parameter, so sums, means and mix-ups differ."""
    n = torch.Size(shape).numel()
    return (torch.arange(n, dtype=torch.float32).reshape(shape) * (rank + 1) + 10 * i - rank)


def _state(rank: int, specs: list) -> list:
    """This rank's tensors for `specs` of (shape, dtype name): different on every rank."""
    return [(torch.arange(torch.Size(shape).numel()).reshape(shape) * (rank + 2) + 10 * i)
            .to(getattr(torch, dt)) for i, (shape, dt) in enumerate(specs)]


def _coalesced_body(dist, rank: int, fn, specs: list, src: int) -> dict:
    tensors = _state(rank, specs)
    fn(tensors, src, dist=dist)
    return {"tensors": tensors, "collectives": dict(dist.calls)}


def coalesced_harness(fn, rank: int, world_size: int, k: int, specs: list, src: int):
    return on_first_ranks(k, _coalesced_body, fn, specs, src)


def _coalesced_reference(rank: int, world_size: int, k: int, specs: list, src: int):
    if rank >= k:
        return None
    return {"tensors": _state(src, specs),
            "collectives": {"broadcast": len({dt for _, dt in specs})}}


register_on_sub_worlds(
    "lesson04.broadcast_coalesced", "04_data_parallel",
    params=("tensors", "src"),
    cases=[
        case(RANK, WORLD_SIZE, 2, [((3, 4), "float32"), ((4,), "float32")], 0,
             label="2 ranks, weight and bias from rank 0"),
        case(RANK, WORLD_SIZE, 3, [((2, 2), "float64"), ((5,), "float32"), ((3,), "float64")], 2,
             label="3 ranks, two dtypes, from rank 2"),
        case(RANK, WORLD_SIZE, 4, [((6,), "float32"), ((), "int64"), ((2, 3), "float32")], 1,
             label="4 ranks, a BatchNorm-like int64 counter, from rank 1"),
    ],
    reference=_coalesced_reference,
    harness=coalesced_harness,
    points=2,
    hints=("Group the tensors by dtype (a dict keeps their order); per dtype, flatten_into one "
          "buffer, dist.broadcast(flat, src, group=group) once, and copy each slice back into "
          "its tensor (t.copy_(... .view_as(t)), in place, under torch.no_grad()).",),
)


def _flat_body(dist, rank: int, fn, shapes: list) -> dict:
    params = [torch.zeros(s, requires_grad=True) for s in shapes]
    for i, p in enumerate(params):
        p.grad = _grad(rank, tuple(p.shape), i)
    fn(params, dist=dist)
    return {"grads": [p.grad for p in params], "collectives": dict(dist.calls)}


def allreduce_harness(fn, rank: int, world_size: int, k: int, shapes: list) -> dict:
    """Give each parameter this rank's gradient, let `fn` average them on the first k ranks;
    return the gradients and the collectives it made."""
    return on_first_ranks(k, _flat_body, fn, shapes)


def _averaged(messages):
    """The reference of an averaging exercise whose all_reduce count is `messages(shapes)`."""
    def reference(rank: int, world_size: int, k: int, shapes: list) -> dict:
        if rank >= k:
            return None
        return {"grads": [sum(_grad(r, tuple(s), i) for r in range(k)) / k
                          for i, s in enumerate(shapes)],
                "collectives": {"all_reduce": messages(shapes)}}
    return reference


_AVERAGE_CASES = [
    case(RANK, WORLD_SIZE, 2, [(3,), (2, 5), (4,)], label="2 ranks, three parameters"),
    case(RANK, WORLD_SIZE, 3, [(7,), (3, 3, 2)], label="3 ranks, odd sizes"),
    case(RANK, WORLD_SIZE, 4, [(4, 4), (5,), (1,)], label="4 ranks, three parameters"),
]

register_on_sub_worlds(
    "lesson04.allreduce_grads_per_param", "04_data_parallel",
    params=("params",),
    cases=_AVERAGE_CASES,
    reference=_averaged(len),
    harness=allreduce_harness,
    points=1,
    hints=("For each parameter and its gradient (grads_of(params)): dist.all_reduce(g, "
          "group=group), then p.grad = g / dist.get_world_size(group).",),
)


register_on_sub_worlds(
    "lesson04.allreduce_grads_flat", "04_data_parallel",
    params=("params",),
    cases=_AVERAGE_CASES,
    reference=_averaged(lambda shapes: 1),
    harness=allreduce_harness,
    points=2,
    hints=("Copy every gradient into one flat buffer, all_reduce it once (a SUM, on the group), "
          "divide by the world size, and copy each slice back into its parameter's .grad. One "
          "collective in all: not one per parameter.",),
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


def _buckets_reference(sizes: list, bucket_cap_mb: float, first_bucket_cap_mb) -> list | str:
    from course_lib.ddp import make_buckets

    return buckets_harness(make_buckets, sizes, bucket_cap_mb, first_bucket_cap_mb)


_KiB = 1 / 1024  # in MiB

register(Exercise(
    name="lesson04.make_buckets",
    notebook="04_data_parallel",
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
    reference=_buckets_reference,
    harness=buckets_harness,
    points=2,
    hints=("Walk reversed(params); start a new bucket when the dtype changes; add the parameter, "
          "then close the bucket once its bytes reach the cap (the first bucket's cap is "
          "first_bucket_cap_mb unless None, the rest bucket_cap_mb); keep the last, partial "
          "bucket. bucket_cap_mb <= 0 is a ValueError.",),
))


def _in_order(next_bucket: int, complete: list) -> list:
    """The run of complete buckets from next_bucket on (stated differently from the answer,
    which the student release must not ship)."""
    return list(itertools.takewhile(complete.__getitem__, range(next_bucket, len(complete))))


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
    hints=("Start at next_bucket and keep going while the bucket is complete; never skip an "
          "incomplete bucket, or ranks could start different all_reduces at the same time.",),
))



# --- the DDP core: launch_bucket, on_grad_ready, finish_backward -------------------------------
# Each check trains a DDP that is the library's except for the learner's function, on the first
# 2, 3 and 4 ranks, against one process; it also records which buckets were launched, in which
# order and from where (a hook, or after backward), and the collectives they made.

_IN, _HID, _OUT, _B, _LR = 5, 6, 3, 2, 0.3
_CAP_MB = 200 / 2**20  # three buckets of this float64 model: [mid], [inp], [out (+ spare)]


class Net(nn.Module):
    """Registered out of forward order, so the last bucket is complete first and must wait for
    buckets 0 and 1; `spare` is absent, used on no rank, or used on rank 0 only."""

    def __init__(self, spare: str):
        super().__init__()
        torch.manual_seed(0)
        if spare != "absent":
            self.spare = nn.Linear(2, 2)
        self.out = nn.Linear(_HID, _OUT)
        self.inp = nn.Linear(_IN, _HID)
        self.mid = nn.Linear(_HID, _HID)
        self.double()
        self.spare_mode = spare

    def forward(self, x: torch.Tensor, rank: int) -> torch.Tensor:
        y = self.out(torch.tanh(self.mid(torch.tanh(self.inp(x)))))
        if self.spare_mode == "rank 0" and rank == 0:
            y = y + 0.1 * self.spare(x[:, :2]).sum()
        return y


def _batch(step: int, size: int):
    g = torch.Generator().manual_seed(50 + step)
    return (torch.randn(size, _IN, generator=g, dtype=torch.float64),
            torch.randn(size, _OUT, generator=g, dtype=torch.float64))


def _graded(which: str, fn):
    """The library's DDP with the learner's `fn` as `which`, logging every bucket launch."""
    from course_lib.ddp import DistributedDataParallel

    class Graded(DistributedDataParallel):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.launches, self.ending = [], False

        def launch(self, bucket):
            where = "after backward" if self.ending else "from a hook"
            self.launches.append((self.buckets.index(bucket), where))
            super().launch(bucket)

        def end_of_backward(self):
            self.ending = True
            try:
                super().end_of_backward()
            finally:
                self.ending = False

        if which == "launch_bucket":
            def start_all_reduce(self, bucket):
                return fn(self, bucket)
        elif which == "on_grad_ready":
            def grad_ready(self, p):
                fn(self, p)
        else:
            def finish(self):
                fn(self)

    return Graded


def _ddp_body(dist, rank: int, fn, which: str, steps: int, spare: str, set_to_none: bool):
    k = dist.get_world_size()
    model = Net(spare)
    ddp = _graded(which, fn)(model, bucket_cap_mb=_CAP_MB, first_bucket_cap_mb=None,
                             find_unused_parameters=spare != "absent", dist=dist)
    opt = torch.optim.SGD(model.parameters(), lr=_LR)
    launches, collectives = [], []
    for step in range(steps):
        dist.reset()
        x, y = _batch(step, k * _B)
        nn.functional.mse_loss(ddp(x[rank::k], rank), y[rank::k]).backward()
        launches.append(list(ddp.launches))
        collectives.append(list(dist.log))
        ddp.launches.clear()
        grad_is_none = getattr(model, "spare", model.out).weight.grad is None
        opt.step()
        opt.zero_grad(set_to_none=set_to_none)
    out = {"weights": torch.cat([p.detach().reshape(-1) for p in model.parameters()]),
           "bucket launches per step": launches, "collectives per step": collectives}
    if spare != "absent":
        out["spare.weight.grad is None after backward"] = grad_is_none
    return out


def _error_body(dist, rank: int, fn, which: str):
    """`spare` gets no gradient and find_unused_parameters is off: backward must say which."""
    ddp = _graded(which, fn)(Net("nowhere"), bucket_cap_mb=_CAP_MB, first_bucket_cap_mb=None,
                             dist=dist)
    x, y = _batch(0, dist.get_world_size() * _B)
    try:
        nn.functional.mse_loss(ddp(x[:_B], rank), y[:_B]).backward()
    except RuntimeError as e:
        return {"backward raised, naming spare.weight": "spare.weight" in str(e)}
    return {"backward raised, naming spare.weight": False}


def ddp_harness(which: str):
    def harness(fn, rank: int, world_size: int, k: int, *args):
        if args == ("error",):
            return on_first_ranks(k, _error_body, fn, which)
        return on_first_ranks(k, _ddp_body, fn, which, *args)
    return harness


def _ddp_reference(rank: int, world_size: int, k: int, *args):
    """One process on the mean of every rank's loss; the launches and collectives a correct
    DDP makes: every bucket from the hook that completes it, in bucket order, except those a
    never-ready parameter holds back to the end of backward; one async all_reduce each."""
    from course_lib.ddp import make_buckets

    if rank >= k:
        return None
    if args == ("error",):
        return {"backward raised, naming spare.weight": True}
    steps, spare, _ = args
    model = Net(spare)
    opt = torch.optim.SGD(model.parameters(), lr=_LR)
    for step in range(steps):
        x, y = _batch(step, k * _B)
        loss = sum(nn.functional.mse_loss(model(x[r::k], r), y[r::k]) for r in range(k)) / k
        loss.backward()
        opt.step()
        opt.zero_grad()
    buckets = make_buckets(list(model.parameters()), _CAP_MB, None)
    names = {id(q): n for n, q in model.named_parameters()}
    unused_here = spare == "nowhere" or (spare == "rank 0" and rank != 0)
    held = [unused_here and any(names[id(p)].startswith("spare") for p in b) for b in buckets]
    launches = [(i, "after backward" if any(held[:i + 1]) else "from a hook")
                for i in range(len(buckets))]
    flags = 0 if spare == "absent" else 1
    numels = [sum(p.numel() + flags for p in bucket) for bucket in buckets]
    out = {"weights": torch.cat([p.detach().reshape(-1) for p in model.parameters()]),
           "bucket launches per step": [launches] * steps,
           "collectives per step": [[("all_reduce", n, True) for n in numels]] * steps}
    if spare != "absent":
        out["spare.weight.grad is None after backward"] = spare == "nowhere"
    return out


_DDP_CASES = [
    case(RANK, WORLD_SIZE, 2, 3, "absent", True, label="2 ranks, 3 steps"),
    case(RANK, WORLD_SIZE, 3, 3, "absent", False, label="3 ranks, zero_grad(set_to_none=False)"),
    case(RANK, WORLD_SIZE, 4, 2, "nowhere", True,
         label="4 ranks, find_unused_parameters, spare used on no rank"),
    case(RANK, WORLD_SIZE, 3, 3, "rank 0", True,
         label="3 ranks, find_unused_parameters, spare used on rank 0 only"),
    case(RANK, WORLD_SIZE, 2, "error", label="2 ranks, spare unused without find_unused_parameters"),
]
assert {c.args[2] for c in _DDP_CASES} == set(SUB_WORLDS)

_DDP_HINTS = {
    "launch_bucket": (
        "Return ddp.dist.all_reduce(bucket.flat, group=ddp.group, async_op=True): the whole flat "
        "buffer, once, asynchronously. Before it, stage_grad every parameter not in "
        "bucket.ready into its view, and with ddp.find_unused_parameters write the flag slots "
        "bucket.flat[bucket.numel:] (1.0 for a parameter this rank used, else 0.0)."),
    "on_grad_ready": (
        "First hook: ddp.in_backward = True and queue ddp.end_of_backward. Then add id(p) to its "
        "bucket's ready set (twice is an error naming it), stage_grad(p.grad, view, "
        "ddp.grad_divisor) under no_grad, p.grad = view, and ddp.launch every bucket "
        "buckets_to_launch(ddp.next_bucket, complete) returns, moving ddp.next_bucket past it."),
    "finish_backward": (
        "Raise, naming them, for never-ready parameters of the unlaunched buckets unless "
        "ddp.find_unused_parameters; ddp.launch those buckets in order; then for each bucket "
        "wait for bucket.work and set p.grad = view for each parameter some rank used (its flag "
        "slot counts the ranks, so > 0)."),
}

for _which, _params in (("launch_bucket", ("ddp", "bucket")), ("on_grad_ready", ("ddp", "p")),
                        ("finish_backward", ("ddp",))):
    register_on_sub_worlds(
        f"lesson04.{_which}", "04_data_parallel",
        params=_params,
        cases=_DDP_CASES,
        reference=_ddp_reference,
        harness=ddp_harness(_which),
        points=3,
        time_limit=15.0,  # a case takes under a second idle, seconds on a loaded laptop;
        # launches out of order hang
        rtol=1e-9,
        atol=1e-12,
        hints=(_DDP_HINTS[_which],),
    )
