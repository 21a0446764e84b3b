"""Lesson 10's exercises (10a: `terms`, exported into course_lib.comm_model; 10b: the hooks,
exported into course_lib.comm_hooks): the solutions score full points on 2, 3 and 4 ranks;
realistic wrong versions less, each with a reason in the lesson's terms."""

from __future__ import annotations

import math
import sys

import cloudpickle
import pytest
import torch

from conftest import full, less
from course_lib import comm_hooks, comm_model
from course_lib.comm_hooks import orthogonalize_

cloudpickle.register_pickle_by_value(sys.modules[__name__])  # engines cannot import tests/


@pytest.fixture
def c4(scratch_cluster_4):
    return scratch_cluster_4


# lesson10.compress_hook -----------------------------------------------------------------------

def _where(state):
    return state.dist, state.process_group, state.dist.get_world_size(state.process_group)


def divides_after_the_sum(dtype, state, bucket):
    """Sums in the narrow type first: large gradients overflow float16 to inf."""
    dist, group, world = _where(state)
    buffer = bucket.buffer()
    compressed = buffer.to(dtype)

    def decompress(fut):
        buffer.copy_(fut.value()[0].div_(world))
        return buffer
    return dist.all_reduce(compressed, group=group, async_op=True).get_future().then(decompress)


def not_cast_back(dtype, state, bucket):
    """Returns the narrow tensor itself: the gradients would become float16."""
    dist, group, world = _where(state)
    compressed = bucket.buffer().to(dtype).div_(world)
    return dist.all_reduce(compressed, group=group, async_op=True).get_future().then(
        lambda fut: fut.value()[0])


def no_average(dtype, state, bucket):
    dist, group, _ = _where(state)
    buffer = bucket.buffer()
    compressed = buffer.to(dtype)

    def decompress(fut):
        buffer.copy_(fut.value()[0])
        return buffer
    return dist.all_reduce(compressed, group=group, async_op=True).get_future().then(decompress)


def sends_float32(dtype, state, bucket):
    """The right average, with no compression at all: twice the bytes."""
    dist, group, world = _where(state)
    buffer = bucket.buffer()
    rounded = buffer.to(dtype).div_(world).float()
    return dist.all_reduce(rounded, group=group, async_op=True).get_future().then(
        lambda fut: buffer.copy_(fut.value()[0]))


def test_compress_hook_solution_and_mistakes(c4):
    full("lesson10.compress_hook", comm_hooks.compress_hook, c4)
    for wrong, why in ((divides_after_the_sum, "overflowed to inf"),
                       (not_cast_back, "DDP needs the bucket back in the gradients' float32"),
                       (no_average, "the sum over the 2 ranks, not their average"),
                       (sends_float32, "4 per gradient: nothing travelled as float16")):
        result = less("lesson10.compress_hook", wrong, c4)
        assert why in result.reason, (wrong.__name__, result.reason)


# lesson10.compress_with_feedback --------------------------------------------------------------

def forgets_the_error(grad, error, k):
    return comm_hooks.compress_with_feedback(grad, None, k)


def keeps_sent_entries(grad, error, k):
    acc = grad if error is None else grad + error
    indices = acc.abs().topk(k).indices
    return indices, acc[indices], acc.clone()  # the sent entries are sent again next step


def largest_not_by_magnitude(grad, error, k):
    acc = grad if error is None else grad + error
    indices = acc.topk(k).indices  # the most negative entries are never sent
    residual = acc.clone()
    residual[indices] = 0
    return indices, acc[indices], residual


def changes_grad_in_place(grad, error, k):
    acc = grad if error is None else grad.add_(error)
    indices = acc.abs().topk(k).indices
    residual = acc.clone()
    residual[indices] = 0
    return indices, acc[indices], residual


def test_compress_with_feedback_solution_and_mistakes():
    full("lesson10.compress_with_feedback", comm_hooks.compress_with_feedback)
    for wrong, why in ((forgets_the_error, "largest entries of grad alone"),
                       (keeps_sent_entries, "still holds the entries that were sent"),
                       (largest_not_by_magnitude, "not the 3 largest in magnitude"),
                       (changes_grad_in_place, "grad was changed in place")):
        result = less("lesson10.compress_with_feedback", wrong)
        assert why in result.reason, (wrong.__name__, result.reason)


# lesson10.powersgd_step -----------------------------------------------------------------------

def _q_round(matrices, ps, qs, dist, group):
    """The step's second half, done right: Q = M^T P summed and averaged, M = P Q^T."""
    for m, p, q in zip(matrices, ps, qs):
        q.copy_(torch.bmm(m.transpose(1, 2), p))
    flat = torch.cat([q.reshape(-1) for q in qs])
    dist.all_reduce(flat, group=group)
    flat.div_(dist.get_world_size(group))
    for m, p, q, f in zip(matrices, ps, qs, flat.split([q.numel() for q in qs])):
        q.copy_(f.view_as(q))
        m.copy_(torch.bmm(p, q.transpose(1, 2)))


def no_orthogonalization(matrices, qs, *, dist=None, group=None, epsilon=0.0):
    ps = [torch.bmm(m, q) for m, q in zip(matrices, qs)]
    flat = torch.cat([p.reshape(-1) for p in ps])
    dist.all_reduce(flat, group=group)
    ps = [f.view_as(p) for f, p in zip(flat.split([p.numel() for p in ps]), ps)]
    _q_round(matrices, ps, qs, dist, group)


def one_all_reduce_per_matrix(matrices, qs, *, dist=None, group=None, epsilon=0.0):
    """Right numbers, 2 collectives per matrix instead of 2 in all."""
    world = dist.get_world_size(group)
    for m, q in zip(matrices, qs):
        p = torch.bmm(m, q)
        dist.all_reduce(p, group=group)
        orthogonalize_(p, epsilon)
        q.copy_(torch.bmm(m.transpose(1, 2), p))
        dist.all_reduce(q, group=group)
        q.div_(world)
        m.copy_(torch.bmm(p, q.transpose(1, 2)))


def q_not_averaged(matrices, qs, *, dist=None, group=None, epsilon=0.0):
    class Summing:
        def __getattr__(self, name):
            return getattr(dist, name)

        def get_world_size(self, group=None):
            return 1  # so the step divides by 1
    comm_hooks.powersgd_step(matrices, qs, dist=Summing(), group=group, epsilon=epsilon)


def local_p(matrices, qs, *, dist=None, group=None, epsilon=0.0):
    """Orthogonalizes this rank's own P, never summed: every rank a different basis."""
    ps = [torch.bmm(m, q) for m, q in zip(matrices, qs)]
    dist.all_reduce(torch.cat([p.reshape(-1) for p in ps]), group=group)  # result ignored
    for p in ps:
        orthogonalize_(p, epsilon)
    _q_round(matrices, ps, qs, dist, group)


def test_powersgd_step_solution_and_mistakes(c4):
    full("lesson10.powersgd_step", comm_hooks.powersgd_step, c4)
    for wrong, why in ((no_orthogonalization, "P was never orthogonalized"),
                       (one_all_reduce_per_matrix, "one all_reduce and its Qs in another"),
                       (q_not_averaged, "the sum over the 2 ranks, not their average"),
                       (local_p, "orthogonalized its own P, unsummed")):
        result = less("lesson10.powersgd_step", wrong, c4)
        assert why in result.reason, (wrong.__name__, result.reason)


# lesson10.terms -------------------------------------------------------------------------------

def only_powers_of_two(algorithm, nbytes, p):
    """lg p rounds even when p is not a power of two: no fold-in of the extra ranks."""
    if algorithm not in comm_model.ALGORITHMS:
        raise ValueError(algorithm)
    if algorithm in ("tree", "rabenseifner") and p > 1:
        lg = math.log2(p)
        if algorithm == "tree":
            return lg, lg * nbytes, lg * nbytes
        return 2 * lg, 2 * (p - 1) / p * nbytes, (p - 1) / p * nbytes
    return comm_model.terms(algorithm, nbytes, p)


def ring_sends_everything(algorithm, nbytes, p):
    if algorithm == "ring" and p > 1:
        return 2.0 * (p - 1), 2.0 * (p - 1) * nbytes, (p - 1) * nbytes
    return comm_model.terms(algorithm, nbytes, p)


def ring_off_by_one(algorithm, nbytes, p):
    if algorithm == "ring" and p > 1:
        return 2.0 * p, 2.0 * p / (p + 1) * nbytes, p / (p + 1) * nbytes
    return comm_model.terms(algorithm, nbytes, p)


def test_terms_solution_and_mistakes():
    full("lesson10.terms", comm_model.terms)
    for wrong, why in ((only_powers_of_two, "as if 3 were a power of two"),
                       (ring_sends_everything, "not the whole tensor"),
                       (ring_off_by_one, "messages waited for: expected 2, got 4")):
        result = less("lesson10.terms", wrong)
        assert why in result.reason, (wrong.__name__, result.reason)
