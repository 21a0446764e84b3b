"""Lesson 11b's checks (the training step): the gradient reductions each axis needs, the loss
scaler's unscale and skip, and the whole step, on 2, 3 and 4 ranks, with every collective counted
by the group it ran on: a pool of groups every rank creates, a `LabelledDist` that names each
collective's group, and a stand-in for 11a's layout over them. Expected values and
explanations: `course_lib/course/grading/references/lesson11/step.py`.

Components (course_lib.run, course_lib.backend, ...) are imported inside the functions that use
them, on purpose: the learner's overlay decides at each call which version runs (theirs or the
reference), and a name bound at import time would keep the first one.
"""

from __future__ import annotations

import itertools
from types import SimpleNamespace
from typing import Any

import torch
from torch import nn

from course_lib.course.grading import RANK, WORLD_SIZE, case
from course_lib.course.grading.exercises.lesson11.common import AXES, PART_B
from course_lib.course.grading.sub_worlds import LateDist, on_first_ranks, register_on_sub_worlds


# --- 11b: groups every rank creates, and a dist that labels each collective by its group -------

def all_subsets(n: int = 4) -> list[tuple[int, ...]]:
    """Every non-empty set of ranks of an n-rank world, in a fixed order."""
    return [c for k in range(1, n + 1) for c in itertools.combinations(range(n), k)]


def group_pool() -> dict[tuple[int, ...], Any]:
    """One group for every set of the grader's 4 ranks, created by every rank in the same
    order (as new_group requires): the groups a case's layout uses are taken from it, so the
    ranks outside a 2- or 3-rank case create the same groups as the ranks inside."""
    from course_lib.backend import default_dist

    real = default_dist()
    return {ranks: real.new_group(list(ranks)) for ranks in all_subsets(real.get_world_size())}


class LabelledDist(LateDist):
    """A sub-world's counting dist whose `new_group` hands out the pool's group, and that
    records, while `on`, each collective by the name of the group it ran on ("world" for the
    default group; `labels` maps a group's id to its name). A collective on a group of one rank
    changes nothing and is not recorded."""

    def __init__(self, dist: Any, group: Any, pool: dict):
        super().__init__(dist, group=group)
        self.pool, self.labels, self.seen, self.on = pool, {}, [], True

    def new_group(self, ranks, *args, **kwargs):
        return self.pool[tuple(sorted(int(r) for r in ranks))]

    def _call(self, name: str, payload: int, args: Any, kwargs: dict) -> Any:
        group = kwargs.get("group")
        if self.on and name not in ("send", "isend", "recv", "irecv") and (
                group is None or self.dist.get_world_size(group) > 1):
            self.seen.append(("world" if group is None
                              else self.labels.get(id(group), "another group"), name))
        return super()._call(name, payload, args, kwargs)

    def comm(self) -> str:
        """The groups that carried a collective, in alphabetical order, e.g. 'dp, tied'."""
        return ", ".join(sorted({label for label, _ in self.seen})) or "none"


def coordinates(rank: int, dp: int, tp: int) -> dict[str, int]:
    return {"pp": rank // (dp * tp), "dp": rank // tp % dp, "tp": rank % tp}


class StandInLayout:
    """The fields of 11a's ParallelLayout a step reads, with groups from the pool."""

    def __init__(self, rank: int, dp: int, tp: int, pp: int, pool: dict):
        self.rank, self.dp, self.tp, self.pp = rank, dp, tp, pp
        self.degrees = {"pp": pp, "dp": dp, "tp": tp}
        self.coords = coordinates(rank, dp, tp)
        self.groups = {axis: pool[tuple(self.ranks(axis))] for axis in AXES}

    def rank_of(self, pp: int, dp: int, tp: int) -> int:
        return (pp * self.dp + dp) * self.tp + tp

    def ranks(self, axis: str) -> list[int]:
        return [self.rank_of(**{**self.coords, axis: i}) for i in range(self.degrees[axis])]

    def group(self, axis: str) -> Any:
        return self.groups[axis]


def labels_of(layout: Any, tied_group: Any) -> dict[int, str]:
    labels = {id(layout.group(axis)): axis for axis in ("pp", "dp", "tp")}
    if tied_group is not None:
        labels[id(tied_group)] = "tied"
    return labels


# --- 11b: lesson11.reduce_grads ----------------------------------------------------------------
# A stand-in rank after backward: an embedding on the first stage, its tied copy (the head) on
# the last, a layer norm every tp rank holds whole, and a tp-sharded matrix. Each gradient says
# where it came from: its use (embedding or head), its dp replica, its tp shard, its stage.

def grad_value(name: str, coords: dict[str, int], pp: int) -> torch.Tensor:
    """The gradient a parameter has after backward on the rank at `coords`."""
    d, t, p = coords["dp"] + 1, coords["tp"], coords["pp"]
    ramp = torch.arange(6, dtype=torch.float64).reshape(3, 2) / 8
    if name == "fc":  # tp-sharded: a different parameter on each tp rank
        return ramp + 100 * (t + 1) + 10 * d + p
    if name == "norm":  # whole on every tp rank: the same gradient there
        return torch.arange(2, dtype=torch.float64) / 4 + 10 * d + p + 0.5
    if name == "embedding":  # its use at the input (pp > 1), or both uses (pp = 1)
        return ramp + (1000 if pp > 1 else 3000) + 10 * d
    if name == "head":  # the tied copy's use at the output (the last stage, pp > 1)
        return ramp * 2 + 2000 + 10 * d
    raise KeyError(name)


def rank_params(coords: dict[str, int], pp: int) -> list[str]:
    """The names of the parameters the rank at `coords` holds."""
    first, last = coords["pp"] == 0, coords["pp"] == pp - 1
    return (["embedding"] if first else []) + ["norm", "fc"] + (
        ["head"] if last and pp > 1 else [])


def _reduce_body(dist: LabelledDist, rank: int, fn, dp: int, tp: int, pp: int,
                 wrapped: bool) -> dict:
    layout = StandInLayout(rank, dp, tp, pp, dist.pool)
    names = rank_params(layout.coords, pp)
    params = {}
    for name in names:
        if wrapped:  # DDP averaged over dp during backward
            g = sum(grad_value(name, {**layout.coords, "dp": i}, pp) for i in range(dp)) / dp
        else:
            g = grad_value(name, layout.coords, pp)
        params[name] = nn.Parameter(torch.zeros_like(g))
        params[name].grad = g.clone()
    stage = nn.Module()
    for name in names:
        stage.register_parameter(name, params[name])
    tied_group, tied = None, None
    if pp > 1 and layout.coords["pp"] in (0, pp - 1):
        ends = [layout.rank_of(pp=0, dp=layout.coords["dp"], tp=layout.coords["tp"]),
                layout.rank_of(pp=pp - 1, dp=layout.coords["dp"], tp=layout.coords["tp"])]
        tied_group = dist.pool[tuple(ends)]
        tied = params["embedding" if layout.coords["pp"] == 0 else "head"]
    dist.labels = labels_of(layout, tied_group)
    run = SimpleNamespace(layout=layout, dist=dist, stage=stage, tied_weight=tied,
                          tied_group=tied_group, dp_reduced_in_backward=wrapped)
    fn(run)
    return {"comm": dist.comm(),
            "grads": {name: p.grad for name, p in params.items()}}


def on_labelled_ranks(k: int, body, fn, *args) -> Any:
    """`on_first_ranks(k, body, fn, *args)` with `body` given a `LabelledDist` whose groups come
    from the pool."""
    pool = group_pool()

    def labelled(counting, r, f, *rest):
        return body(LabelledDist(counting.dist, counting.group, pool), r, f, *rest)
    return on_first_ranks(k, labelled, fn, *args)


def reduce_harness(fn, rank: int, world_size: int, k: int, dp: int, tp: int, pp: int,
                   wrapped: bool = False) -> dict | None:
    return on_labelled_ranks(k, _reduce_body, fn, dp, tp, pp, wrapped)


def _layout_case(k: int, dp: int, tp: int, pp: int, wrapped: bool = False, *, label: str):
    return case(RANK, WORLD_SIZE, k, dp, tp, pp, wrapped, label=label)


register_on_sub_worlds(
    "lesson11.reduce_grads", PART_B,
    params=("run",),
    cases=[
        _layout_case(2, 2, 1, 1, label="2 ranks, (dp, tp, pp) = (2, 1, 1): dp only"),
        _layout_case(2, 1, 2, 1, label="2 ranks, (dp, tp, pp) = (1, 2, 1): tp only"),
        _layout_case(2, 1, 1, 2, label="2 ranks, (dp, tp, pp) = (1, 1, 2): a tied embedding"),
        _layout_case(3, 3, 1, 1, label="3 ranks, (dp, tp, pp) = (3, 1, 1): dp of 3"),
        _layout_case(3, 1, 1, 3, label="3 ranks, (dp, tp, pp) = (1, 1, 3): a middle stage"),
        _layout_case(4, 2, 2, 1, label="4 ranks, (dp, tp, pp) = (2, 2, 1)"),
        _layout_case(4, 2, 1, 2, label="4 ranks, (dp, tp, pp) = (2, 1, 2)"),
        _layout_case(4, 1, 2, 2, label="4 ranks, (dp, tp, pp) = (1, 2, 2)"),
        _layout_case(4, 2, 2, 1, True, label="4 ranks, (2, 2, 1): DDP averaged in backward"),
    ],
    reference="lesson11:reduce_grads",
    explain="lesson11:explain_reduce_grads",
    harness=reduce_harness,
    points=3,
    rtol=1e-9,
    time_limit=20.0,
    hints=("What each axis needs: the one-process gradient of a parameter is the sum of its uses' "
           "gradients over the whole batch. A dp replica saw a share of the batch; a copy of the "
           "tied embedding saw one use; a tp rank already has its parameter's whole gradient.",
           "Two collectives at most, each over its own group: the replicas' average (only when "
           "no wrapper did it during backward), and the sum of the tied embedding's two copies "
           "(only on the ranks that hold one). Nothing on the tp group."),
)


# --- 11b: lesson11.unscale_grads ---------------------------------------------------------------

def _unscale_body(dist, rank: int, fn, scale: float, bad_rank: int, bad: str) -> dict:
    torch.manual_seed(rank)
    tensors = [nn.Parameter(torch.zeros(3)), nn.Parameter(torch.zeros(2, 2)),
               nn.Parameter(torch.zeros(4))]
    grads = [torch.arange(3.0) + rank, torch.full((2, 2), 0.5 * (rank + 1)), None]
    for t, g in zip(tensors, grads):
        t.grad = None if g is None else g * scale
    if rank == bad_rank:
        tensors[1].grad[0, 1] = float("inf") if bad == "inf" else float("nan")
    dist.reset()
    found = fn(tensors, scale, dist)
    return {"comm": ", ".join(f"{name} x{n}" for name, n in sorted(dist.calls.items()) if n)
            or "none",
            "found": found if isinstance(found, bool) else repr(found),
            "grads": [None if t.grad is None else torch.nan_to_num(t.grad, nan=-1.0, posinf=-2.0)
                      for t in tensors]}


def unscale_harness(fn, rank: int, world_size: int, k: int, scale: float, bad_rank: int = -1,
                    bad: str = "inf") -> dict | None:
    return on_first_ranks(k, _unscale_body, fn, scale, bad_rank, bad)


register_on_sub_worlds(
    "lesson11.unscale_grads", PART_B,
    params=("tensors", "scale", "dist"),
    cases=[
        case(RANK, WORLD_SIZE, 2, 1024.0, label="2 ranks, no overflow"),
        case(RANK, WORLD_SIZE, 2, 65536.0, 1, label="2 ranks, an inf on rank 1"),
        case(RANK, WORLD_SIZE, 3, 8.0, 2, label="3 ranks, an inf on rank 2"),
        case(RANK, WORLD_SIZE, 4, 256.0, label="4 ranks, no overflow"),
        case(RANK, WORLD_SIZE, 4, 256.0, 0, "nan", label="4 ranks, a NaN on rank 0"),
    ],
    reference="lesson11:unscale_grads",
    explain="lesson11:explain_unscale_grads",
    harness=unscale_harness,
    points=2,
    rtol=1e-9,
    hints=("Two jobs: every gradient back to its true size, once; and one answer to 'did any "
           "rank overflow?' that every rank gets, since a rank that steps while another skips "
           "never agrees with it again.",
           "Divide each gradient that exists in place, and note whether it holds anything that "
           "is not finite; turn that note into a number, take the largest over the world with "
           "one collective, and answer from the result."),
)


# --- 11b: lesson11.train_step ------------------------------------------------------------------

STEP_MODEL = dict(batch_size=12, micro_batches=2, block_size=16, n_embd=24, optimizer="sgd",
                  lr=0.5, steps=3, init_scale=2.0 ** 10, growth_interval=1000)


def step_config(dp: int, tp: int, pp: int, precision: str) -> Any:
    """The tiny model of a train_step case: heads and layers that divide by 2 and 3."""
    from course_lib.run import TrainConfig

    return TrainConfig(dp=dp, tp=tp, pp=pp, precision=precision,
                       n_layer=3 if pp == 3 else 2, n_head=6, **STEP_MODEL)


def _step_body(dist: LabelledDist, rank: int, fn, dp: int, tp: int, pp: int, precision: str,
               bad_step: int, bad_rank: int) -> dict:
    from course_lib.run import RunBase

    dist.on = False
    run = RunBase(step_config(dp, tp, pp, precision), dist=dist)
    dist.labels = labels_of(run.layout, run.tied_group)
    forward_backward = run.forward_backward

    def counted_apart(x, y):  # what forward and backward communicate is given, not counted
        dist.on = False
        try:
            out = forward_backward(x, y)
            if run.steps_done == bad_step and rank == bad_rank:
                next(p for p in run.stage.parameters() if p.grad is not None).grad.view(-1)[0] = \
                    float("inf")
            return out
        finally:
            dist.on = True
    run.forward_backward = counted_apart
    losses, skipped = [], []
    for _ in range(run.cfg.steps):
        x, y = next(run.data)
        dist.on = True
        got = fn(run, x, y)
        dist.on = False
        if not (isinstance(got, tuple) and len(got) == 2):
            return {"losses": f"(loss, skipped) expected, got {got!r}"[:200]}
        losses.append(float(got[0]))
        skipped.append(bool(got[1]))
        run.steps_done += 1
    return {"comm": dist.comm(), "losses": losses, "skipped": skipped,
            "scale": run.scaler.scale if run.scaler else None}


def step_harness(fn, rank: int, world_size: int, k: int, dp: int, tp: int, pp: int,
                 precision: str = "fp32", bad_step: int = -1, bad_rank: int = -1) -> dict | None:
    return on_labelled_ranks(k, _step_body, fn, dp, tp, pp, precision, bad_step, bad_rank)


def _step_case(k: int, dp: int, tp: int, pp: int, precision: str = "fp32", bad_step: int = -1,
               bad_rank: int = -1, *, label: str):
    return case(RANK, WORLD_SIZE, k, dp, tp, pp, precision, bad_step, bad_rank, label=label)


register_on_sub_worlds(
    "lesson11.train_step", PART_B,
    params=("run", "x", "y"),
    cases=[
        _step_case(2, 2, 1, 1, label="2 ranks, (2, 1, 1), fp32: DDP"),
        _step_case(2, 1, 2, 1, label="2 ranks, (1, 2, 1), fp32"),
        _step_case(2, 1, 1, 2, "fp16", 1, 1, label="2 ranks, (1, 1, 2), fp16: an inf on rank 1"),
        _step_case(3, 1, 1, 3, label="3 ranks, (1, 1, 3), fp32"),
        _step_case(3, 1, 3, 1, label="3 ranks, (1, 3, 1), fp32"),
        _step_case(4, 2, 1, 2, label="4 ranks, (2, 1, 2), fp32"),
        _step_case(4, 1, 2, 2, "fp16", 1, 3, label="4 ranks, (1, 2, 2), fp16: an inf on rank 3"),
        _step_case(4, 2, 2, 1, "fp16", label="4 ranks, (2, 2, 1), fp16"),
    ],
    reference="lesson11:train_step",
    explain="lesson11:explain_train_step",
    harness=step_harness,
    points=3,
    rtol=2e-5,
    time_limit=60.0,
    hints=("The step is the picture at the top of 11b, in its order: what each piece needs has "
           "to exist when it runs (the scale the loss was multiplied by, the skip decided by "
           "every rank). The loss one process would print is on the last stage only, the same on "
           "its tp ranks, one share per dp replica.",
           "After your reductions: with fp16, keep the scale this step used, unscale with it, "
           "then let the scaler update; step only if nothing overflowed; free the gradients "
           "either way. For the loss, let one tp rank of each replica on the last stage "
           "contribute its share (divided by the scale and by dp) to a sum every rank takes "
           "part in."),
)
