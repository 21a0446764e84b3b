"""Lesson 04's exercises (parts 04a and 04b): the coalesced broadcast, the per-parameter and flat
all_reduce, buckets and their launch order, and the DDP core (launch, hook, end of backward,
with a weight used twice and a gradient that arrives twice); the solutions score full points,
realistic wrong versions less, each with a reason in the lesson's terms (the distributed ones
on 2, 3 and 4 ranks of a 4-rank scratch cluster)."""

from __future__ import annotations

import sys

import cloudpickle
import pytest
import torch

from conftest import full, less
from course_lib.backend import default_dist
from course_lib.data_parallel import (allreduce_grads_flat, broadcast_coalesced,
                                     buckets_to_launch, flatten_into, unflatten_to_grads)
from course_lib.ddp import finish_backward, launch_bucket, on_grad_ready, stage_grad

cloudpickle.register_pickle_by_value(sys.modules[__name__])  # engines cannot import tests/


# lesson04.buckets_to_launch -------------------------------------------------------------------

def every_complete_bucket(next_bucket, complete):
    """Launches in completion order: ranks whose gradients arrive differently would start
    different all_reduces at the same moment (mismatched collectives)."""
    return [i for i in range(next_bucket, len(complete)) if complete[i]]


def from_zero(next_bucket, complete):
    return buckets_to_launch(0, complete)


def test_buckets_to_launch_solution_and_mistakes():
    full("lesson04.buckets_to_launch", buckets_to_launch)
    r = less("lesson04.buckets_to_launch", every_complete_bucket)
    assert "bucket 0 is not complete, yet bucket 1 after it starts" in r.reason, r.reason
    r = less("lesson04.buckets_to_launch", from_zero)
    assert "bucket 0 was launched already" in r.reason, r.reason


def sum_not_average(params, *, dist=None, group=None):
    dist = default_dist(dist)
    flat = torch.cat([p.grad.reshape(-1) for p in params])
    dist.all_reduce(flat, group=group)
    unflatten_to_grads(flat, params)


def never_copied_back(params, *, dist=None, group=None):
    dist = default_dist(dist)
    flat = torch.cat([p.grad.reshape(-1) for p in params])
    dist.all_reduce(flat, group=group)
    flat /= dist.get_world_size(group)


def divide_by_param_count(params, *, dist=None, group=None):
    dist = default_dist(dist)
    flat = torch.empty(sum(p.numel() for p in params))
    flatten_into(flat, [p.grad for p in params])
    dist.all_reduce(flat, group=group)
    unflatten_to_grads(flat / len(params), params)


def per_parameter(params, *, dist=None, group=None):
    """Right averages, wrong communication: one all_reduce per parameter (P latencies)."""
    dist = default_dist(dist)
    for p in params:
        dist.all_reduce(p.grad, group=group)
        p.grad /= dist.get_world_size(group)


@pytest.mark.cluster
def test_flat_all_reduce_solution_and_mistakes(scratch_cluster_4):
    full("lesson04.allreduce_grads_flat", allreduce_grads_flat, scratch_cluster_4)
    for wrong, why in ((sum_not_average, "the sum over the 2 ranks, not their average"),
                       (never_copied_back, ".grad still holds this rank's own gradient"),
                       (divide_by_param_count, "divided by 3, not by the 2 ranks"),
                       (per_parameter, "3 all_reduce calls for 3 parameters: one flat buffer")):
        r = less("lesson04.allreduce_grads_flat", wrong, scratch_cluster_4)
        assert why in r.reason, (wrong.__name__, r.reason)


# lesson04.launch_bucket, on_grad_ready, finish_backward ----------------------------------------
# Each trains the library's DDP with the function swapped in, on the first 2, 3 and 4 ranks.

def blocking_launch(ddp, bucket):
    """Right numbers, wrong communication: the all_reduce blocks the backward pass."""
    launch_bucket_without_return(ddp, bucket)
    return _Done()


class _Done:
    def wait(self):
        return True


def launch_bucket_without_return(ddp, bucket):
    with torch.no_grad():
        for p, view in zip(bucket.params, bucket.views):
            if id(p) not in bucket.ready:
                stage_grad(p.grad, view, ddp.world_size)
        if ddp.find_unused_parameters:
            bucket.flat[bucket.numel:] = torch.tensor(
                [1.0 if id(p) in bucket.ready else 0.0 for p in bucket.params])
    ddp.dist.all_reduce(bucket.flat, group=ddp.group)


def one_all_reduce_per_parameter(ddp, bucket):
    """Averages right, but one message per parameter; returns only the last one's work."""
    with torch.no_grad():
        for p, view in zip(bucket.params, bucket.views):
            if id(p) not in bucket.ready:
                stage_grad(p.grad, view, ddp.world_size)
    works = [ddp.dist.all_reduce(v, group=ddp.group, async_op=True) for v in bucket.views]
    return works[-1]


def flags_left_out(ddp, bucket):
    """Reduces only the gradients: with find_unused_parameters nobody learns who used what."""
    with torch.no_grad():
        for p, view in zip(bucket.params, bucket.views):
            if id(p) not in bucket.ready:
                stage_grad(p.grad, view, ddp.world_size)
    return ddp.dist.all_reduce(bucket.flat[:bucket.numel], group=ddp.group, async_op=True)


def stale_slice_for_unused(ddp, bucket):
    """Never stages a parameter that got no gradient: its slice still holds the last step's."""
    if ddp.find_unused_parameters:
        bucket.flat[bucket.numel:] = torch.tensor(
            [1.0 if id(p) in bucket.ready else 0.0 for p in bucket.params])
    return ddp.dist.all_reduce(bucket.flat, group=ddp.group, async_op=True)


@pytest.mark.cluster
def test_launch_bucket_solution_and_mistakes(scratch_cluster_4):
    full("lesson04.launch_bucket", launch_bucket, scratch_cluster_4)
    for wrong, why in ((launch_bucket_without_return, "must return the Work of its asynchronous"),
                       (one_all_reduce_per_parameter, "one collective per bucket"),
                       (flags_left_out, "the gradients and the flag slots travel in one message"),
                       (stale_slice_for_unused, "step 1: spare's averaged gradient is wrong"),
                       (blocking_launch, "blocking")):  # right numbers, not async
        r = less("lesson04.launch_bucket", wrong, scratch_cluster_4)
        assert why in r.reason, (wrong.__name__, r.reason)


def _start(ddp, p):
    if not ddp.in_backward:
        ddp.in_backward = True
        torch.autograd.Variable._execution_engine.queue_callback(ddp.end_of_backward)
    bucket = ddp.bucket_of[id(p)]
    bucket.ready.add(id(p))
    return bucket


def launch_when_complete(ddp, p):
    """Launches each bucket the moment it completes: out of bucket order when gradients arrive
    out of order (here the last bucket completes first), so ranks could pair the wrong ones."""
    bucket = _start(ddp, p)
    view = ddp.view_of[id(p)]
    with torch.no_grad():
        stage_grad(p.grad, view, ddp.world_size)
    p.grad = view
    if len(bucket.ready) == len(bucket.params):
        ddp.launch(bucket)
        ddp.next_bucket = max(ddp.next_bucket, ddp.buckets.index(bucket) + 1)


def summed_not_averaged(ddp, p):
    _start(ddp, p)
    view = ddp.view_of[id(p)]
    with torch.no_grad():
        view.copy_(p.grad)
    p.grad = view
    complete = [len(b.ready) == len(b.params) for b in ddp.buckets]
    for i in buckets_to_launch(ddp.next_bucket, complete):
        ddp.launch(ddp.buckets[i])
        ddp.next_bucket = i + 1


def never_launches_from_hooks(ddp, p):
    """Stages every gradient but leaves all buckets to the end of backward: no overlap."""
    _start(ddp, p)
    view = ddp.view_of[id(p)]
    with torch.no_grad():
        stage_grad(p.grad, view, ddp.world_size)
    p.grad = view


def no_callback(ddp, p):
    """Forgets to queue the end of backward (here: the solution, told backward had begun):
    nobody waits, the averages never land."""
    ddp.in_backward = True
    on_grad_ready(ddp, p)


def takes_a_second_arrival(ddp, p):
    """Right for every gradient that arrives once, but a parameter whose gradient arrives twice
    in one backward (two reentrant checkpoints) is staged again, and backward goes on: its
    bucket leaves with a gradient that is not torch's, and nobody is told."""
    bucket = _start(ddp, p)
    view = ddp.view_of[id(p)]
    with torch.no_grad():
        stage_grad(p.grad, view, ddp.grad_divisor)
    p.grad = view
    complete = [len(b.ready) == len(b.params) for b in ddp.buckets]
    for i in buckets_to_launch(ddp.next_bucket, complete):
        ddp.launch(ddp.buckets[i])
        ddp.next_bucket = i + 1


def counts_arrivals(ddp, p):
    """Counts the hook's calls per bucket instead of its parameters: a gradient that arrives
    twice counts as two ready gradients, so its bucket launches before another parameter's
    gradient is in it."""
    if not ddp.in_backward:
        ddp.arrivals = [0] * len(ddp.buckets)
    bucket = _start(ddp, p)
    ddp.arrivals[ddp.buckets.index(bucket)] += 1
    view = ddp.view_of[id(p)]
    with torch.no_grad():
        stage_grad(p.grad, view, ddp.grad_divisor)
    p.grad = view
    complete = [n >= len(b.params) for n, b in zip(ddp.arrivals, ddp.buckets)]
    for i in buckets_to_launch(ddp.next_bucket, complete):
        ddp.launch(ddp.buckets[i])
        ddp.next_bucket = i + 1


@pytest.mark.cluster
def test_on_grad_ready_solution_and_mistakes(scratch_cluster_4):
    full("lesson04.on_grad_ready", on_grad_ready, scratch_cluster_4)
    for wrong, why in ((launch_when_complete, "buckets launched in the order [2, 0, 1]"),
                       (summed_not_averaged, "the sum over the 2 ranks, not their average"),
                       (never_launches_from_hooks, "only after backward")):  # no overlap
        r = less("lesson04.on_grad_ready", wrong, scratch_cluster_4)
        assert why in r.reason, (wrong.__name__, r.reason)
    # Nobody waits: the next forward says so (and a rank whose buckets all went out waits in
    # vain for the others: the check stops there).
    r = less("lesson04.on_grad_ready", no_callback, scratch_cluster_4, time_limit=4)  # it hangs
    assert "the previous backward did not finish" in r.cases[0].rows[0].note, r.cases[0]


@pytest.mark.cluster
def test_on_grad_ready_a_gradient_that_arrives_twice(scratch_cluster_4):
    """A weight used twice in one forward gets one hook call (autograd sums both uses first),
    and the solution passes it; in two reentrant checkpoints its gradient arrives twice, and a
    hook that takes the second arrival, or counts it as a second ready gradient, scores less,
    on the cases of 2 and 4 ranks, and says why."""
    r = full("lesson04.on_grad_ready", on_grad_ready, scratch_cluster_4)
    assert any("used twice in the forward" in c.label for c in r.cases)
    for wrong, why in ((takes_a_second_arrival, "bucket 0 went out with a gradient that is not"),
                       (counts_arrivals, "counted as two ready gradients: bucket 0 was launched "
                                         "before inp.bias, inp.weight arrived")):
        r = less("lesson04.on_grad_ready", wrong, scratch_cluster_4)
        failed = [c.label for c in r.cases if not c.passed]
        twice = "mid in two reentrant checkpoints: its gradient arrives twice"
        assert failed == [f"2 ranks, {twice}", f"4 ranks, {twice}"], (wrong.__name__, failed)
        assert why in r.reason, (wrong.__name__, r.reason)
        assert r.points == 3 * 6 / 8, r


def _launch_rest(ddp):
    for b in ddp.buckets[ddp.next_bucket:]:
        ddp.launch(b)
    ddp.next_bucket = len(ddp.buckets)


def no_wait(ddp):
    """Writes the views back without waiting: the sums have not landed yet."""
    _launch_rest(ddp)
    for b in ddp.buckets:
        for p, view in zip(b.params, b.views):
            p.grad = view


def ignores_flags(ddp):
    """Gives every parameter its slice, even one no rank used (torch keeps its .grad)."""
    _launch_rest(ddp)
    for b in ddp.buckets:
        b.work.wait()
        for p, view in zip(b.params, b.views):
            p.grad = view


def silent_about_unused(ddp):
    """Never raises for a parameter that got no gradient without find_unused_parameters."""
    _launch_rest(ddp)
    for b in ddp.buckets:
        b.work.wait()
        users = b.flat[b.numel:].tolist() if ddp.find_unused_parameters else [1] * len(b.params)
        for p, view, n in zip(b.params, b.views, users):
            if n > 0:
                p.grad = view


def only_first_rank_users(ddp):
    """Keeps a slice only if every rank used the parameter (count == world size)."""
    _launch_rest(ddp)
    for b in ddp.buckets:
        b.work.wait()
        users = (b.flat[b.numel:].tolist() if ddp.find_unused_parameters
                 else [ddp.world_size] * len(b.params))
        for p, view, n in zip(b.params, b.views, users):
            if n == ddp.world_size:
                p.grad = view


@pytest.mark.cluster
def test_finish_backward_solution_and_mistakes(scratch_cluster_4):
    full("lesson04.finish_backward", finish_backward, scratch_cluster_4)
    for wrong, why in ((no_wait, "the all_reduce's sum had not landed"),
                       (ignores_flags, "no rank used spare, yet it got a gradient"),
                       (silent_about_unused, "backward must stop with an error that names"),
                       (only_first_rank_users, "spare was used on rank 0 only")):
        r = less("lesson04.finish_backward", wrong, scratch_cluster_4)
        assert why in r.reason, (wrong.__name__, r.reason)


# lesson04.make_buckets ------------------------------------------------------------------------

def _buckets(params, cap_mb, first_mb, *, order=reversed, close_before=False, dtypes=True,
             first=True):
    """make_buckets with one mistake switched on (see the wrong versions below)."""
    cap = (first_mb if first and first_mb is not None else cap_mb) * 2**20
    buckets, current, size = [], [], 0
    for p in order(list(params)):
        nbytes = p.numel() * p.element_size()
        if current and ((dtypes and p.dtype != current[0].dtype)
                        or (close_before and size + nbytes > cap)):
            buckets.append(current)
            current, size, cap = [], 0, cap_mb * 2**20
        current.append(p)
        size += nbytes
        if size >= cap:
            buckets.append(current)
            current, size, cap = [], 0, cap_mb * 2**20
    return buckets + ([current] if current else [])


def forward_order(params, cap_mb, first_mb):
    """Registration order: the first bucket holds the first layer, ready last in backward."""
    return _buckets(params, cap_mb, first_mb, order=list)


def closes_before_reaching(params, cap_mb, first_mb):
    """Never exceeds the cap (torch's buckets do): different buckets, and too many of them."""
    return _buckets(params, cap_mb, first_mb, close_before=True)


def mixes_dtypes(params, cap_mb, first_mb):
    return _buckets(params, cap_mb, first_mb, dtypes=False)


def no_small_first_bucket(params, cap_mb, first_mb):
    return _buckets(params, cap_mb, first_mb, first=False)


def test_make_buckets_solution_and_mistakes():
    from course_lib.data_parallel import make_buckets

    full("lesson04.make_buckets", make_buckets)
    for wrong, why in ((forward_order, "not in reverse order"),
                       (closes_before_reaching, "before reaching its cap"),
                       (mixes_dtypes, "mixes dtypes"),
                       (no_small_first_bucket, "the first bucket's cap is first_bucket_cap_mb")):
        r = less("lesson04.make_buckets", wrong)
        assert why in r.reason, (wrong.__name__, r.reason)


# lesson04.broadcast_coalesced -----------------------------------------------------------------

def one_broadcast_per_tensor(tensors, src, *, dist=None, group=None):
    """Right values, but a message (and its latency) per tensor."""
    for t in tensors:
        dist.broadcast(t, src, group=group)


def always_from_rank_zero(tensors, src, *, dist=None, group=None):
    broadcast_coalesced(tensors, 0, dist=dist, group=group)


def one_float_buffer(tensors, src, *, dist=None, group=None):
    """Everything through one float64 buffer: one message, but it casts every dtype."""
    flat = torch.cat([t.reshape(-1).double() for t in tensors])
    dist.broadcast(flat, src, group=group)
    offset = 0
    for t in tensors:
        t.copy_(flat[offset:offset + t.numel()].view_as(t).to(t.dtype) + 0.5)  # a cast rounds
        offset += t.numel()


@pytest.mark.cluster
def test_broadcast_coalesced_solution_and_mistakes(scratch_cluster_4):
    full("lesson04.broadcast_coalesced", broadcast_coalesced, scratch_cluster_4)
    for wrong, why in ((one_broadcast_per_tensor, "one message per dtype, not per tensor"),
                       (always_from_rank_zero, "this rank kept its own tensors: rank 2's never"),
                       (one_float_buffer, "values that are no rank's")):
        r = less("lesson04.broadcast_coalesced", wrong, scratch_cluster_4)
        assert why in r.reason, (wrong.__name__, r.reason)


# lesson04.allreduce_grads_per_param -----------------------------------------------------------

@pytest.mark.cluster
def test_per_param_solution_and_mistakes(scratch_cluster_4):
    from course_lib.data_parallel import allreduce_grads_per_param

    full("lesson04.allreduce_grads_per_param", allreduce_grads_per_param, scratch_cluster_4)
    r = less("lesson04.allreduce_grads_per_param", sum_not_average, scratch_cluster_4)
    assert "the sum over the 2 ranks" in r.reason, r.reason
    r = less("lesson04.allreduce_grads_per_param", allreduce_grads_flat, scratch_cluster_4)
    assert "reduces each parameter on its own" in r.reason, r.reason  # not what this step asks
