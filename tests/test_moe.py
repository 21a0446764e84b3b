"""The MoE layer under expert parallelism equals one process computing every expert on the
whole batch (forward, backward, the auxiliary loss), in float64 to 1e-10, with and without
dropped tokens, k = 1 and 2, on 2, 3 and 4 ranks, on the scratch backend and on gloo; the
bytes it moves equal the model; and the layer's pieces on one process (capacity, the drop
policy, the loss, the gate weights, the permutation).
"""

from __future__ import annotations


import pytest
import torch

from course_lib.spawn import spawn

from course_lib import moe as M
from course_lib.counting import CountingDist

TOL = 1e-10
DIM, HIDDEN, TOKENS = 6, 8, 12  # tokens per rank
AUX = 0.1
# (top_k, capacity_factor, experts per rank): dropless, dropping, and one expert per rank
CONFIGS = [(1, None, 2), (1, 0.5, 2), (2, None, 2), (2, 0.75, 2), (2, 0.6, 1)]


def whole_layer(world: int, k: int, factor: float | None, per: int, groups: int = 1) -> M.MoE:
    """The same whole layer on every rank and in the reference (seeded), in float64."""
    torch.manual_seed(100 * world + 10 * k + per)
    return M.MoE(DIM, HIDDEN, per * world, k, factor, groups=groups).double()


def batch(world: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The whole batch (world * TOKENS, DIM) and the cotangent the loss contracts it with."""
    g = torch.Generator().manual_seed(7 * world + n)
    x = torch.randn(world * TOKENS, DIM, generator=g, dtype=torch.float64)
    return x, torch.randn(world * TOKENS, DIM, generator=g, dtype=torch.float64)


def ep_rank(rank: int, world: int, groups: list[list[int]] | None = None) -> list[dict]:
    """Every config on this rank's tokens, with its share of the experts; what the parent
    compares with the reference. `groups`: several ep groups (else the world is one)."""
    from course_lib.backend import default_dist

    dist = default_dist()
    group, members = None, list(range(world))
    for ranks in groups or []:
        made = dist.new_group(ranks)
        if rank in ranks:
            group, members = made, ranks
    p, me = len(members), members.index(rank)
    results = []
    for n, (k, factor, per) in enumerate(CONFIGS):
        layer = whole_layer(p, k, factor, per)
        M.expert_parallel(layer, dist=dist, group=group)
        x_all, g_all = batch(p, n)
        x = x_all.tensor_split(p)[me].clone().requires_grad_()
        y = layer(x)
        ((y * g_all.tensor_split(p)[me]).sum() + AUX * layer.aux_loss).backward()
        router = layer.router.weight.grad.clone()
        dist.all_reduce(router, group=group)  # replicated over ep: its gradient is the sum
        results.append({"y": y.detach(), "x.grad": x.grad, "router.grad": router,
                        "aux": layer.aux_loss.detach(),
                        "experts": {me * per + e: [q.grad for q in ex.parameters()]
                                    for e, ex in enumerate(layer.experts)},
                        "dropped": int(layer.tokens_per_expert.sum()) < TOKENS * k})
    return results


def reference(p: int, n: int) -> dict:
    """One process, every expert, the whole batch routed in p groups (the ranks' drops)."""
    k, factor, per = CONFIGS[n]
    layer = whole_layer(p, k, factor, per)
    x_all, g_all = batch(p, n)
    x = x_all.clone().requires_grad_()
    y, aux = M.dense_reference(layer, x, groups=p)
    ((y * g_all).sum() + AUX * p * aux).backward()  # the ranks' losses, summed
    groups_aux = [M.route(layer, t).aux_loss.detach() for t in x_all.tensor_split(p)]
    return {"y": y.detach(), "x.grad": x.grad, "router.grad": layer.router.weight.grad,
            "aux": groups_aux, "experts": [[q.grad for q in ex.parameters()]
                                           for ex in layer.experts]}


def compare(results: list[list[dict]], members: list[int]) -> None:
    p = len(members)
    for n in range(len(CONFIGS)):
        ref = reference(p, n)
        for me, rank in enumerate(members):
            got, what = results[rank][n], f"config {CONFIGS[n]}, rank {rank} of {members}"
            for key in ("y", "x.grad"):
                err = (got[key] - ref[key].tensor_split(p)[me]).abs().max().item()
                assert err < TOL, f"{key}: {err:.2e} ({what})"
            assert abs(got["aux"] - ref["aux"][me]) < TOL, what
            assert (got["router.grad"] - ref["router.grad"]).abs().max() < TOL, what
            for e, grads in got["experts"].items():
                for a, b in zip(grads, ref["experts"][e]):
                    assert (a - b).abs().max() < TOL, f"expert {e}: {what}"
        dropped = any(results[r][n]["dropped"] for r in members)
        assert dropped == (CONFIGS[n][1] is not None), f"drops in config {CONFIGS[n]}"


@pytest.mark.parametrize("backend", ["scratch", "gloo"])
@pytest.mark.parametrize("world", [2, 3, 4])
def test_ep_equals_one_process(world: int, backend: str) -> None:
    compare(spawn(ep_rank, world, backend=backend, timeout=120), list(range(world)))


def test_ep_groups_inside_a_bigger_world() -> None:
    """Two ep groups of 2 in a world of 4 (the layout's ep axis): each equals its reference."""
    groups = [[0, 1], [2, 3]]
    results = spawn(ep_rank, 4, groups, backend="scratch", timeout=120)
    for members in groups:
        compare(results, members)


# --- bytes moved --------------------------------------------------------------------------------

def counted_rank(rank: int, world: int) -> dict:
    """One forward and backward through a counting dist: the bytes all_to_all sent, and the
    counts that the model needs (this rank's kept choices per expert)."""
    from course_lib import dist

    out = {}
    for name, (k, factor, per) in {"k=2, drops": (2, 0.75, 2), "balanced": (1, None, 2)}.items():
        counting = CountingDist(dist)
        layer = whole_layer(world, k, factor, per)
        x_all, _ = batch(world, 0)
        if name == "balanced":  # token t to expert t mod E, every rank alike
            experts = per * world
            with torch.no_grad():
                layer.router.weight.copy_(10 * torch.eye(experts, DIM))
            x_all = torch.eye(experts, DIM, dtype=torch.float64).repeat(
                world * TOKENS // experts, 1) + 0.01 * x_all
        M.expert_parallel(layer, dist=counting)
        x = x_all.tensor_split(world)[rank].clone().requires_grad_()
        layer(x).sum().backward()
        out[name] = {"sent": counting.exact["all_to_all_single"],
                     "calls": counting.calls["all_to_all_single"],
                     "counts": layer.tokens_per_expert}
    return out


def test_bytes_moved_equal_the_model() -> None:
    world = 3
    results = spawn(counted_rank, world, backend="scratch", timeout=60)
    for name in ("k=2, drops", "balanced"):
        counts = torch.stack([r[name]["counts"] for r in results])  # (p, E)
        for rank, r in enumerate(results):
            assert r[name]["calls"] == 5, r[name]  # counts; rows out, back; their gradients
            assert r[name]["sent"] == M.moe_bytes(counts, rank, DIM, 8), (name, rank)
    experts = counts.shape[1]
    for rank, r in enumerate(results):
        assert r["balanced"]["sent"] == M.moe_bytes_balanced(TOKENS, 1, world, experts, DIM, 8)


# --- the pieces, on one process -------------------------------------------------------------

def test_capacity() -> None:
    assert M.expert_capacity(12, 6, 1, 1.0) == 2
    assert M.expert_capacity(12, 6, 2, 1.25) == 5  # ceil(1.25 * 12 * 2 / 6)
    assert M.expert_capacity(10, 4, 1, 0.5) == 2  # ceil(1.25)
    assert M.expert_capacity(12, 6, 2, None) == 12  # no limit: a token picks an expert once


def test_drop_policy_keeps_the_highest_scores() -> None:
    index = torch.tensor([[0], [0], [0], [1]])
    scores = torch.tensor([[0.5], [0.9], [0.7], [0.2]])
    assert M.keep_top_scores(index, scores, 2, 2).flatten().tolist() == [False, True, True, True]
    ties = torch.full((3, 1), 0.6)
    assert M.keep_top_scores(torch.zeros(3, 1, dtype=torch.long), ties, 1, 2).flatten().tolist() \
        == [True, True, False]  # equal scores: the earlier token first
    index2 = torch.tensor([[0, 1], [1, 0], [0, 1]])
    scores2 = torch.tensor([[0.6, 0.3], [0.5, 0.4], [0.45, 0.4]])
    # expert 0 ranks 0.6, 0.45, 0.4 and keeps two; expert 1 ranks 0.5, 0.4, 0.3
    assert M.keep_top_scores(index2, scores2, 2, 2).tolist() == [[True, False], [True, False],
                                                                 [True, True]]
    assert not M.keep_top_scores(index2, scores2, 2, 0).any()


def test_load_balancing_loss() -> None:
    e, t = 4, 8
    uniform = torch.full((t, e), 1 / e)
    balanced = (torch.arange(t) % e).view(t, 1)
    assert M.load_balancing_loss(uniform, balanced).item() == pytest.approx(1.0)
    collapsed = torch.zeros(t, e)
    collapsed[:, 0] = 1
    assert M.load_balancing_loss(collapsed, torch.zeros(t, 1, dtype=torch.long)).item() == \
        pytest.approx(e)  # everything on one expert: E
    probs = torch.softmax(torch.randn(t, e, dtype=torch.float64), -1).requires_grad_()
    M.load_balancing_loss(probs, probs.topk(2, -1).indices).backward()
    assert probs.grad is not None and probs.grad.abs().sum() > 0  # through P_e only


@pytest.mark.parametrize("k", [1, 2])
def test_gate_weights(k: int) -> None:
    torch.manual_seed(0)
    layer = M.MoE(6, 8, 4, top_k=k).double()
    r = M.route(layer, torch.randn(10, 6, dtype=torch.float64))
    if k == 1:  # Switch: the chosen probability itself
        assert torch.equal(r.weights, r.scores)
    else:  # Mixtral: renormalized over the two chosen
        assert torch.allclose(r.weights.sum(-1), torch.ones(10, dtype=torch.float64))
    r16 = M.route(layer.bfloat16(), torch.randn(10, 6).bfloat16())
    assert r16.probs.dtype == torch.float32  # routing never runs in a 16-bit type


@pytest.mark.parametrize("k", [1, 2])
@pytest.mark.parametrize("factor", [None, 0.5, 1.0])
@pytest.mark.parametrize("groups", [1, 2, 3])
def test_layer_equals_every_expert_on_every_token(k: int, factor: float | None,
                                                  groups: int) -> None:
    torch.manual_seed(1)
    layer = M.MoE(8, 16, 6, k, factor, groups=groups).double()
    x = torch.randn(2 * 3 * groups, 2, 8, dtype=torch.float64, requires_grad=True)
    g = torch.randn_like(x)
    y = layer(x)
    ((y * g).sum() + 0.3 * layer.aux_loss).backward()
    grads = [p.grad.clone() for p in layer.parameters()]
    x_grad, x.grad = x.grad.clone(), None
    layer.zero_grad()
    y_ref, aux_ref = M.dense_reference(layer, x, groups)
    ((y_ref * g).sum() + 0.3 * aux_ref).backward()
    assert (y - y_ref).abs().max() < 1e-10 and (x_grad - x.grad).abs().max() < 1e-10
    assert abs(layer.aux_loss - aux_ref) < 1e-10
    for a, p in zip(grads, layer.parameters()):
        assert (a - p.grad).abs().max() < 1e-10
    kept, choices = int(layer.tokens_per_expert.sum()), x.shape[0] * x.shape[1] * k
    if factor is None:
        assert kept == choices
    if factor == 0.5:  # half the slots the choices need: drops for certain
        assert kept < choices


def test_permutation_round_trip() -> None:
    """unpermute(permute(x)) with unit weights gives every token times its kept choices."""
    torch.manual_seed(2)
    x = torch.randn(9, 5, dtype=torch.float64)
    index = torch.randint(0, 4, (9, 2))
    index[:, 1] = (index[:, 0] + 1) % 4
    kept = torch.rand(9, 2) > 0.3
    rows, order = M.permute(x, index, kept)
    experts = index.reshape(-1)[order]
    assert torch.equal(experts, experts.sort().values)  # grouped by expert
    out = M.unpermute(rows, order, torch.ones(9, 2, dtype=torch.float64), 9)
    assert torch.allclose(out, x * kept.sum(1, keepdim=True))


def test_the_pieces_are_lesson_13s_and_dropless_routing_needs_no_policy() -> None:
    """moe runs the dispatch, combine and drop policy lesson 13 exports (course_lib.moe_dispatch);
    without a capacity limit nothing can be dropped, so the policy is not called (the lesson
    routes tokens before its learner has written one)."""
    from course_lib import moe_dispatch

    assert (M.permute, M.unpermute, M.keep_top_scores) == (
        moe_dispatch.permute, moe_dispatch.unpermute, moe_dispatch.keep_top_scores)

    def no_policy(*args):
        raise AssertionError("called without a capacity limit")

    torch.manual_seed(3)
    layer = M.MoE(4, 8, 4, top_k=2).double()
    r = M.route(layer, torch.randn(6, 4, dtype=torch.float64), keep=no_policy)
    assert r.kept.all()
