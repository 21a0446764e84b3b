"""Lesson 11's exercises: the solutions (exported into course_lib.layout, course_lib.precision,
course_lib.train and course_lib.planning) score full points; realistic wrong versions score
less, with a reason that says what is wrong. The distributed checks run on 2, 3 and 4 ranks of
one scratch cluster."""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import sys

import cloudpickle
import pytest
import torch
from torch import nn

from conftest import full, less
from course_lib import clip_norm, layout, planning, precision, train
from course_lib.ddp import allreduce_grads_bucketed

cloudpickle.register_pickle_by_value(sys.modules[__name__])  # engines cannot import tests


def reason(result) -> str:
    return str(result)


# lesson11.layout_groups ----------------------------------------------------------------------

def tp_strided(dp, tp, pp, cp=1):
    """tp groups strided across the stage (the ranks that talk most, far apart)."""
    g = layout.layout_groups(dp, tp, pp, cp)
    per_stage = dp * tp
    g["tp"] = [[p * per_stage + d + t * dp for t in range(tp)] for p in range(pp)
               for d in range(dp)]
    g["dp"] = [[p * per_stage + d + t * dp for d in range(dp)] for p in range(pp)
               for t in range(tp)]
    return g


def dp_across_stages(dp, tp, pp, cp=1):
    """pp inside dp: rank = (dp_rank * pp + pp_rank) * tp + tp_rank, so a dp group spans stages
    (and cp left out: right only where cp = 1)."""
    def rank(p, d, t):
        return (d * pp + p) * tp + t
    return {"cp": [[r] for r in range(dp * tp * pp)],
            "tp": sorted([[rank(p, d, t) for t in range(tp)] for p in range(pp) for d in range(dp)]),
            "dp": sorted([[rank(p, d, t) for d in range(dp)] for p in range(pp) for t in range(tp)]),
            "pp": sorted([[rank(p, d, t) for p in range(pp)] for d in range(dp) for t in range(tp)])}


def powers_of_two_only(dp, tp, pp, cp=1):
    """Bit tricks on the rank: right only when every degree is a power of two."""
    world = dp * cp * tp * pp
    tb, cb, db = tp.bit_length() - 1, cp.bit_length() - 1, dp.bit_length() - 1
    out = {"tp": {}, "cp": {}, "dp": {}, "pp": {}}
    for r in range(world):
        t, c = r & (tp - 1), (r >> tb) & (cp - 1)
        d, p = (r >> (tb + cb)) & (dp - 1), r >> (tb + cb + db)
        out["tp"].setdefault((p, d, c), []).append(r)
        out["cp"].setdefault((p, d, t), []).append(r)
        out["dp"].setdefault((p, c, t), []).append(r)
        out["pp"].setdefault((d, c, t), []).append(r)
    return {a: sorted(v.values()) for a, v in out.items()}


def groups_unordered(dp, tp, pp, cp=1):
    g = layout.layout_groups(dp, tp, pp, cp)
    return {a: list(reversed(v)) for a, v in g.items()}


def cp_outside_dp(dp, tp, pp, cp=1):
    """cp counted outside dp: rank = ((pp_rank * cp + cp_rank) * dp + dp_rank) * tp + tp_rank,
    so a cp ring strides over the dp replicas: right only where dp or cp is 1."""
    def rank(p, d, c, t):
        return ((p * cp + c) * dp + d) * tp + t
    every = [(p, d, c, t) for p in range(pp) for d in range(dp) for c in range(cp)
             for t in range(tp)]
    out = {}
    for i, axis in enumerate(("pp", "dp", "cp", "tp")):
        groups = {}
        for coords in every:
            key = coords[:i] + coords[i + 1:]
            groups.setdefault(key, []).append(rank(*coords))
        out[axis] = sorted(groups.values())
    return out


def test_layout_groups_solution_and_mistakes():
    full("lesson11.layout_groups", layout.layout_groups)
    reasons = {wrong.__name__: reason(less("lesson11.layout_groups", wrong))
               for wrong in (tp_strided, dp_across_stages, powers_of_two_only, groups_unordered,
                             cp_outside_dp)}
    assert "mixes" in reasons["tp_strided"]
    assert "mixes pp coordinates" in reasons["dp_across_stages"]
    assert "not in order" in reasons["groups_unordered"]
    assert "mixes" in reasons["cp_outside_dp"]


# lesson11.stage_layers -----------------------------------------------------------------------

def embedding_on_every_stage(model, pp, pp_rank):
    blocks = list(model)[1:-1]
    per = len(blocks) // pp
    layers = [model[0], *blocks[pp_rank * per:(pp_rank + 1) * per]]
    return nn.Sequential(*layers, *([model[-1]] if pp_rank == pp - 1 else []))


def head_on_the_first_stage(model, pp, pp_rank):
    blocks = list(model)[1:-1]
    per = len(blocks) // pp
    layers = blocks[pp_rank * per:(pp_rank + 1) * per]
    if pp_rank == 0:
        layers = [model[0], *layers, model[-1]]
    return nn.Sequential(*layers)


def blocks_dealt_round_robin(model, pp, pp_rank):
    blocks = list(model)[1:-1]
    layers = blocks[pp_rank::pp]
    return nn.Sequential(*([model[0]] if pp_rank == 0 else []), *layers,
                         *([model[-1]] if pp_rank == pp - 1 else []))


def copies_of_the_layers(model, pp, pp_rank):
    return nn.Sequential(*(copy.deepcopy(m) for m in layout.stage_layers(model, pp, pp_rank)))


def test_stage_layers_solution_and_mistakes():
    full("lesson11.stage_layers", layout.stage_layers)
    reasons = {wrong.__name__: reason(less("lesson11.stage_layers", wrong))
               for wrong in (embedding_on_every_stage, head_on_the_first_stage,
                             blocks_dealt_round_robin, copies_of_the_layers)}
    assert "only the first stage" in reasons["embedding_on_every_stage"]
    assert "only the last stage" in reasons["head_on_the_first_stage"]
    assert "in the model's order" in reasons["blocks_dealt_round_robin"]
    assert "copies" in reasons["copies_of_the_layers"]


# lesson11.precision_forward ------------------------------------------------------------------

def master_weights_in_bf16(module, args, precision_name):
    """Casts the model: the optimizer would then update bf16 weights (and lose small steps)."""
    if precision_name == "fp32":
        return module(*args)
    dtype = precision.PRECISIONS[precision_name]
    module.to(dtype)
    return module(*(a.to(dtype) for a in args)).float()


def loss_in_bf16(module, args, precision_name):
    """Autocast, but the output stays bf16: the loss (a softmax over the vocabulary) too."""
    dtype = precision.PRECISIONS[precision_name]
    with torch.autocast("cpu", dtype=dtype) if dtype else contextlib.nullcontext():
        return module(*args)


def no_autocast(module, args, precision_name):
    """Says bf16, computes fp32: right numbers, none of the speed or memory."""
    return module(*args)


def autocast_even_for_fp32(module, args, precision_name):
    with torch.autocast("cpu", dtype=torch.bfloat16):
        return module(*args).float()


def test_precision_forward_solution_and_mistakes():
    full("lesson11.precision_forward", precision.precision_forward)
    reasons = {wrong.__name__: reason(less("lesson11.precision_forward", wrong))
               for wrong in (master_weights_in_bf16, loss_in_bf16, no_autocast,
                             autocast_even_for_fp32)}
    assert "masters" in reasons["master_weights_in_bf16"]
    assert "float32" in reasons["loss_in_bf16"]
    assert "did not run in" in reasons["no_autocast"]
    assert "as it is" in reasons["autocast_even_for_fp32"]


# lesson11.update_scale -----------------------------------------------------------------------

def keeps_count_after_overflow(scale, growth_tracker, found_inf, *, growth_factor=2.0,
                               backoff_factor=0.5, growth_interval=2000):
    if found_inf:
        return scale * backoff_factor, growth_tracker
    growth_tracker += 1
    if growth_tracker == growth_interval:
        return scale * growth_factor, 0
    return scale, growth_tracker


def grows_one_step_late(scale, growth_tracker, found_inf, *, growth_factor=2.0,
                        backoff_factor=0.5, growth_interval=2000):
    if found_inf:
        return scale * backoff_factor, 0
    if growth_tracker == growth_interval:
        return scale * growth_factor, 0
    return scale, growth_tracker + 1


def never_restarts_after_growth(scale, growth_tracker, found_inf, *, growth_factor=2.0,
                                backoff_factor=0.5, growth_interval=2000):
    if found_inf:
        return scale * backoff_factor, 0
    growth_tracker += 1
    if growth_tracker % growth_interval == 0:
        return scale * growth_factor, growth_tracker
    return scale, growth_tracker


def shrinks_to_zero(scale, growth_tracker, found_inf, *, growth_factor=2.0,
                    backoff_factor=0.5, growth_interval=2000):
    if found_inf:
        return 0.0, 0
    return precision.update_scale(scale, growth_tracker, False, growth_interval=growth_interval)


def test_update_scale_solution_and_mistakes():
    full("lesson11.update_scale", precision.update_scale)
    reasons = {wrong.__name__: reason(less("lesson11.update_scale", wrong))
               for wrong in (keeps_count_after_overflow, grows_one_step_late,
                             never_restarts_after_growth, shrinks_to_zero)}
    assert "restarts at 0" in reasons["keeps_count_after_overflow"]
    assert "the scale grows" in reasons["grows_one_step_late"]
    assert "clean steps in a row" in reasons["never_restarts_after_growth"]
    assert "backoff_factor" in reasons["shrinks_to_zero"]


# lesson11.reduce_grads -----------------------------------------------------------------------

def _dp_average(run):
    if run.layout.dp > 1 and not run.dp_reduced_in_backward:
        params = [p for p in run.stage.parameters() if p.grad is not None]
        allreduce_grads_bucketed(params, dist=run.dist, group=run.layout.group("dp"))


def tied_averaged_over_pp(run):
    """Averages the tied embedding's two copies, as if they were replicas."""
    if run.tied_weight is not None:
        run.dist.all_reduce(run.tied_weight.grad, group=run.tied_group)
        run.tied_weight.grad /= 2
    _dp_average(run)


def tp_shards_reduced(run):
    """Averages every gradient over tp as well: the shards of different weights get mixed."""
    train.reduce_grads(run)
    if run.layout.tp > 1:
        params = [p for p in run.stage.parameters() if p.grad is not None]
        allreduce_grads_bucketed(params, dist=run.dist, group=run.layout.group("tp"))


def dp_summed(run):
    if run.tied_weight is not None:
        run.dist.all_reduce(run.tied_weight.grad, group=run.tied_group)
    if run.layout.dp > 1 and not run.dp_reduced_in_backward:
        for p in run.stage.parameters():
            run.dist.all_reduce(p.grad, group=run.layout.group("dp"))


def dp_again_after_ddp(run):
    if run.tied_weight is not None:
        run.dist.all_reduce(run.tied_weight.grad, group=run.tied_group)
    if run.layout.dp > 1:
        params = [p for p in run.stage.parameters() if p.grad is not None]
        allreduce_grads_bucketed(params, dist=run.dist, group=run.layout.group("dp"))


def tied_copies_left_alone(run):
    _dp_average(run)


def test_one_step_sends_what_the_traffic_model_says_by_group(scratch_cluster_4):
    """Lesson 11b's table: on every rank, one training step's payload bytes per group (dp, tp,
    pp, tied, world) are `layout_picture.traffic`'s, group for group."""
    from course_lib.course.demos import layout_picture
    from course_lib.train import Run, TrainConfig

    for dp, tp, pp in [(2, 2, 1), (2, 1, 2), (1, 2, 2)]:
        cfg = TrainConfig(dp=dp, tp=tp, pp=pp, batch_size=16, micro_batches=2, steps=1)
        for r in scratch_cluster_4.run(layout_picture.measure_step, cfg, Run):
            got = {kind: m["bytes"] for kind, m in r["measured"].items()}
            assert got == {kind: m["bytes"] for kind, m in r["model"].items()}, ((dp, tp, pp), r)


def test_reduce_grads_solution_and_mistakes(scratch_cluster_4):
    full("lesson11.reduce_grads", train.reduce_grads, scratch_cluster_4)
    reasons = {wrong.__name__: reason(less("lesson11.reduce_grads", wrong, scratch_cluster_4))
               for wrong in (tied_averaged_over_pp, tp_shards_reduced, dp_summed,
                             dp_again_after_ddp, tied_copies_left_alone)}
    assert "average of the two copies" in reasons["tied_averaged_over_pp"]
    assert "tp needs no reduction" in reasons["tp_shards_reduced"]
    assert "summed over the 2 dp replicas, not averaged" in reasons["dp_summed"]
    assert "DDP already averaged" in reasons["dp_again_after_ddp"]
    assert "only its own use's gradient" in reasons["tied_copies_left_alone"]


# lesson11.unscale_grads ----------------------------------------------------------------------

def unscales_twice(tensors, scale, dist):
    found = train.unscale_grads(tensors, scale, dist)
    for t in tensors:
        if t.grad is not None:
            t.grad.div_(scale)
    return found


def decides_alone(tensors, scale, dist):
    """Each rank skips on its own gradients only."""
    found = False
    for t in tensors:
        if t.grad is not None:
            t.grad.div_(scale)
            found = found or not bool(torch.isfinite(t.grad).all())
    return found


def forgets_to_unscale(tensors, scale, dist):
    flag = torch.tensor([float(any(t.grad is not None and not torch.isfinite(t.grad).all()
                                   for t in tensors))])
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return bool(flag.item())


def test_unscale_grads_solution_and_mistakes(scratch_cluster_4):
    full("lesson11.unscale_grads", train.unscale_grads, scratch_cluster_4)
    reasons = {wrong.__name__: reason(less("lesson11.unscale_grads", wrong, scratch_cluster_4))
               for wrong in (unscales_twice, decides_alone, forgets_to_unscale)}
    assert "divided by the scale twice" in reasons["unscales_twice"]
    assert "its own gradients only" in reasons["decides_alone"]
    assert "still scaled" in reasons["forgets_to_unscale"]


# lesson11.total_norm -------------------------------------------------------------------------

def norm_of_own_pieces(held, norm_type, groups, dist):
    """Each rank clips by the norm of what it holds."""
    return clip_norm.total_norm(held, norm_type, [], dist)


def copies_counted_on_every_tp_rank(held, norm_type, groups, dist):
    return clip_norm.total_norm([h._replace(counted=True) for h in held], norm_type, groups, dist)


def padding_counted(held, norm_type, groups, dist):
    return clip_norm.total_norm([h._replace(numel=h.grad.numel()) for h in held], norm_type,
                                groups, dist)


def maxima_summed(held, norm_type, groups, dist):
    """Every level reduced with a sum, the inf-norm's maxima included."""
    p = float(norm_type)
    mine = [h.grad.reshape(-1)[:h.numel].double().abs() for h in held if h.counted and h.numel]
    flat = torch.cat([torch.zeros(1, dtype=torch.float64)] + mine)
    piece = flat.max() if p == float("inf") else (flat ** p).sum()
    for group in groups:
        dist.all_reduce(piece, group=group)
    return piece if p == float("inf") else piece ** (1 / p)


def test_total_norm_solution_and_mistakes(scratch_cluster_4):
    full("lesson11.total_norm", clip_norm.total_norm, scratch_cluster_4)
    reasons = {wrong.__name__: reason(less("lesson11.total_norm", wrong, scratch_cluster_4))
               for wrong in (norm_of_own_pieces, copies_counted_on_every_tp_rank,
                             padding_counted, maxima_summed)}
    assert "reduced over none" in reasons["norm_of_own_pieces"]
    assert "counted on each of the 2 tp ranks" in reasons["copies_counted_on_every_tp_rank"]
    assert "padding at the end of the flat shards" in reasons["padding_counted"]
    assert "were added up" in reasons["maxima_summed"]


# lesson11.train_step -------------------------------------------------------------------------

def _loss_share(run, local, scale, every_tp_rank=False):
    share = torch.zeros(1)
    if local is not None and (every_tp_rank or run.layout.coords["tp"] == 0):
        share += local.float() / scale / run.layout.dp
    run.dist.all_reduce(share)
    return share.item()


def step_unscaling_twice(run, x, y):
    local = run.forward_backward(x, y)
    train.reduce_grads(run)
    scale, skipped = 1.0, False
    if run.scaler is not None:
        scale = run.scaler.scale
        for t in run.stepped_tensors():
            if t.grad is not None:
                t.grad.div_(scale)  # "unscale", then the real unscale below
        skipped = train.unscale_grads(run.stepped_tensors(), scale, run.dist)
        run.scaler.update(skipped)
    if not skipped:
        run.optimizer.step()
    run.optimizer.zero_grad(set_to_none=True)
    return _loss_share(run, local, scale), skipped


def step_counting_every_tp_rank(run, x, y):
    local = run.forward_backward(x, y)
    train.reduce_grads(run)
    scale, skipped = 1.0, False
    if run.scaler is not None:
        scale = run.scaler.scale
        skipped = train.unscale_grads(run.stepped_tensors(), scale, run.dist)
        run.scaler.update(skipped)
    if not skipped:
        run.optimizer.step()
    run.optimizer.zero_grad(set_to_none=True)
    return _loss_share(run, local, scale, every_tp_rank=True), skipped


def step_loss_with_the_new_scale(run, x, y):
    local = run.forward_backward(x, y)
    train.reduce_grads(run)
    skipped = False
    if run.scaler is not None:
        skipped = train.unscale_grads(run.stepped_tensors(), run.scaler.scale, run.dist)
        run.scaler.update(skipped)
    if not skipped:
        run.optimizer.step()
    run.optimizer.zero_grad(set_to_none=True)
    return _loss_share(run, local, run.scaler.scale if run.scaler else 1.0), skipped


def step_even_when_skipped(run, x, y):
    local = run.forward_backward(x, y)
    train.reduce_grads(run)
    scale, skipped = 1.0, False
    if run.scaler is not None:
        scale = run.scaler.scale
        skipped = train.unscale_grads(run.stepped_tensors(), scale, run.dist)
        run.scaler.update(skipped)
    run.optimizer.step()
    run.optimizer.zero_grad(set_to_none=True)
    return _loss_share(run, local, scale), skipped


def step_without_zero_grad(run, x, y):
    local = run.forward_backward(x, y)
    train.reduce_grads(run)
    scale, skipped = 1.0, False
    if run.scaler is not None:
        scale = run.scaler.scale
        skipped = train.unscale_grads(run.stepped_tensors(), scale, run.dist)
        run.scaler.update(skipped)
    if not skipped:
        run.optimizer.step()
    return _loss_share(run, local, scale), skipped


def step_with_tied_averaged(run, x, y):
    local = run.forward_backward(x, y)
    tied_averaged_over_pp(run)
    scale, skipped = 1.0, False
    if run.scaler is not None:
        scale = run.scaler.scale
        skipped = train.unscale_grads(run.stepped_tensors(), scale, run.dist)
        run.scaler.update(skipped)
    if not skipped:
        run.optimizer.step()
    run.optimizer.zero_grad(set_to_none=True)
    return _loss_share(run, local, scale), skipped


def test_train_step_solution_and_mistakes(scratch_cluster_4):
    full("lesson11.train_step", train.train_step, scratch_cluster_4)
    wrongs = (step_unscaling_twice, step_counting_every_tp_rank, step_loss_with_the_new_scale,
              step_even_when_skipped, step_without_zero_grad, step_with_tied_averaged)
    reasons = {wrong.__name__: reason(less("lesson11.train_step", wrong, scratch_cluster_4))
               for wrong in wrongs}
    assert "divided by the scale twice" in reasons["step_unscaling_twice"]
    assert "times one process's" in reasons["step_counting_every_tp_rank"]
    assert "after its update" in reasons["step_loss_with_the_new_scale"]
    assert "NaN" in reasons["step_even_when_skipped"]
    assert "never freed" in reasons["step_without_zero_grad"]
    assert "averaged, not summed" in reasons["step_with_tied_averaged"]


# lesson11.step_cost --------------------------------------------------------------------------

def _cost(s, dp, tp, pp, zero, *, per_param=None, tp_collectives=4, zero3_factor=3,
          bubble=True, split=True):
    local = s.params / ((tp * pp) if split else 1)
    per = (per_param or {0: 16, 1: 4 + 12 / dp, 2: 2 + 14 / dp, 3: 16 / dp})[zero]
    memory = per * local + planning.activation_bytes(s, tp)
    m = s.batch // (dp * s.micro_batch)
    act = 2 * s.micro_batch * s.seq * s.hidden
    dp_bytes = (zero3_factor if zero == 3 else 2) * (dp - 1) / dp * 2 * local
    tp_bytes = tp_collectives * 2 * (tp - 1) / tp * act * m * s.layers / pp
    pp_bytes = 2 * m * act if pp > 1 else 0.0

    def link(span):
        return s.intra if span <= s.per_node else s.inter

    compute = 8 * s.params * s.batch * s.seq / (s.devices * s.flops)
    time = (compute * ((m + pp - 1) / m if bubble else 1) + dp_bytes / link(dp * tp)
            + tp_bytes / link(tp) + pp_bytes / link(s.devices))
    return {"memory": memory, "comm": dp_bytes + tp_bytes + pp_bytes, "time": time}


def zero_shards_the_weights_too(s, dp, tp, pp, zero):
    return _cost(s, dp, tp, pp, zero, per_param={0: 16, 1: 16 / dp, 2: 16 / dp, 3: 16 / dp})


def two_all_reduces_per_layer(s, dp, tp, pp, zero):
    return _cost(s, dp, tp, pp, zero, tp_collectives=2)


def zero3_moves_what_ddp_moves(s, dp, tp, pp, zero):
    return _cost(s, dp, tp, pp, zero, zero3_factor=2)


def no_bubble(s, dp, tp, pp, zero):
    return _cost(s, dp, tp, pp, zero, bubble=False)


def states_of_the_whole_model(s, dp, tp, pp, zero):
    return _cost(s, dp, tp, pp, zero, split=False)


def test_step_cost_solution_and_mistakes():
    full("lesson11.step_cost", planning.step_cost)
    reasons = {wrong.__name__: reason(less("lesson11.step_cost", wrong))
               for wrong in (zero_shards_the_weights_too, two_all_reduces_per_layer,
                             zero3_moves_what_ddp_moves, no_bubble, states_of_the_whole_model)}
    assert "stay whole" in reasons["zero_shards_the_weights_too"]
    assert "twice in the backward" in reasons["two_all_reduces_per_layer"]
    assert "1.5 times DDP" in reasons["zero3_moves_what_ddp_moves"]
    assert "bubble" in reasons["no_bubble"]
    assert "1/(tp x pp)" in reasons["states_of_the_whole_model"]


# lesson11.plan -------------------------------------------------------------------------------

def _layouts(s):
    for pp in range(1, s.devices + 1):
        for tp in range(1, s.per_node + 1):
            if s.devices % (tp * pp) or s.layers % pp or s.heads % tp:
                continue
            dp = s.devices // (tp * pp)
            if s.batch % (dp * s.micro_batch):
                continue
            for zero in range(4):
                yield dp, tp, pp, zero


def _pack(s, dp, tp, pp, zero):
    need = {"dp"} | ({f"zero{zero}"} if zero else set()) | ({"tp"} if tp > 1 else set()) | (
        {"pp"} if pp > 1 else set())
    return {"dp": dp, "tp": tp, "pp": pp, "zero": zero, **planning.step_cost(s, dp, tp, pp, zero),
            "stack": next((n for n in s.stacks if need <= planning.STACKS[n]), None)}


def first_that_fits(s):
    """The review's ladder without the clock: DDP, ZeRO, then TP, then PP, first fit wins."""
    for dp, tp, pp, zero in _layouts(s):
        if planning.step_cost(s, dp, tp, pp, zero)["memory"] <= s.memory:
            return _pack(s, dp, tp, pp, zero)
    return None


def one_big_node(s):
    """Every link as fast as the links inside a node: the slow network is forgotten."""
    return planning.plan(dataclasses.replace(s, per_node=s.devices, inter=s.intra))


def favourite_stack(s):
    """The team's first stack, whatever the layout needs."""
    best = planning.plan(s)
    return None if best is None else {**best, "stack": s.stacks[0]}


def fastest_even_if_it_does_not_fit(s):
    best = None
    for dp, tp, pp, zero in _layouts(s):
        cost = planning.step_cost(s, dp, tp, pp, zero)
        if best is None or cost["time"] < best["time"]:
            best = {"dp": dp, "tp": tp, "pp": pp, "zero": zero, **cost, "stack": s.stacks[0]}
    return best


def test_plan_solution_and_mistakes():
    full("lesson11.plan", planning.plan)
    reasons = {wrong.__name__: reason(less("lesson11.plan", wrong))
               for wrong in (first_that_fits, one_big_node, favourite_stack,
                             fastest_even_if_it_does_not_fit)}
    assert "fits, but its step takes" in reasons["first_that_fits"]
    assert "fits, but its step takes" in reasons["one_big_node"]
    assert "the first of the team's stacks" in reasons["favourite_stack"]
    assert "more than" in reasons["fastest_even_if_it_does_not_fit"]
