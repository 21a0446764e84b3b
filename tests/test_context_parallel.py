"""Ring attention (course_lib.context_parallel, lesson 12b) against full attention on one process.

float64 throughout, so the only differences are summation orders: tolerance 1e-10. The
distributed checks run on 2, 3 and 4 ranks, on the scratch backend and on gloo, causal and not,
both layouts, sequence lengths that do and do not divide by 2 cp (padding that fills whole
chunks included); work per step, messages and bytes counted against the lesson's formulas
(course_lib.course.demos.long_sequences); torch's private ring side by side.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from course_lib.context_parallel import (LAYOUTS, attention_mask, block_attention, chunk_ids,
                                         merge, padded_length, positions, ring_attention,
                                         split_sequence, unsplit_sequence, zigzag_split)
from course_lib.course.demos import long_sequences as costs
from course_lib.spawn import spawn

TOL = 1e-10


def _rand(*shape: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def _err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max()) if a.numel() else 0.0


# --- one process ------------------------------------------------------------------------------------

@pytest.mark.parametrize("layout", LAYOUTS)
def test_split_and_unsplit_are_inverse(layout):
    for cp in (1, 2, 3, 4):
        for t in range(1, 14):
            x = _rand(2, t, 3, seed=t)
            parts = [split_sequence(x, cp, r, layout=layout) for r in range(cp)]
            assert {p.shape[1] for p in parts} == {padded_length(t, cp) // cp}
            assert torch.equal(unsplit_sequence(parts, t, layout=layout), x)
            held = torch.cat([positions(layout, r, cp, parts[0].shape[1]) for r in range(cp)])
            assert sorted(held.tolist()) == list(range(padded_length(t, cp)))


def test_zigzag_pairs_an_early_chunk_with_a_late_one():
    x = torch.arange(16).view(1, 16)
    assert [zigzag_split(x, 4, r).tolist()[0] for r in range(4)] == \
        [[0, 1, 14, 15], [2, 3, 12, 13], [4, 5, 10, 11], [6, 7, 8, 9]]
    assert [chunk_ids("zigzag", r, 4) for r in range(4)] == [(0, 7), (1, 6), (2, 5), (3, 4)]
    assert zigzag_split(torch.ones(1, 5), 4, 0).tolist() == [[1, 0]]  # 5 -> 8: padding


def test_merge_is_attention_over_both_blocks_and_keeps_empty_rows():
    q, k, v = _rand(2, 3, 5, 4, seed=1), _rand(2, 3, 9, 4, seed=2), _rand(2, 3, 9, 4, seed=3)
    everything = torch.ones(5, 9, dtype=torch.bool)
    for scale in (0.5, 60.0):  # scores near 1000: exp overflows unless rescaled by the max
        full, full_lse = block_attention(q, k, v, everything, scale)
        a = block_attention(q, k[..., :4, :], v[..., :4, :], everything[:, :4], scale)
        b = block_attention(q, k[..., 4:, :], v[..., 4:, :], everything[:, 4:], scale)
        out, lse = merge(*a, *b)
        assert _err(out, full) < TOL and _err(lse, full_lse) < TOL * full_lse.abs().max()
    assert _err(block_attention(q, k, v, everything, 0.5)[0],
                F.scaled_dot_product_attention(q, k, v, scale=0.5)) < TOL
    empty_out = torch.zeros(2, 5, 4, dtype=torch.float64)
    empty_lse = torch.full((2, 5), float("-inf"), dtype=torch.float64)
    out, lse = _rand(2, 5, 4), _rand(2, 5)
    assert torch.equal(merge(out, lse, empty_out, empty_lse)[0], out)
    both, both_lse = merge(empty_out, empty_lse, empty_out, empty_lse)
    assert torch.equal(both, empty_out) and torch.isneginf(both_lse).all()


def test_attention_mask_uses_global_positions():
    mask = attention_mask(torch.tensor([6, 7]), torch.tensor([0, 1, 7, 8]), True, 8)
    assert mask.tolist() == [[True, True, False, False], [True, True, True, False]]


def test_causal_work_closed_forms():
    for cp in (2, 3, 4, 8):
        zig, contig = costs.causal_work("zigzag", cp, 1), costs.causal_work("contiguous", cp, 1)
        assert [sum(w) for w in zig] == [2 * cp + 1] * cp
        assert [sum(w) for w in contig] == [4 * r + 3 for r in range(cp)]
        assert costs.imbalance(zig) == 1.0
        assert costs.imbalance(contig) == pytest.approx((4 * cp - 1) / (2 * cp + 1))
        assert costs.imbalance(costs.causal_work("contiguous", cp, 1, causal=False)) == 1.0


# --- the ring on 2, 3 and 4 ranks -------------------------------------------------------------------

def _ring_checks(rank: int, world: int) -> dict:
    from course_lib.backend import default_dist
    from course_lib.counting import CountingDist

    dist = default_dist()
    errs: dict[str, float] = {}
    result: dict = {"errs": errs, "work": {}, "messages": {}}
    outs = {}
    lengths = [4 * world, 4 * world - 3] + ([world + 1] if world == 4 else [])  # divides, not,
    for causal in (False, True):                                 # padding fills whole chunks
        for layout in LAYOUTS:
            for t in lengths:
                stats: dict = {}
                e, outs[causal, layout, t] = costs.ring_case(dist, None, world, rank, t, causal,
                                                             layout, stats=stats)
                errs.update({f"{causal}/{layout}/T={t}/{k}": v for k, v in e.items()})
                if causal and t == 4 * world:
                    result["work"][layout] = stats
    _, b = costs.ring_case(dist, None, world, rank, 4 * world, True, "zigzag", overlap=False)
    errs["overlap=False"] = _err(outs[True, "zigzag", 4 * world], b)
    counting = CountingDist(dist)
    q = _rand(2, 2, 4, 3).requires_grad_()
    out = ring_attention(q, q.detach(), q.detach(), causal=True, dist=counting)
    result["messages"]["forward"] = (counting.calls["isend"], counting.payload["isend"])
    counting.reset()
    out.sum().backward()
    result["messages"]["backward"] = (counting.calls["isend"], counting.payload["isend"])
    if world == 4:  # cp groups of non-adjacent ranks: ranks in messages are global
        group = [dist.new_group([0, 2]), dist.new_group([1, 3])][rank % 2]
        for layout in LAYOUTS:
            e, _ = costs.ring_case(dist, group, 2, rank // 2, 7, True, layout)
            errs.update({f"group of 2/{layout}/{k}": v for k, v in e.items()})
    return result


# every world size on the course's backend; gloo (torch's process group) on 3 ranks: the
# suite's time budget
@pytest.mark.parametrize("backend, world", [("scratch", 2), ("scratch", 3), ("scratch", 4),
                                            ("gloo", 3)])
def test_ring_attention_equals_full_attention(backend, world):
    results = spawn(_ring_checks, world, backend=backend, timeout=120)
    for rank, res in enumerate(results):
        bad = {k: e for k, e in res["errs"].items() if not e < TOL}
        assert not bad, f"rank {rank}: {bad}"
        for layout in LAYOUTS:
            expected = costs.causal_work(layout, world, 2)[rank]
            assert res["work"][layout] == {"forward": expected, "backward": expected}
        block = costs.ring_block_bytes(2, 4 * world, 2 * 3, world, element_size=8)
        n = costs.ring_messages(world)
        assert res["messages"]["forward"] == (n["forward"], n["forward"] * block)
        assert res["messages"]["backward"] == (n["backward"], n["backward"] * block)
    totals = {layout: [sum(r["work"][layout]["forward"]) for r in results] for layout in LAYOUTS}
    assert len(set(totals["zigzag"])) == 1
    assert max(totals["contiguous"]) / (sum(totals["contiguous"]) / world) == \
        pytest.approx((4 * world - 1) / (2 * world + 1))


def _memory(rank: int, world: int) -> list:
    return [costs.memory_against_length(cp, [24]) for cp in (1, 2, world)]


def test_activation_memory_per_rank_equals_the_formula():
    """What autograd keeps for one block with ring attention: e (16bsh + 4bs + abs) / cp."""
    for rows in spawn(_memory, 4, backend="scratch", timeout=120)[0]:
        assert [m for m, _ in rows] == [model for _, model in rows], rows


# --- torch's own ring, side by side ---------------------------------------------------------------

def _torch_ring(rank: int, world: int) -> dict:
    return costs.torch_ring_side_by_side(4 * world)


def test_torch_ring_attention_side_by_side():
    for rank, errs in enumerate(spawn(_torch_ring, 2, backend="gloo", timeout=120)):
        assert max(errs.values()) < TOL, (rank, errs)
