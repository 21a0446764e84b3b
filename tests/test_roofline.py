"""The roofline's FLOP count against a hand count and torch's FLOP counter, for a tiny GPT."""

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from course_lib.course.bench.roofline import (calibrate_peak, comm_bound, dp_bytes, gpt_flops,
                                              linear_params, roofline)
from course_lib.gpt import GPT, GPTConfig


def test_gpt_flops_match_a_hand_count_and_torchs_counter():
    L, C, V, T, B = 2, 16, 11, 8, 3
    model = GPT(GPTConfig(vocab_size=V, block_size=T, n_layer=L, n_head=2, n_embd=C,
                          dropout=0.0))
    got = gpt_flops(L, C, V, T, B * T)
    # per block: qkv 16x48, out_proj 16x16, fc1 16x64, fc2 64x16; the tied head 11x16
    hand = L * (16 * 48 + 16 * 16 + 16 * 64 + 64 * 16) + 11 * 16
    assert got["matmul_params"] == hand == linear_params(model) + model[0].wte.weight.numel()
    assert got["dense"] == 6 * hand * B * T
    # QK^T and AV: 2 x 2 x T x C per token and layer forward, three times that with backward
    assert got["attention"] == L * 3 * (2 * 2 * T * C) * B * T
    assert got["total"] == got["dense"] + got["attention"]
    with FlopCounterMode(display=False) as counter:  # it counts the matmuls of nn.Linear / head
        model(torch.randint(0, V, (B, T))).sum().backward()
    assert counter.get_total_flops() in (got["dense"], got["total"])


def test_peak_roofline_and_the_communication_bound_rule():
    peak = calibrate_peak(size=64, seconds=0.01)
    assert peak > 1e6
    row = roofline(flops=2e9, step_s=0.5, peak=8e9, compute_s=0.3)
    assert row["achieved_gflops"] == pytest.approx(4.0)
    assert row["mfu"] == pytest.approx(0.5)
    assert row["wait_share"] == pytest.approx(0.4)
    assert roofline(1.0, 1.0, 1.0)["wait_share"] is None
    assert comm_bound(0.1, 4e8, 1e9)["bound"] == "communication"
    assert comm_bound(0.1, 4e7, 1e9)["bound"] == "compute"
    # the ring model: DDP and ZeRO-1/2 send 2 (N-1)/N of the gradients' bytes, ZeRO-3 3 (N-1)/N
    assert dp_bytes(1000, 4, 0) == dp_bytes(1000, 4, 1) == 2 * 3 / 4 * 4000
    assert dp_bytes(1000, 4, 3) == 3 * 3 / 4 * 4000
