"""Lesson 08's exercises (08a: course_lib.sharding and course_lib.zero; 08b: course_lib.fsdp):
the solutions score full points on 2, 3 and 4 ranks; realistic wrong versions score less, with
a reason that says what is wrong."""

from __future__ import annotations

import math
import sys

import cloudpickle
import pytest
import torch

from conftest import full, less
from course_lib import fsdp, sharding, zero
from course_lib.backend import default_dist
from course_lib.data_parallel import buckets_to_launch
from course_lib.zero_machinery import add_grad

cloudpickle.register_pickle_by_value(sys.modules[__name__])  # engines cannot import tests/


@pytest.fixture
def c4(scratch_cluster_4):
    return scratch_cluster_4


def reason_has(result, *words):
    for word in words:
        assert word in result.reason, result.reason


# lesson08.shard_range -------------------------------------------------------------------------

def floor_division(numel, world_size, rank):
    size = numel // world_size  # drops the remainder: the last elements belong to nobody
    return rank * size, (rank + 1) * size


def remainder_to_the_last(numel, world_size, rank):
    size = numel // world_size  # uneven: the last rank's shard is larger, reduce_scatter fails
    return rank * size, numel if rank == world_size - 1 else (rank + 1) * size


def off_by_one(numel, world_size, rank):
    size = math.ceil(numel / world_size)
    return rank * size, (rank + 1) * size - 1


def test_shard_range_solution_and_mistakes():
    full("lesson08.shard_range", sharding.shard_range)
    reason_has(less("lesson08.shard_range", floor_division), "belong to nobody")
    reason_has(less("lesson08.shard_range", remainder_to_the_last), "as many")
    reason_has(less("lesson08.shard_range", off_by_one), "belong to nobody")


# lesson08.reduce_scatter_grads ----------------------------------------------------------------

class _Done:
    def wait(self):
        return True


def sums_not_averages(flat_grad, shard, *, dist=None, group=None, async_op=False):
    dist = default_dist(dist)
    return dist.reduce_scatter(shard, list(flat_grad.chunk(dist.get_world_size(group))),
                               group=group, async_op=async_op)


def chunks_reversed(flat_grad, shard, *, dist=None, group=None, async_op=False):
    dist = default_dist(dist)
    world = dist.get_world_size(group)
    dist.reduce_scatter(shard, list(reversed(flat_grad.chunk(world))), group=group)
    shard.div_(world)
    return sharding.Then(_Done(), lambda: None) if async_op else None


def all_reduce_then_slice(flat_grad, shard, *, dist=None, group=None, async_op=False):
    """The right numbers with the wrong communication: twice the bytes, the whole gradient."""
    dist = default_dist(dist)
    world = dist.get_world_size(group)
    total = flat_grad.clone()
    dist.all_reduce(total, group=group)
    shard.copy_(total.chunk(world)[dist.get_rank(group)] / world)
    return sharding.Then(_Done(), lambda: None) if async_op else None


def divides_before_waiting(flat_grad, shard, *, dist=None, group=None, async_op=False):
    dist = default_dist(dist)
    world = dist.get_world_size(group)
    work = dist.reduce_scatter(shard, list(flat_grad.chunk(world)), group=group,
                               async_op=async_op)
    shard.div_(world)  # with async_op the reduction may not have landed yet
    return work


@pytest.mark.cluster
def test_reduce_scatter_grads_solution_and_mistakes(c4):
    full("lesson08.reduce_scatter_grads", sharding.reduce_scatter_grads, c4)
    reason_has(less("lesson08.reduce_scatter_grads", sums_not_averages, c4), "not their average")
    reason_has(less("lesson08.reduce_scatter_grads", chunks_reversed, c4), "rank order")
    reason_has(less("lesson08.reduce_scatter_grads", all_reduce_then_slice, c4),
               "all_reduce", "twice the bytes")
    # A race a fast reduction can win; the check's dist lands async results only in wait().
    reason_has(less("lesson08.reduce_scatter_grads", divides_before_waiting, c4),
               "not the average", "before the reduce-scatter landed")


# lesson08.all_gather_params -------------------------------------------------------------------

def gathers_into_new_tensors(flat, shard, layout, *, dist=None, group=None, async_op=False):
    dist = default_dist(dist)
    out = [torch.empty_like(shard) for _ in range(dist.get_world_size(group))]
    return dist.all_gather(out, shard, group=group, async_op=async_op)  # flat never written


def all_reduce_of_the_padded_buffer(flat, shard, layout, *, dist=None, group=None,
                                    async_op=False):
    dist = default_dist(dist)
    mine = torch.zeros_like(flat)
    layout.chunks(mine)[dist.get_rank(group)].copy_(shard)
    dist.all_reduce(mine, group=group)
    flat.copy_(mine)
    return _Done() if async_op else None


def ranks_reversed(flat, shard, layout, *, dist=None, group=None, async_op=False):
    dist = default_dist(dist)
    return dist.all_gather(layout.chunks(flat)[::-1], shard, group=group, async_op=async_op)


def forgets_the_work(flat, shard, layout, *, dist=None, group=None, async_op=False):
    default_dist(dist).all_gather(layout.chunks(flat), shard, group=group)


@pytest.mark.cluster
def test_all_gather_params_solution_and_mistakes(c4):
    full("lesson08.all_gather_params", sharding.all_gather_params, c4)
    reason_has(less("lesson08.all_gather_params", gathers_into_new_tensors, c4), "never written")
    reason_has(less("lesson08.all_gather_params", all_reduce_of_the_padded_buffer, c4),
               "all_reduce")
    reason_has(less("lesson08.all_gather_params", ranks_reversed, c4), "rank order")
    reason_has(less("lesson08.all_gather_params", forgets_the_work, c4), "work")


# lesson08.zero1_step --------------------------------------------------------------------------

def gathers_before_stepping(optimizer, flats, shards, layouts, *, dist=None, group=None):
    for flat, shard, layout in zip(flats, shards, layouts):
        sharding.all_gather_params(flat, shard.detach(), layout, dist=dist, group=group)
    optimizer.step()  # only this rank's shard moves: the ranks disagree on the rest


def all_reduces_the_update(optimizer, flats, shards, layouts, *, dist=None, group=None):
    """Right values, wrong communication: an all_reduce of the whole buffer moves twice as much."""
    dist = default_dist(dist)
    before = [flat.clone() for flat in flats]
    optimizer.step()
    for flat, old in zip(flats, before):
        delta = flat - old
        dist.all_reduce(delta, group=group)
        flat.copy_(old + delta)


def first_bucket_only(optimizer, flats, shards, layouts, *, dist=None, group=None):
    optimizer.step()
    sharding.all_gather_params(flats[0], shards[0].detach(), layouts[0], dist=dist, group=group)


@pytest.mark.cluster
def test_zero1_step_solution_and_mistakes(c4):
    full("lesson08.zero1_step", zero.zero1_step, c4)
    reason_has(less("lesson08.zero1_step", gathers_before_stepping, c4), "before the step")
    reason_has(less("lesson08.zero1_step", all_reduces_the_update, c4), "twice the traffic")
    reason_has(less("lesson08.zero1_step", first_bucket_only, c4), "every bucket")


# lesson08.on_grad_ready -----------------------------------------------------------------------

def _stage_into_bucket(zero_, bucket, p, size=None, add=True):
    if bucket.staging is None:
        bucket.staging = torch.zeros(size or bucket.layout.padded_numel, dtype=bucket.layout.dtype)
    view = bucket.layout.views(bucket.staging)[bucket.index[id(p)]]
    view.add_(p.grad) if add else view.copy_(p.grad)
    p.grad = None


def _launch_in_order(zero_):
    complete = [len(b.ready) == len(b.params) for b in zero_.buckets]
    for i in buckets_to_launch(zero_.next_bucket, complete):
        zero_.launch(zero_.buckets[i])
        zero_.next_bucket = i + 1


def launches_out_of_order(zero_, p):
    """Each bucket as soon as it is complete, whatever the buckets before it."""
    bucket = zero_.bucket_of[id(p)]
    if zero_.stage == 2:
        _stage_into_bucket(zero_, bucket, p)
    bucket.ready.add(id(p))
    if zero_.require_backward_grad_sync and len(bucket.ready) == len(bucket.params):
        zero_.launch(bucket)
        zero_.next_bucket = max(zero_.next_bucket, zero_.buckets.index(bucket) + 1)


def reduces_inside_no_sync(zero_, p):
    """Reduce-scatters before the last micro-batch: no_sync() ignored."""
    bucket = zero_.bucket_of[id(p)]
    if zero_.stage == 2:
        _stage_into_bucket(zero_, bucket, p)
    bucket.ready.add(id(p))
    _launch_in_order(zero_)


def forgets_the_padding(zero_, p):
    """Stage 2's flat gradient sized to the parameters, without the padding's share."""
    bucket = zero_.bucket_of[id(p)]
    if zero_.stage == 2:
        _stage_into_bucket(zero_, bucket, p, size=bucket.layout.numel)
    bucket.ready.add(id(p))
    if zero_.require_backward_grad_sync:
        _launch_in_order(zero_)


def copies_instead_of_adding(zero_, p):
    """Stage 2: each backward overwrites the bucket's gradient: no_sync() loses micro-batches."""
    bucket = zero_.bucket_of[id(p)]
    if zero_.stage == 2:
        _stage_into_bucket(zero_, bucket, p, add=False)
    bucket.ready.add(id(p))
    if zero_.require_backward_grad_sync:
        _launch_in_order(zero_)


def keeps_the_full_gradient(zero_, p):
    """Stage 2 copies the gradient into its bucket but leaves it in p.grad too."""
    bucket = zero_.bucket_of[id(p)]
    if zero_.stage == 2:
        if bucket.staging is None:
            bucket.staging = torch.zeros(bucket.layout.padded_numel, dtype=bucket.layout.dtype)
        bucket.layout.views(bucket.staging)[bucket.index[id(p)]].add_(p.grad)
    bucket.ready.add(id(p))
    if zero_.require_backward_grad_sync:
        _launch_in_order(zero_)


def leaves_it_to_the_end(zero_, p):
    """Marks ready and launches nothing: every bucket waits for the end of backward."""
    bucket = zero_.bucket_of[id(p)]
    if zero_.stage == 2:
        _stage_into_bucket(zero_, bucket, p)
    bucket.ready.add(id(p))


@pytest.mark.cluster
def test_on_grad_ready_solution_and_mistakes(c4):
    full("lesson08.on_grad_ready", zero.on_grad_ready, c4)
    reason_has(less("lesson08.on_grad_ready", launches_out_of_order, c4), "bucket order")
    reason_has(less("lesson08.on_grad_ready", reduces_inside_no_sync, c4), "no_sync()",
               "one per micro-batch")
    reason_has(less("lesson08.on_grad_ready", forgets_the_padding, c4), "padding's share")
    reason_has(less("lesson08.on_grad_ready", copies_instead_of_adding, c4), "micro-batch")
    reason_has(less("lesson08.on_grad_ready", keeps_the_full_gradient, c4), "p.grad")
    reason_has(less("lesson08.on_grad_ready", leaves_it_to_the_end, c4), "only after backward")


# lesson08.finish_backward ---------------------------------------------------------------------

def _finish(zero_, add_in_stage_1=False, add_in_stage_2=True, launch_rest=True,
            respect_no_sync=True, reset=True):
    if respect_no_sync and not zero_.require_backward_grad_sync:
        return
    if launch_rest:
        for bucket in zero_.buckets[zero_.next_bucket:]:
            zero_.launch(bucket)
    for bucket in zero_.buckets:
        bucket.work.wait()
        add = add_in_stage_2 if zero_.stage == 2 else add_in_stage_1
        if add:
            add_grad(bucket.shard, bucket.reduced)
        else:
            bucket.shard.grad = bucket.reduced
        if reset:
            bucket.staging = bucket.reduced = bucket.work = None


def adds_in_stage_1(zero_):
    _finish(zero_, add_in_stage_1=True)


def replaces_in_stage_2(zero_):
    _finish(zero_, add_in_stage_2=False)


def never_launches_the_held_back(zero_):
    _finish(zero_, launch_rest=False)


def finishes_inside_no_sync(zero_):
    _finish(zero_, respect_no_sync=False)


def keeps_the_buckets_state(zero_):
    _finish(zero_, reset=False)


@pytest.mark.cluster
def test_finish_backward_solution_and_mistakes(c4):
    full("lesson08.finish_backward", zero.finish_backward, c4)
    reason_has(less("lesson08.finish_backward", adds_in_stage_1, c4), "stage 1")
    reason_has(less("lesson08.finish_backward", replaces_in_stage_2, c4), "stage 2")
    reason_has(less("lesson08.finish_backward", never_launches_the_held_back, c4),
               "never launched")
    reason_has(less("lesson08.finish_backward", finishes_inside_no_sync, c4), "no_sync()")
    reason_has(less("lesson08.finish_backward", keeps_the_buckets_state, c4), "still hold")


# lesson08.unshard and lesson08.reduce_unit_grad -----------------------------------------------

def gathers_into_full(flat, *, dist=None, group=None, async_op=False):
    """Right values, but written through `full`: its version counter moves, and backward fails
    on the views autograd saved in forward."""
    flat.full.untyped_storage().resize_(flat.nbytes)
    # detach() shares the version counter with `full`
    return sharding.all_gather_params(flat.full.detach(), flat.shard.detach(), flat.layout,
                                      dist=dist, group=group, async_op=async_op)


def own_shard_only(flat, *, dist=None, group=None, async_op=False):
    flat.full.untyped_storage().resize_(flat.nbytes)
    rank = default_dist(dist).get_rank(group)
    flat.layout.chunks(flat.alias)[rank].copy_(flat.shard.detach())
    return None


def keeps_gathered(flat, *, dist=None, group=None):
    grad, flat.full.grad = flat.full.grad, None
    reduced = torch.empty(flat.layout.shard_numel, dtype=flat.layout.dtype)
    work = sharding.reduce_scatter_grads(grad, reduced, dist=dist, group=group, async_op=True)
    return work, reduced, grad  # forgot flat.free(): ZeRO-3 keeps the whole model gathered


def sums_unit_grads(flat, *, dist=None, group=None):
    grad, flat.full.grad = flat.full.grad, None
    reduced = torch.empty(flat.layout.shard_numel, dtype=flat.layout.dtype)
    d = default_dist(dist)
    work = d.reduce_scatter(reduced, list(grad.chunk(d.get_world_size(group))), group=group,
                            async_op=True)
    flat.free()
    return work, reduced, grad


@pytest.mark.cluster
def test_unshard_and_reduce_unit_grad_solution_and_mistakes(c4):
    full("lesson08.unshard", fsdp.unshard, c4)
    reason_has(less("lesson08.unshard", gathers_into_full, c4), "version")
    reason_has(less("lesson08.unshard", own_shard_only, c4), "no all_gather")
    full("lesson08.reduce_unit_grad", fsdp.reduce_unit_grad, c4)
    reason_has(less("lesson08.reduce_unit_grad", keeps_gathered, c4), "not freed")
    reason_has(less("lesson08.reduce_unit_grad", sums_unit_grads, c4), "not their average")


# lesson08.settle ------------------------------------------------------------------------------

def replaces_the_earlier_gradient(schedule, keep=0):
    while len(schedule.pending) > keep:
        flat, work, reduced, _grad = schedule.pending.pop(0)
        work.wait()
        flat.shard.grad = reduced


def newest_first(schedule, keep=0):
    while len(schedule.pending) > keep:
        flat, work, reduced, _grad = schedule.pending.pop()
        work.wait()
        add_grad(flat.shard, reduced)


def reads_before_waiting(schedule, keep=0):
    while len(schedule.pending) > keep:
        flat, work, reduced, _grad = schedule.pending.pop(0)
        add_grad(flat.shard, reduced.clone())
        work.wait()


def one_too_many(schedule, keep=0):
    while len(schedule.pending) >= keep and schedule.pending:
        flat, work, reduced, _grad = schedule.pending.pop(0)
        work.wait()
        add_grad(flat.shard, reduced)


@pytest.mark.cluster
def test_settle_solution_and_mistakes(c4):
    full("lesson08.settle", fsdp.settle, c4)
    reason_has(less("lesson08.settle", replaces_the_earlier_gradient, c4), "replaced")
    reason_has(less("lesson08.settle", newest_first, c4), "oldest finish first")
    reason_has(less("lesson08.settle", reads_before_waiting, c4), "before its work was waited")
    reason_has(less("lesson08.settle", one_too_many, c4), "left in flight")


# lesson08.next_unit ---------------------------------------------------------------------------

def forward_order_in_backward(order, unit, backward):
    """Prefetching in forward order during backward."""
    order = list(order)
    if unit not in order:
        return None
    i = order.index(unit)
    return order[i + 1] if i + 1 < len(order) else None


def reversed_with_the_root_last(order, unit, backward):
    order = list(order)[::-1] if backward else list(order)
    if unit not in order:
        return None
    i = order.index(unit)
    return order[i + 1] if i + 1 < len(order) else None


def test_next_unit_solution_and_mistakes():
    full("lesson08.next_unit", fsdp.next_unit)
    reason_has(less("lesson08.next_unit", forward_order_in_backward), "forward order")
    reason_has(less("lesson08.next_unit", reversed_with_the_root_last), "root's backward")


# lesson08.pre_forward, post_forward, pre_backward ---------------------------------------------

def no_prefetch(unit):
    unit.schedule.running.append(unit)
    for flat in unit.flats:
        flat.wait_gather(unit.dist, unit.group)
        flat.install()


def forgets_the_order(unit):
    for flat in unit.flats:
        flat.wait_gather(unit.dist, unit.group)
        flat.install()
    unit.prefetch(backward=False)


def prefetches_in_backward_order(unit):
    unit.schedule.running.append(unit)
    for flat in unit.flats:
        flat.wait_gather(unit.dist, unit.group)
        flat.install()
    unit.prefetch(backward=True)


def frees_the_root_too(unit, output):
    """Freeing before backward's use: the root's backward comes first."""
    if unit.reshard_after_forward:
        for flat in unit.flats:
            flat.free()


def ignores_reshard_after_forward(unit, output):
    if not unit.is_root:
        for flat in unit.flats:
            flat.free()


def never_frees(unit, output):
    pass


def only_prefetches(unit):
    """No gather again before backward: the unit's backward reads freed parameters."""
    unit.prefetch(backward=True)


def prefetches_in_forward_order(unit):
    """Prefetching in forward order during backward."""
    for flat in unit.flats:
        flat.wait_gather(unit.dist, unit.group)
    unit.prefetch(backward=False)


@pytest.mark.cluster
def test_fsdp_hooks_solution_and_mistakes(c4):
    full("lesson08.pre_forward", fsdp.pre_forward, c4)
    reason_has(less("lesson08.pre_forward", no_prefetch, c4), "had not started")
    reason_has(less("lesson08.pre_forward", forgets_the_order, c4), "had not started")
    reason_has(less("lesson08.pre_forward", prefetches_in_backward_order, c4), "computes next")
    full("lesson08.post_forward", fsdp.post_forward, c4)
    reason_has(less("lesson08.post_forward", frees_the_root_too, c4), "root freed")
    reason_has(less("lesson08.post_forward", ignores_reshard_after_forward, c4),
               "reshard_after_forward=False")
    reason_has(less("lesson08.post_forward", never_frees, c4), "still held")
    full("lesson08.pre_backward", fsdp.pre_backward, c4)
    reason_has(less("lesson08.pre_backward", only_prefetches, c4), "not gathered again")
    reason_has(less("lesson08.pre_backward", prefetches_in_forward_order, c4), "computes next")
