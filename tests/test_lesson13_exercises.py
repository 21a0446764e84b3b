"""Lesson 13 exercises: the notebook's solutions score full points, realistic mistakes less,
each with a reason in the lesson's terms (whose block landed where, which round does not pair
up; a token combined without its weight or returned to another token; an expert that kept the
wrong choices)."""

from __future__ import annotations

import sys
from pathlib import Path

import cloudpickle
import pytest
import torch

from conftest import full, less
from test_lesson01_exercises import solution  # tests/ is on sys.path

cloudpickle.register_pickle_by_value(sys.modules[__name__])  # engines cannot import tests/
NOTEBOOK = Path(__file__).resolve().parents[1] / "solutions" / "13_experts.ipynb"


@pytest.fixture
def c4(scratch_cluster_4):
    return scratch_cluster_4


# lesson13.pairwise_all_to_all --------------------------------------------------------------------

def collide(output_list, input_list):
    """Send to and receive from rank r + s: right on 2 ranks, a hang on 3 and 4."""
    from course_lib import dist
    p, r = dist.get_world_size(), dist.get_rank()
    output_list[r].copy_(input_list[r])
    for step in range(1, p):
        peer = (r + step) % p
        send = dist.isend(input_list[peer], peer)
        dist.recv(output_list[peer], peer)
        send.wait()


def blocks_swapped(output_list, input_list):
    """The right partners, but the block meant for the sender's partner sent the other way."""
    from course_lib import dist
    p, r = dist.get_world_size(), dist.get_rank()
    output_list[r].copy_(input_list[r])
    for step in range(1, p):
        to, frm = (r + step) % p, (r - step) % p
        send = dist.isend(input_list[frm], to)
        dist.recv(output_list[frm], frm)
        send.wait()


def all_sends_first(output_list, input_list):
    """The naive exchange: right blocks, but rounds that do not pair up."""
    from course_lib import dist
    p, r = dist.get_world_size(), dist.get_rank()
    output_list[r].copy_(input_list[r])
    sends = [dist.isend(input_list[q], q) for q in range(p) if q != r]
    for q in range(p):
        if q != r:
            dist.recv(output_list[q], q)
    for send in sends:
        send.wait()


@pytest.mark.cluster
def test_pairwise_all_to_all_solution_and_mistakes(c4):
    full("lesson13.pairwise_all_to_all", solution("pairwise_all_to_all", NOTEBOOK), c4)
    r = less("lesson13.pairwise_all_to_all", all_sends_first, c4)
    assert "each round's sends and receives must pair up" in r.reason, r.reason
    r = less("lesson13.pairwise_all_to_all", blocks_swapped, c4, time_limit=2)
    assert "output block" in r.reason or "timed out" in r.reason, r.reason
    r = less("lesson13.pairwise_all_to_all", collide, c4, time_limit=2)
    assert r.reason.startswith("timed out"), r.reason


# lesson13.permute / unpermute: each judged on its own data (neither runs the other) --------------

def by_token(x, expert_index, kept):
    """The kept choices in token order, never sorted by expert."""
    k = expert_index.shape[1]
    order = kept.reshape(-1).nonzero().squeeze(1)
    return x[order // k], order


def unweighted(rows, order, weights, num_tokens):
    """Combine without the router's weights."""
    k = weights.shape[1]
    return rows.new_zeros(num_tokens, rows.shape[1]).index_add(0, order // k, rows)


def expert_order_kept(rows, order, weights, num_tokens):
    """Rows weighted, but left in the order the experts returned them."""
    gate = weights.reshape(-1)[order].to(rows.dtype).unsqueeze(1)
    out = rows.new_zeros(num_tokens, rows.shape[1])
    n = min(num_tokens, len(rows))
    out[:n] = (rows * gate)[:n]
    return out


@pytest.mark.cluster
def test_permute_solution_and_mistakes(c4):
    full("lesson13.permute", solution("permute", NOTEBOOK), c4)
    r = less("lesson13.permute", by_token, c4)
    assert "order is not grouped by expert" in r.reason, r.reason


@pytest.mark.cluster
def test_unpermute_solution_and_mistakes(c4):
    full("lesson13.unpermute", solution("unpermute", NOTEBOOK), c4)
    r = less("lesson13.unpermute", unweighted, c4)
    assert "without the router's weights" in r.reason, r.reason
    r = less("lesson13.unpermute", expert_order_kept, c4)
    assert "the rows did not come back to their tokens" in r.reason, r.reason


# lesson13.keep_top_scores ------------------------------------------------------------------------

def by_position(expert_index, scores, num_experts, capacity):
    """First come, first served: the earliest tokens keep their places, whatever their score."""
    flat = expert_index.reshape(-1)
    queue = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=num_experts)
    first = torch.cumsum(counts, 0) - counts
    place = torch.empty_like(queue)
    place[queue] = torch.arange(queue.numel()) - first[flat[queue]]
    return (place < capacity).view_as(expert_index)


def one_too_many(expert_index, scores, num_experts, capacity):
    """Best score first, but capacity + 1 places."""
    flat, score = expert_index.reshape(-1), scores.reshape(-1)
    kept = torch.zeros_like(flat, dtype=torch.bool)
    for e in range(num_experts):
        mine = (flat == e).nonzero().squeeze(1)
        best = mine[torch.argsort(score[mine], descending=True, stable=True)]
        kept[best[:capacity + 1]] = True
    return kept.view_as(expert_index)


@pytest.mark.cluster
def test_keep_top_scores_solution_and_mistakes(c4):
    full("lesson13.keep_top_scores", solution("keep_top_scores", NOTEBOOK), c4)
    r = less("lesson13.keep_top_scores", by_position, c4)
    assert "kept the right number of choices but not the right ones" in r.reason, r.reason
    r = less("lesson13.keep_top_scores", one_too_many, c4)
    assert "its capacity is 2" in r.reason, r.reason
