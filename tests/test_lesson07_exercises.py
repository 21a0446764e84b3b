"""Lesson 07's exercises (07a, 07b, 07c, 07d): the solutions score full points, realistic wrong
versions less, each with a reason in the lesson's terms (the distributed ones on 2, 3 and 4 ranks of a
4-rank scratch cluster, a stage per rank)."""

from __future__ import annotations

import sys

import cloudpickle
import pytest
import torch

from conftest import full, less
from course_lib.course.grading.learner import grade_function
from course_lib.pipeline import (ACTIVATION_TAG, GRADIENT_TAG, HEADER_LEN, backward_step,
                                 bubble_fractions, forward_step, gpipe_order, make_header,
                                 one_f_one_b_order, partition, pipeline_grads, stage_recv,
                                 stage_send)

cloudpickle.register_pickle_by_value(sys.modules[__name__])  # engines cannot import tests/


def notes(result) -> str:
    """Every failing row's note of a check, one per line."""
    return "\n".join(row.note for case in result.cases for row in case.rows if not row.passed)


# 07a: lesson07.bubble_fractions -----------------------------------------------------------------

def bubble_own_span(events):
    """Each stage's own first-to-last span: a stage that starts late looks busy."""
    if not events:
        raise ValueError("no events")
    out = {}
    for r in sorted({e.rank for e in events}):
        mine = [e for e in events if e.rank == r]
        span = max(e.end for e in mine) - min(e.start for e in mine)
        out[r] = 1 - sum(e.end - e.start for e in mine) / span
    return out


def bubble_of_the_whole(events):
    """One number for all stages, the mean idle share, given to every stage."""
    if not events:
        raise ValueError("no events")
    span = max(e.end for e in events) - min(e.start for e in events)
    ranks = sorted({e.rank for e in events})
    mean = 1 - sum(e.end - e.start for e in events) / (span * len(ranks))
    return {r: mean for r in ranks}


def bubble_busy_share(events):
    """The busy share instead of the idle one."""
    return {r: 1 - f for r, f in bubble_fractions(events).items()}


def test_bubble_fractions_solution_and_mistakes():
    full("lesson07.bubble_fractions", bubble_fractions)
    r = less("lesson07.bubble_fractions", bubble_own_span)
    assert "its own first start" in r.reason, r.reason
    r = less("lesson07.bubble_fractions", bubble_of_the_whole)
    assert "one number for every stage" in r.reason, r.reason
    r = less("lesson07.bubble_fractions", bubble_busy_share)
    assert "busy shares" in r.reason, r.reason


# 07a: lesson07.partition ------------------------------------------------------------------------

def greedy_to_average(costs, n_stages):
    """Fills each stage until it passes the average: not optimal, and may leave stages empty."""
    if n_stages > len(costs):
        raise ValueError("more stages than layers")
    target, ranges, start, acc = sum(costs) / n_stages, [], 0, 0.0
    for i, c in enumerate(costs):
        acc += c
        if acc >= target and len(ranges) < n_stages - 1:
            ranges.append(range(start, i + 1))
            start, acc = i + 1, 0.0
    return ranges + [range(start, len(costs))]


def equal_layer_counts(costs, n_stages):
    """The same number of layers per stage, whatever they cost."""
    if n_stages > len(costs):
        raise ValueError("more stages than layers")
    bounds = [round(k * len(costs) / n_stages) for k in range(n_stages + 1)]
    return [range(a, b) for a, b in zip(bounds, bounds[1:])]


def no_error_for_too_many_stages(costs, n_stages):
    return partition(costs, min(n_stages, len(costs)))


def test_partition_solution_and_mistakes():
    full("lesson07.partition", partition)
    r = less("lesson07.partition", greedy_to_average)
    assert "largest stage costs" in r.reason or "not a split" in r.reason, r.reason
    r = less("lesson07.partition", equal_layer_counts)
    assert "largest stage costs" in r.reason, r.reason
    r = less("lesson07.partition", no_error_for_too_many_stages)
    assert "ValueError" in r.reason, r.reason


# 07a: lesson07.pipeline_grads -------------------------------------------------------------------

def _forward_all(stages, x, target, loss_fn, m, scale):
    acts = [[] for _ in stages]
    losses = []
    for xb, yb in zip(x.chunk(m), target.chunk(m)):
        h = xb
        for s, stage in enumerate(stages):
            inp = h.detach().requires_grad_()
            h = stage(inp)
            acts[s].append((inp, h))
        losses.append(loss_fn(h, yb) / (m if scale else 1))
    return acts, losses


def pipeline_unscaled(stages, x, target, loss_fn, n_microbatches):
    """Forgets to divide each micro-batch's loss by m."""
    acts, losses = _forward_all(stages, x, target, loss_fn, n_microbatches, scale=False)
    for i, loss in enumerate(losses):
        loss.backward()
        for s in range(len(stages) - 2, -1, -1):
            acts[s][i][1].backward(acts[s + 1][i][0].grad)


def pipeline_lifo(stages, x, target, loss_fn, n_microbatches):
    """Earlier stages pop their stored activations last-in-first-out while gradients arrive
    in micro-batch order: the order mismatch."""
    acts, losses = _forward_all(stages, x, target, loss_fn, n_microbatches, scale=True)
    for i, loss in enumerate(losses):
        loss.backward()
        grad = acts[-1][i][0].grad
        for s in range(len(stages) - 2, -1, -1):
            inp, out = acts[s].pop()
            out.backward(grad)
            grad = inp.grad


def pipeline_last_stage_only(stages, x, target, loss_fn, n_microbatches):
    """Backward from each loss only: the inputs were detached, so only the last stage learns."""
    _acts, losses = _forward_all(stages, x, target, loss_fn, n_microbatches, scale=True)
    for loss in losses:
        loss.backward()


def test_pipeline_grads_solution_and_mistakes():
    full("lesson07.pipeline_grads", pipeline_grads)
    r = less("lesson07.pipeline_grads", pipeline_unscaled)
    assert "times the batch's" in r.reason, r.reason
    r = less("lesson07.pipeline_grads", pipeline_lifo)
    assert "own activations" in r.reason, r.reason
    r = less("lesson07.pipeline_grads", pipeline_last_stage_only)
    assert "got no gradient" in r.reason, r.reason


# 07b: lesson07.stage_send and stage_recv --------------------------------------------------------

def send_microbatch_zero(stage, tensor, dst, tag, microbatch):
    """Labels every message micro-batch 0: the receiver's check names the mismatch."""
    stage_send(stage, tensor, dst, tag, 0)


def send_as_float32(stage, tensor, dst, tag, microbatch):
    """Casts to float32 on the way: the float64 model's gradients lose precision."""
    stage_send(stage, tensor.float(), dst, tag, microbatch)


def send_without_header(stage, tensor, dst, tag, microbatch):
    """Sends the bare tensor: the receiver reads it as a header."""
    t = tensor.detach().contiguous()
    stage.track_send(stage.dist.isend(t, dst, group=stage.group, tag=tag), t, dst, "isend")


def recv_ignores_posted(stage, src, tag, microbatch):
    """Never collects what irecv posted: that receive swallows the next message and this one
    waits for a header that never comes (cut off by the time limit)."""
    stage.take_posted(src, tag)
    header = torch.empty(HEADER_LEN, dtype=torch.int64)
    stage.dist.recv(header, src, group=stage.group, tag=tag)
    ndim = int(header[2])
    tensor = torch.empty([int(v) for v in header[3:3 + ndim]], dtype=torch.float64)
    stage.dist.recv(tensor, src, group=stage.group, tag=tag)
    return tensor


def recv_always_float32(stage, src, tag, microbatch):
    """Allocates float64 whatever the header says, and hands back float32."""
    posted = stage.take_posted(src, tag)
    if posted is not None:
        for work in posted.works:
            work.wait()
        return posted.tensor.float()
    header = torch.empty(HEADER_LEN, dtype=torch.int64)
    stage.dist.recv(header, src, group=stage.group, tag=tag)
    ndim = int(header[2])
    tensor = torch.empty([int(v) for v in header[3:3 + ndim]], dtype=torch.float64)
    stage.dist.recv(tensor, src, group=stage.group, tag=tag)
    return tensor.float()


def recv_unchecked(stage, src, tag, microbatch):
    """Right tensors, but never looks at the header's micro-batch."""
    posted = stage.take_posted(src, tag)
    if posted is not None:
        for work in posted.works:
            work.wait()
        return posted.tensor
    header = torch.empty(HEADER_LEN, dtype=torch.int64)
    stage.dist.recv(header, src, group=stage.group, tag=tag)
    from course_lib.pipeline import DTYPES
    ndim = int(header[2])
    tensor = torch.empty([int(v) for v in header[3:3 + ndim]], dtype=DTYPES[int(header[0])])
    stage.dist.recv(tensor, src, group=stage.group, tag=tag)
    return tensor


def recv_stub(stage, src, tag, microbatch):
    raise NotImplementedError


@pytest.mark.cluster
def test_stage_send_and_recv_solutions_and_mistakes(scratch_cluster_4):
    c = scratch_cluster_4
    stub = grade_function("lesson07.stage_recv", recv_stub, c)
    assert stub.points == 0 and stub.not_implemented, stub
    assert make_header(torch.zeros(2, 3), 5).tolist()[:5] == [0, 5, 2, 2, 3]
    full("lesson07.stage_send", stage_send, c)
    full("lesson07.stage_recv", stage_recv, c)
    r = less("lesson07.stage_send", send_microbatch_zero, c)
    assert "its micro-batch differs" in r.reason, r.reason
    r = less("lesson07.stage_send", send_as_float32, c)
    assert "float32" in r.reason, r.reason  # received into a buffer of the dtype sent
    less("lesson07.stage_send", send_without_header, c)
    less("lesson07.stage_recv", recv_ignores_posted, c)
    r = less("lesson07.stage_recv", recv_always_float32, c)
    assert "float32" in r.reason, r.reason  # the next receive, posted like it, is refused
    r = less("lesson07.stage_recv", recv_unchecked, c)
    assert "out of step must be an error" in r.reason, r.reason


# 07c: lesson07.forward_step and backward_step ---------------------------------------------------

def _input_of(sched, mb):
    st = sched.stage
    if st.is_first:
        return [a[mb] for a in sched.inputs]
    x = [st.recv(st.prev, ACTIVATION_TAG, mb).requires_grad_()]
    if mb + 1 < sched.n_microbatches:
        st.irecv(st.prev, ACTIVATION_TAG, mb + 1, like=x[0])
    return x


def forward_unscaled(sched, mb):
    """Forgets the 1/m: every gradient is m times too large."""
    st = sched.stage
    x = _input_of(sched, mb)
    with sched.measure("F", mb):
        out = st.submodule(*x)
        loss = sched.loss_fn(out, sched.targets[mb]) if st.is_last else None
    if st.is_last:
        sched.stash[mb] = (x[0], loss)
        sched.outputs.append(out.detach())
        sched.losses.append(loss.detach())
    else:
        sched.stash[mb] = (x[0], out)
        st.send(out, st.next, ACTIVATION_TAG, mb)


def forward_detaches_the_stash(sched, mb):
    """Stashes a detached output: backward on it reaches no parameter of this stage."""
    st = sched.stage
    x = _input_of(sched, mb)
    with sched.measure("F", mb):
        out = st.submodule(*x)
        if st.is_last:
            loss = sched.loss_fn(out, sched.targets[mb])
            scaled = loss / sched.n_microbatches
    if st.is_last:
        sched.stash[mb] = (x[0], scaled)
        sched.outputs.append(out.detach())
        sched.losses.append(loss.detach())
    else:
        sched.stash[mb] = (x[0], out.detach().requires_grad_())
        st.send(out, st.next, ACTIVATION_TAG, mb)


def forward_sends_without_header(sched, mb):
    """Sends the bare activation, no header: the next stage's recv matches it to the header's
    buffer and then waits for a tensor that never comes (cut off by the time limit)."""
    st = sched.stage
    x = _input_of(sched, mb)
    with sched.measure("F", mb):
        out = st.submodule(*x)
        if st.is_last:
            loss = sched.loss_fn(out, sched.targets[mb])
    if st.is_last:
        sched.stash[mb] = (x[0], loss / sched.n_microbatches)
        sched.outputs.append(out.detach())
        sched.losses.append(loss.detach())
    else:
        sched.stash[mb] = (x[0], out)
        st.dist.isend(out.detach().contiguous(), st.next, group=st.group, tag=ACTIVATION_TAG)


@pytest.mark.cluster
def test_forward_step_solution_and_mistakes(scratch_cluster_4):
    full("lesson07.forward_step", forward_step, scratch_cluster_4)
    r = less("lesson07.forward_step", forward_unscaled, scratch_cluster_4)
    assert "times the batch's" in r.reason, r.reason
    r = less("lesson07.forward_step", forward_detaches_the_stash, scratch_cluster_4)
    assert "stage 0's parameters got no gradient" in notes(r), notes(r)
    less("lesson07.forward_step", forward_sends_without_header, scratch_cluster_4)


def backward_without_the_gradient(sched, mb):
    """Backward from the output as if it were a loss (sum): ignores what the next stage sent."""
    st = sched.stage
    x, out = sched.stash.pop(mb)
    if not st.is_last:
        st.recv(st.next, GRADIENT_TAG, mb)
    with sched.measure("B", mb):
        (out if st.is_last else out.sum()).backward()
    if not st.is_first:
        st.send(x.grad, st.prev, GRADIENT_TAG, mb)


def backward_newest_first(sched, mb):
    """Pops the newest stash instead of micro-batch mb's: under 1F1B a gradient meets another
    micro-batch's activations."""
    st = sched.stage
    newest = max(sched.stash)
    x, out = sched.stash.pop(newest)
    grad = None
    if not st.is_last:
        grad = st.recv(st.next, GRADIENT_TAG, mb)
    with sched.measure("B", mb):
        torch.autograd.backward(out, grad)
    if not st.is_first:
        st.send(x.grad, st.prev, GRADIENT_TAG, newest)


def backward_gradient_every_time(sched, mb):
    """Right gradients, but sends one message more on the last micro-batch."""
    backward_step(sched, mb)
    st = sched.stage
    if not st.is_first and mb == sched.n_microbatches - 1:
        st.send(torch.zeros(1), st.prev, GRADIENT_TAG + 10, mb)


@pytest.mark.cluster
def test_backward_step_solution_and_mistakes(scratch_cluster_4):
    full("lesson07.backward_step", backward_step, scratch_cluster_4)
    r = less("lesson07.backward_step", backward_without_the_gradient, scratch_cluster_4)
    assert "gradients" in r.reason, r.reason
    r = less("lesson07.backward_step", backward_newest_first, scratch_cluster_4)
    assert "own activations" in r.reason or "micro-batch" in r.reason, r.reason
    r = less("lesson07.backward_step", backward_gradient_every_time, scratch_cluster_4)
    assert "messages" in r.reason, r.reason  # right gradients, an extra message


# 07c: lesson07.gpipe_order and one_f_one_b_order ------------------------------------------------

def gpipe_reversed_backward(n_microbatches, num_stages, stage_index):
    m = n_microbatches
    return [("F", i) for i in range(m)] + [("B", i) for i in reversed(range(m))]


def one_f_one_b_off_by_one(n_microbatches, num_stages, stage_index):
    m = n_microbatches
    warmup = min(num_stages - stage_index, m)
    actions = [("F", i) for i in range(warmup)]
    for i in range(m - warmup):
        actions += [("F", warmup + i), ("B", i)]
    return actions + [("B", i) for i in range(m - warmup, m)]


def one_f_one_b_uncapped_warmup(n_microbatches, num_stages, stage_index):
    m = n_microbatches
    warmup = num_stages - 1 - stage_index
    actions = [("F", i) for i in range(warmup)]
    for i in range(m - warmup):
        actions += [("F", warmup + i), ("B", i)]
    return actions + [("B", i) for i in range(max(m - warmup, 0), m)]


def one_f_one_b_backward_first(n_microbatches, num_stages, stage_index):
    """Alternates B before F in the steady state: B of a micro-batch before its own F."""
    m = n_microbatches
    warmup = min(num_stages - 1 - stage_index, m)
    actions = [("F", i) for i in range(warmup)]
    for i in range(m - warmup):
        actions += [("B", i), ("F", warmup + i)]
    return actions + [("B", i) for i in range(m - warmup, m)]


def test_order_solutions_and_mistakes():
    full("lesson07.gpipe_order", gpipe_order)
    r = less("lesson07.gpipe_order", gpipe_reversed_backward)
    assert "same order" in r.reason, r.reason
    r = less("lesson07.gpipe_order", one_f_one_b_order)
    assert "micro-batches of activations stored" in r.reason, r.reason
    full("lesson07.one_f_one_b_order", one_f_one_b_order)
    r = less("lesson07.one_f_one_b_order", one_f_one_b_off_by_one)
    assert "micro-batches of activations stored on stage" in r.reason, r.reason
    r = less("lesson07.one_f_one_b_order", one_f_one_b_uncapped_warmup)
    assert "not F or B of micro-batches 0 to 1" in r.reason, r.reason
    r = less("lesson07.one_f_one_b_order", gpipe_order)
    assert "micro-batches of activations stored on stage" in r.reason, r.reason
    r = less("lesson07.one_f_one_b_order", one_f_one_b_backward_first)
    assert "stage 1 runs B of micro-batch 0 before its F" in notes(r), notes(r)


# 07d: lesson07.interleaved_order -----------------------------------------------------------------

def _groups(m, p):
    rounds = max(m // p, 1)
    bounds = [r * (m // rounds) + min(r, m % rounds) for r in range(rounds + 1)]
    return [range(a, b) for a, b in zip(bounds, bounds[1:])]


def _interleaved(m, p, s, v, groups, forward_chunks, backward_chunks, warmup):
    from course_lib.pipeline_actions import Action, interleave

    fwd = [Action("F", j, k * p + s) for g in groups for k in forward_chunks for j in g]
    bwd = [Action("B", j, k * p + s) for g in groups for k in backward_chunks for j in g]
    return interleave(fwd, bwd, min(warmup, len(fwd)))


def order_forward_chunks_reversed(n_microbatches, num_stages, stage_index, chunks_per_stage=2):
    """A group's forwards through the stage's chunks last first."""
    m, p, s, v = n_microbatches, num_stages, stage_index, chunks_per_stage
    g = _groups(m, p)
    return _interleaved(m, p, s, v, g, list(reversed(range(v))), list(reversed(range(v))),
                        (v - 1) * len(g[0]) + 2 * (p - 1 - s))


def order_backward_in_model_order(n_microbatches, num_stages, stage_index, chunks_per_stage=2):
    """The backwards through the chunks in model order, as the forwards."""
    m, p, s, v = n_microbatches, num_stages, stage_index, chunks_per_stage
    g = _groups(m, p)
    return _interleaved(m, p, s, v, g, range(v), range(v), (v - 1) * len(g[0]) + 2 * (p - 1 - s))


def order_1f1b_warmup(n_microbatches, num_stages, stage_index, chunks_per_stage=2):
    """1F1B's warm-up (p - 1 - s forwards), too short for v chunks."""
    m, p, s, v = n_microbatches, num_stages, stage_index, chunks_per_stage
    return _interleaved(m, p, s, v, _groups(m, p), range(v), list(reversed(range(v))), p - 1 - s)


def order_groups_of_p(n_microbatches, num_stages, stage_index, chunks_per_stage=2):
    """Groups of exactly p micro-batches, the remainder a small last group (Megatron's)."""
    m, p, s, v = n_microbatches, num_stages, stage_index, chunks_per_stage
    g = [range(a, min(a + p, m)) for a in range(0, m, p)]
    return _interleaved(m, p, s, v, g, range(v), list(reversed(range(v))),
                        (v - 1) * len(g[0]) + 2 * (p - 1 - s))


def test_interleaved_order_solution_and_mistakes():
    from course_lib.pipeline_schedules import interleaved_order

    full("lesson07.interleaved_order", interleaved_order)
    r = less("lesson07.interleaved_order", order_forward_chunks_reversed)
    assert r.points == 0 and "waits on itself" in notes(r), notes(r)
    r = less("lesson07.interleaved_order", order_backward_in_model_order)
    assert "waits on itself" in notes(r), notes(r)
    r = less("lesson07.interleaved_order", order_1f1b_warmup)
    assert "comes before" in notes(r), notes(r)
    r = less("lesson07.interleaved_order", order_groups_of_p)  # right where p divides m
    assert r.points > 0 and "idle" in notes(r), notes(r)


def test_interleaved_gold_lists_are_the_solutions():
    from course_lib.course.grading.references.lesson07.beyond import GOLD
    from course_lib.pipeline_schedules import interleaved_order

    for key, actions in GOLD.items():
        m, p, s = map(int, key.split(","))
        assert [list(a) for a in interleaved_order(m, p, s, 2)] == actions, key


# 07d: lesson07.backward_input and backward_weight ----------------------------------------------

def b_does_everything(segments, grad_output):
    """B runs the whole backward, weights too, before its gradient leaves."""
    from course_lib.pipeline_actions import has_weights

    grad = grad_output
    for seg in reversed(segments):
        params = list(seg.layer.parameters()) if has_weights(seg) else []
        if not seg.inp.requires_grad:
            torch.autograd.backward(seg.out, grad, inputs=params)
            return None
        torch.autograd.backward(seg.out, grad, inputs=[seg.inp] + params)
        grad = seg.inp.grad
    return grad


def w_does_nothing(segments):
    """Nothing left to do: B did it."""


def b_frees_the_graph(segments, grad_output):
    """The input gradient without keeping the graph: W finds it gone."""
    from course_lib.pipeline_actions import has_weights

    grad = grad_output
    for seg in reversed(segments):
        if has_weights(seg):
            seg.grad_out.append(grad)
        if not seg.inp.requires_grad:
            return None
        (grad,) = torch.autograd.grad(seg.out, seg.inp, grad)
    return grad


def w_recomputes_the_forward(segments):
    """W runs each layer's forward again and backward through it."""
    from course_lib.pipeline_actions import has_weights

    for seg in segments:
        if has_weights(seg):
            torch.autograd.backward(seg.layer(seg.inp.detach()), seg.grad_out.pop())


@pytest.mark.cluster
def test_backward_split_solutions_and_mistakes(scratch_cluster_4):
    from course_lib.pipeline_schedules import backward_input, backward_weight

    c = scratch_cluster_4
    full("lesson07.backward_input", backward_input, c)
    full("lesson07.backward_weight", backward_weight, c)
    r = less("lesson07.backward_input", b_does_everything, c)
    assert r.points == 0 and "inside B, before its input gradient left" in r.reason, r.reason
    r = less("lesson07.backward_input", b_frees_the_graph, c, time_limit=2.0)
    assert r.points == 0 and "RuntimeError" in notes(r) + r.reason, (r.reason, notes(r))
    r = less("lesson07.backward_weight", w_recomputes_the_forward, c)
    assert "layer forwards again" in r.reason, r.reason
    r = less("lesson07.backward_weight", w_does_nothing, c)
    assert r.points == 0


# 07d: lesson07.first_conflict ------------------------------------------------------------------

def match_as_multisets(mine, theirs):
    """Every send has its receive somewhere on the other side: the order ignored."""
    key = lambda op, flip=False: (op.message, op.send != flip)  # noqa: E731
    return None if sorted(map(key, mine)) == sorted(key(o, True) for o in theirs) else 0


def match_per_direction(mine, theirs):
    """The sends of one side against the receives of the other, each direction alone."""
    for sends, recvs in (([o for o in mine if o.send], [o for o in theirs if not o.send]),
                         ([o for o in theirs if o.send], [o for o in mine if not o.send])):
        for k, (s, r) in enumerate(zip(sends, recvs)):
            if s.message != r.message:
                return k
    return None


def match_to_the_shorter(mine, theirs):
    """Stops at the end of the shorter list: a missing operation goes unseen."""
    for k, (a, b) in enumerate(zip(mine, theirs)):
        if a.send == b.send or a.message != b.message:
            return k
    return None


def test_first_conflict_solution_and_mistakes():
    from course_lib.pipeline_schedules import first_conflict

    full("lesson07.first_conflict", first_conflict)
    r = less("lesson07.first_conflict", match_as_multisets)
    assert "both receives prefetched" in r.reason and "recv grad 1" in r.reason, r.reason
    r = less("lesson07.first_conflict", match_per_direction)
    assert "operation #" in notes(r), notes(r)
    r = less("lesson07.first_conflict", match_to_the_shorter)
    assert "missing" in r.reason or "operation #8" in notes(r), (r.reason, notes(r))
