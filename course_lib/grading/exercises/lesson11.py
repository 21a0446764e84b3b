"""Lesson 11 (the capstone), in three parts. 11a: the layout's groups, a pipeline stage's layers,
where mixed precision casts, fp16's loss-scale rule (checked in the grading process). 11b: the
training step's gradient reductions, the loss scaler's unscale and skip, and the whole step, on
2, 3 and 4 ranks, with every collective counted by the group it ran on. 11c: a job's memory,
communication and time per step, and the layout and stack chosen for it.

Expected values and the explanations of wrong ones are judge-side, in
`course_lib/grading/references/lesson11.py`: one-process PyTorch and the lesson's formulas,
never the package's own answers.
"""

from __future__ import annotations

import itertools
from types import SimpleNamespace
from typing import Any

import torch
from torch import nn

from course_lib.grading import RANK, WORLD_SIZE, Exercise, case, register
from course_lib.grading.sub_worlds import LateDist, on_first_ranks, register_on_sub_worlds

PART_A, PART_B, PART_C = "11a_layout_precision", "11b_train_step", "11c_learn_build_buy"
AXES = ("pp", "dp", "tp")

# --- 11a: lesson11.layout_groups ---------------------------------------------------------------


def groups_harness(fn, dp: int, tp: int, pp: int) -> dict:
    got = fn(dp, tp, pp)
    if not isinstance(got, dict) or set(got) != set(AXES):
        return {"groups": f"a dict with keys {sorted(AXES)} expected, got {got!r}"[:300]}
    return {"groups": {a: [[int(r) for r in g] for g in got[a]] for a in AXES}}


register(Exercise(
    name="lesson11.layout_groups",
    notebook=PART_A,
    params=("dp", "tp", "pp"),
    cases=[
        case(4, 1, 1, label="(4,1,1): data parallel only"),
        case(2, 2, 1, label="(2,2,1)"),
        case(2, 1, 2, label="(2,1,2)"),
        case(1, 2, 2, label="(1,2,2)"),
        case(2, 2, 2, label="(2,2,2): 8 ranks"),
        case(3, 2, 1, label="(3,2,1): 6 ranks, dp not a power of two"),
        case(1, 3, 2, label="(1,3,2): tp of 3"),
        case(2, 3, 2, label="(2,3,2): 12 ranks"),
        case(1, 1, 3, label="(1,1,3): pipeline only"),
    ],
    reference="lesson11:layout_groups",
    explain="lesson11:explain_layout_groups",
    harness=groups_harness,
    points=2,
    hints=("Each rank has a coordinate on each of the three axes, and the ranks are counted with "
           "the tp coordinate changing fastest, then dp, then pp. A group of one axis is the "
           "ranks whose other two coordinates are equal.",
           "Picture the ranks as pp tables, one per stage, each of dp rows and tp columns, filled "
           "row by row and table after table: a tp group is a row of one table, a dp group a "
           "column of one table, a pp group the same cell of every table. List each in the order "
           "of its own coordinate."),
))


# --- 11a: lesson11.stage_layers ----------------------------------------------------------------

class _Named(nn.Module):
    """A stand-in layer: a name and one parameter (whose identity the check follows)."""

    def __init__(self, name: str):
        super().__init__()
        self.name = name
        self.weight = nn.Parameter(torch.zeros(1))

    def extra_repr(self) -> str:
        return self.name


def stand_in_model(n_blocks: int) -> nn.Sequential:
    return nn.Sequential(_Named("embedding"), *(_Named(f"block {i}") for i in range(n_blocks)),
                         _Named("head"))


def stage_harness(fn, n_blocks: int, pp: int, pp_rank: int) -> dict:
    model = stand_in_model(n_blocks)
    got = fn(model, pp, pp_rank)
    if not isinstance(got, nn.Sequential):
        return {"layers": f"an nn.Sequential expected, got {type(got).__name__}"}
    own = {id(m) for m in model}
    return {"layers": [getattr(m, "name", type(m).__name__) for m in got],
            "the model's own modules": all(id(m) in own for m in got)}


register(Exercise(
    name="lesson11.stage_layers",
    notebook=PART_A,
    params=("model", "pp", "pp_rank"),
    cases=[
        case(4, 1, 0, label="4 blocks, pp=1: one stage holds all"),
        case(4, 2, 0, label="4 blocks, pp=2, the first stage"),
        case(4, 2, 1, label="4 blocks, pp=2, the last stage"),
        case(6, 3, 1, label="6 blocks, pp=3, the middle stage"),
        case(6, 3, 2, label="6 blocks, pp=3, the last stage"),
        case(8, 4, 0, label="8 blocks, pp=4, the first stage"),
        case(8, 4, 2, label="8 blocks, pp=4, stage 2"),
    ],
    reference="lesson11:stage_layers",
    explain="lesson11:explain_stage_layers",
    harness=stage_harness,
    points=2,
    hints=("A stage is a contiguous run of the blocks, the same number on every stage, in the "
           "model's order; the first stage also begins with the embedding and the last also ends "
           "with the head. With one stage, it is both.",
           "Picture 6 blocks on 3 stages: [embedding, blocks 0-1], [blocks 2-3], [blocks 4-5, "
           "head]. Keep the modules themselves, not copies: the stage must train the model's "
           "own parameters."),
))


# --- 11a: lesson11.precision_forward -----------------------------------------------------------


def precision_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(12, 32), nn.GELU(), nn.Linear(32, 5))


def precision_input() -> torch.Tensor:
    return torch.linspace(-2, 2, 7 * 12).reshape(7, 12)


def precision_report(model: nn.Module, out: Any) -> dict:
    if not isinstance(out, torch.Tensor):
        return {"output": f"a tensor expected, got {type(out).__name__}"}
    out.float().square().mean().backward()
    return {"output": out.detach().float(), "output dtype": str(out.dtype),
            "parameter dtypes": sorted({str(p.dtype) for p in model.parameters()}),
            "gradient dtypes": sorted({str(p.grad.dtype) for p in model.parameters()
                                       if p.grad is not None})}


def precision_harness(fn, precision: str) -> dict:
    with torch.random.fork_rng(devices=[]):
        model = precision_model()
    return precision_report(model, fn(model, (precision_input(),), precision))


register(Exercise(
    name="lesson11.precision_forward",
    notebook=PART_A,
    params=("module", "args", "precision"),
    cases=[case("bf16", label="bf16"), case("fp16", label="fp16"),
           case("fp32", label="fp32: the module as it is")],
    reference="lesson11:precision_forward",
    explain="lesson11:explain_precision_forward",
    harness=precision_harness,
    rtol=1e-6,
    points=2,
    hints=("Two invariants: the module's parameters stay fp32 (they are the masters the "
           "optimizer updates, with fp32 gradients), and what comes out is fp32; in between, "
           "each matmul runs in the lower precision.",
           "The rules above the exercise name the tool that casts each op's inputs as it runs, "
           "for the span of a with-block: run the module inside it for bf16 and fp16, then "
           "convert what comes out. For fp32 there is nothing to do."),
))


# --- 11a: lesson11.update_scale ----------------------------------------------------------------

def scale_harness(fn, overflows: str, growth_interval: int) -> dict:
    """The (scale, tracker) after each step of a run whose overflows are the 'x's."""
    scale, tracker, seen = 1024.0, 0, []
    for flag in overflows:
        scale, tracker = fn(scale, tracker, flag == "x", growth_interval=growth_interval)
        seen.append((float(scale), int(tracker)))
    return {"after each step": seen}


register(Exercise(
    name="lesson11.update_scale",
    notebook=PART_A,
    params=("scale", "growth_tracker", "found_inf"),
    cases=[
        case("....", 2, label="clean steps: grow every 2"),
        case(".x...", 3, label="an overflow restarts the count"),
        case("xx.x", 2, label="overflows in a row keep shrinking"),
        case("......", 1, label="growth_interval 1: grow every clean step"),
        case("..x..x...", 4, label="never 4 clean steps in a row"),
    ],
    reference="lesson11:update_scale",
    explain="lesson11:explain_update_scale",
    harness=scale_harness,
    points=1,
    hints=("The scale is the largest power of two that has not overflowed lately: every "
           "overflow shrinks it at once, growth_interval clean steps in a row grow it, and any "
           "change of the scale starts the count of clean steps again.",
           "Follow the lesson's table one step at a time: first what an overflow does to both "
           "numbers; otherwise count the clean step, and only then ask whether the count has "
           "just reached the interval."),
))


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


def reduce_harness(fn, rank: int, world_size: int, k: int, dp: int, tp: int, pp: int,
                   wrapped: bool = False) -> dict | None:
    pool = group_pool()

    def body(counting, r, f):
        return _reduce_body(LabelledDist(counting.dist, counting.group, pool), r, f, dp, tp, pp,
                            wrapped)
    return on_first_ranks(k, body, fn)


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
    pool = group_pool()

    def body(counting, r, f):
        return _step_body(LabelledDist(counting.dist, counting.group, pool), r, f, dp, tp, pp,
                          precision, bad_step, bad_rank)
    return on_first_ranks(k, body, fn)


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


# --- 11c: lesson11.step_cost and lesson11.plan -------------------------------------------------
# Scenarios are plain dicts here (the harness builds the lesson's `Scenario` from them), so this
# module imports nothing of the learner's at import time.

G = 1e9
A100 = dict(memory=80 * G, flops=125e12, intra=150 * G)
H100 = dict(memory=80 * G, flops=400e12, intra=300 * G)
SMALL_GPU = dict(memory=24 * G, flops=80e12, intra=25 * G, inter=12.5 * G)


def scenario(name: str, params: float, layers: int, hidden: int, heads: int, seq: int,
             batch: int, micro_batch: int, devices: int, per_node: int, stacks: tuple,
             **hardware: float) -> dict:
    return dict(name=name, params=params, layers=layers, hidden=hidden, heads=heads, seq=seq,
                batch=batch, micro_batch=micro_batch, devices=devices, per_node=per_node,
                stacks=tuple(stacks), **hardware)


SCENARIOS = {
    "1.3B": scenario("fine-tune 1.3B, one node of 8 A100", 1.3e9, 24, 2048, 16, 2048, 64, 4, 8,
                     8, ("PyTorch", "DeepSpeed"), inter=12.5 * G, **A100),
    "7B, 2 nodes": scenario("7B, 2 nodes of 8 H100, 100 Gb/s between them", 7e9, 32, 4096, 32,
                            4096, 256, 1, 16, 8, ("PyTorch", "DeepSpeed", "Megatron-Core"),
                            inter=12.5 * G / 8, **H100),
    "70B": scenario("70B, 8 nodes of 8 H100, 400 Gb/s per GPU", 70e9, 80, 8192, 64, 4096, 512,
                    1, 64, 8, ("Megatron-Core", "PyTorch"), inter=50 * G, **H100),
    "7B, 24 GB": scenario("7B on 8 GPUs of 24 GB", 7e9, 32, 4096, 32, 4096, 64, 1, 8, 8,
                          ("PyTorch",), **SMALL_GPU),
    "70B, 24 GB": scenario("70B on 8 GPUs of 24 GB", 70e9, 80, 8192, 64, 4096, 64, 1, 8, 8,
                           ("PyTorch", "DeepSpeed"), **SMALL_GPU),
    "TF, 350M": scenario("350M, a TensorFlow team, 4 A100", 350e6, 24, 1024, 16, 1024, 128, 8,
                         4, 4, ("tf.distribute",), inter=12.5 * G, **A100),
    "TF, 7B": scenario("7B, a TensorFlow team, 8 A100 of 40 GB", 7e9, 32, 4096, 32, 4096, 64,
                       1, 8, 8, ("tf.distribute",), memory=40 * G, flops=125e12,
                       intra=150 * G, inter=12.5 * G),
    "capstone": scenario("the capstone's GPT, 4 CPU ranks of a laptop", 0.8e6, 4, 128, 4, 64,
                         16, 4, 4, 4, ("ours", "PyTorch"), memory=4 * G, flops=20e9,
                         intra=2 * G, inter=2 * G),
}


def as_scenario(spec: dict) -> Any:
    from course_lib.planning import Scenario

    return Scenario(**spec)


def cost_harness(fn, spec: dict, dp: int, tp: int, pp: int, zero: int) -> dict:
    got = fn(as_scenario(spec), dp, tp, pp, zero)
    if not isinstance(got, dict) or not {"memory", "comm", "time"} <= set(got):
        return {"memory (GB)": f"a dict with memory, comm and time expected, got {got!r}"[:200]}
    return {"memory (GB)": float(got["memory"]) / G, "comm (GB)": float(got["comm"]) / G,
            "time (s)": float(got["time"])}


def _cost_case(key: str, dp: int, tp: int, pp: int, zero: int, *, label: str):
    return case(SCENARIOS[key], dp, tp, pp, zero, label=label)


register(Exercise(
    name="lesson11.step_cost",
    notebook=PART_C,
    params=("s", "dp", "tp", "pp", "zero"),
    cases=[
        _cost_case("1.3B", 8, 1, 1, 0, label="1.3B on 8 GPUs: DDP"),
        _cost_case("1.3B", 8, 1, 1, 1, label="1.3B on 8 GPUs: ZeRO-1"),
        _cost_case("7B, 24 GB", 8, 1, 1, 3, label="7B on 8 GPUs of 24 GB: ZeRO-3"),
        _cost_case("7B, 2 nodes", 16, 1, 1, 2, label="7B, 2 nodes: dp 16 across them, ZeRO-2"),
        _cost_case("7B, 2 nodes", 2, 8, 1, 0, label="7B, 2 nodes: tp 8 in each, dp 2"),
        _cost_case("7B, 2 nodes", 8, 1, 2, 0, label="7B, 2 nodes: pp 2 across them, dp 8"),
        _cost_case("70B", 16, 2, 2, 2, label="70B on 64 GPUs: dp 16, tp 2, pp 2, ZeRO-2"),
    ],
    reference="lesson11:step_cost",
    explain="lesson11:explain_step_cost",
    harness=cost_harness,
    rtol=1e-6,
    points=2,
    hints=("Three sums, each from a lesson: the bytes of the model states a device keeps (08a "
           "and 08b, on its share of the parameters after tp and pp) plus the activations; the "
           "bytes it sends per step over each of its groups; the compute stretched by the "
           "pipeline's bubble (07a) plus each group's bytes over that group's link.",
           "Work per group. dp: the stage's bf16 gradients, all-reduced (ZeRO-3 also gathers "
           "the parameters twice). tp: 2 all-reduces forward and 2 backward per layer and "
           "micro-batch. pp: one activation forward and its gradient back per micro-batch. A "
           "group's link is the fast one only if all its ranks fit in one node."),
))


def plan_harness(fn, spec: dict) -> dict | None:
    got = fn(as_scenario(spec))
    if got is None:
        return None
    if not isinstance(got, dict):
        return {"layout": f"a dict or None expected, got {got!r}"[:200]}
    try:
        out = {"layout": [int(got["dp"]), int(got["tp"]), int(got["pp"]), int(got["zero"])],
               "stack": got["stack"]}
        out.update({"memory (GB)": float(got["memory"]) / G, "time (s)": float(got["time"])})
    except (KeyError, TypeError, ValueError) as exc:
        return {"layout": f"missing or wrong field: {exc!r}"[:200]}
    return out


register(Exercise(
    name="lesson11.plan",
    notebook=PART_C,
    params=("s",),
    cases=[case(SCENARIOS["1.3B"], label="fine-tune 1.3B, one node of 8 A100"),
           case(SCENARIOS["7B, 2 nodes"], label="7B, 2 nodes of 8 H100, 100 Gb/s"),
           case(SCENARIOS["70B"], label="70B, 8 nodes of 8 H100"),
           case(SCENARIOS["7B, 24 GB"], label="7B on 8 GPUs of 24 GB"),
           case(SCENARIOS["70B, 24 GB"], label="70B on 8 GPUs of 24 GB"),
           case(SCENARIOS["TF, 350M"], label="350M, a TensorFlow team"),
           case(SCENARIOS["TF, 7B"], label="7B, a TensorFlow team"),
           case(SCENARIOS["capstone"], label="the capstone on a laptop")],
    reference="lesson11:plan",
    explain="lesson11:explain_plan",
    harness=plan_harness,
    rtol=1e-6,
    points=2,
    hints=("Among the layouts that are possible at all (every device used, tp inside a node and "
           "dividing the heads, pp dividing the layers, whole micro-batches per replica) and "
           "that fit in a device's memory, the one whose step is shortest; on a tie, the "
           "simplest. Then the first stack the team accepts that does everything the layout "
           "needs.",
           "Try every pp, then every tp, then ZeRO stages 0 to 3, in increasing order, and keep "
           "a layout only if it is strictly faster than the best so far: ties then go to the "
           "smaller pipeline, the smaller tp, the lower ZeRO stage. Nothing fits: None."),
))
