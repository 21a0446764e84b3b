"""Sequence parallelism (course_lib.sequence_parallel, lesson 12a) against lesson 06's tensor
parallelism and one process.

A block of the course's GPT (pre-norm attention and MLP, h = 24, 12 heads, 12 tokens, float64,
norms and biases randomized) on one process, with lesson 06's TP layers, with SP (Megatron's
re-gathering linear) and with SP keeping the gathered input: the output and every gradient (the
input's, the shards', the norm weights' and biases', the row-parallel biases') within 1e-10 on
2, 3 and 4 ranks, scratch and gloo. Without the all-reduce of the marked gradients they are
wrong. Activation bytes, bytes sent and collectives are counted against the lesson's formulas
(course_lib.course.demos.long_sequences).
"""

from __future__ import annotations

import pytest

from course_lib.course.demos import long_sequences as costs
from course_lib.spawn import spawn

TOL = 1e-10
B, S, H, HEADS = costs.B, costs.S, costs.H, costs.HEADS


def _block_checks(rank: int, world: int) -> dict:
    from course_lib.backend import default_dist

    return costs.sp_modes(world, default_dist(), None, rank)


# every world size on the course's backend; gloo (torch's process group) on 3 ranks: the
# suite's time budget
@pytest.mark.parametrize("backend, world", [("scratch", 2), ("scratch", 3), ("scratch", 4),
                                            ("gloo", 3)])
def test_sequence_parallel_block(backend, world):
    results = spawn(_block_checks, world, backend=backend, timeout=120)
    for rank, res in enumerate(results):
        assert res["one process"]["bytes"] == costs.block_activation_bytes(
            B, S, H, HEADS, element_size=8)
        for mode in costs.MODES:
            r, on, keep = res[mode], mode != "tp", mode.endswith("gathered input")
            bad = {k: e for k, e in r["errs"].items() if not e < TOL}
            assert not bad, f"{mode}, rank {rank}: {bad}"
            assert r["bytes"] == costs.block_activation_bytes(
                B, S, H, HEADS, tp=world, sp=on, save_gathered_input=keep, element_size=8), mode
            assert r["sent"] == costs.tp_block_sent_bytes(
                B, S, H, world, sp=on, save_gathered_input=keep, element_size=8), mode
            assert r["calls"] == ({"all_reduce": 4} if not on else
                                  {"all_gather": 4 if keep else 6, "reduce_scatter": 4}), mode
            if on:
                assert r["marked"] == costs.SP_PARAMS
                calls, sent = r["sp all_reduce"]
                assert calls == {"all_reduce": 1}
                assert sent == 2 * (world - 1) / world * 6 * H * 8
                # the wrong version: each rank's norm gradients cover its tokens only
                wrong = r["without all-reduce"]
                assert all(wrong[n] > 1e-3 for n in costs.SP_PARAMS), wrong
                assert all(wrong[n] < TOL for n in wrong if n not in costs.SP_PARAMS), wrong
            else:
                assert r["marked"] == [] and r["sp all_reduce"][0] == {}
        # SP's activations are 1/tp of one process's; TP's keep the norm regions whole
        assert res["sp"]["bytes"] * world == res["one process"]["bytes"]
        assert res["tp"]["bytes"] > res["sp keeping the gathered input"]["bytes"] \
            > res["sp"]["bytes"]
