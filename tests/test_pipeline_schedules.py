"""Lesson 07d's schedules (course_lib.pipeline_actions, pipeline_schedules, pipeline_multi).

What runs where:
- simulated (no processes), the full grid: every schedule (GPipe, 1F1B, interleaved 1F1B with
  v = 2, ZB-H1, ZBV) valid, deadlock-free and paired under NCCL's rule for p = 2, 3, 4 and
  m = 1..8 (m < p included); the simulated idle time and bubble equal the closed forms over 13
  cost triples; stored activations equal theirs; interleaving halves the bubble at the stated
  messages; ZB-H1 below 1F1B at equal peak memory; ZBV without gaps at equal costs; lesson
  07c's orders are the same lists; the backward split equals the whole backward, nothing
  recomputed.
- on real ranks (course_lib.spawn), a representative subset: every schedule at m = 1, 3, 8 on
  the scratch backend with p = 2 and p = 3 (one spawn each), and every schedule at m = 4 on
  gloo with p = 2: the gradients of one process in float64 to 1e-10, the actions in the list's
  order, no weight gradient inside a split B, the measured peak of stored bytes equal to the
  list's replay and, in micro-batches, to the simulated peak.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from course_lib import pipeline_actions as acts
from course_lib import pipeline_check as formulas
from course_lib import pipeline_comms as comms
from course_lib import pipeline_multi as ex
from course_lib import pipeline_schedules as sch
from course_lib.pipeline_check import Costs, ScheduleError, peak_activations, simulate
from course_lib.pipeline_nccl import check, check_pairs
from course_lib.spawn import spawn

NAMES = ("gpipe", "1f1b", "interleaved", "zb-h1", "zbv")
STAGES, MICROBATCHES = (2, 3, 4), range(1, 9)
COSTS = [Costs(1, 1, 1), Costs(1, 2, 1), Costs(2, 1, 3), Costs(1, 1.5, 0.5), Costs(0.3, 0.7, 0.2)]
GRID = [Costs(f, b, w) for f in (0.5, 2) for b in (0.5, 2) for w in (0.5, 2)]


@pytest.mark.parametrize("name", NAMES)
def test_every_schedule_runs_and_pairs_its_messages(name):
    """Valid lists, no deadlock, and the ordered programs pass NCCL's rule, one operation at a
    time and as batches, with sends that block until received."""
    for p in STAGES:
        for m in MICROBATCHES:
            report = check(sch.make(name, p, m))  # raises ScheduleError if anything fails
            check_pairs(report.programs)
            assert len(report.timeline) == sum(len(a) for a in report.schedule.stages)


@pytest.mark.parametrize("name", NAMES)
def test_simulated_bubble_equals_the_formula(name):
    checked = 0
    for costs in COSTS + GRID:
        for p in STAGES:
            for m in MICROBATCHES:
                want = formulas.idle_time(name, p, m, costs)
                if want is None:
                    continue
                report = check(sch.make(name, p, m), costs)
                assert report.idle == pytest.approx([want] * p, abs=1e-9), (costs, p, m)
                share = formulas.bubble(name, p, m, costs)
                assert report.bubble == pytest.approx([share] * p, abs=1e-9)
                checked += 1
    assert checked >= 3 * 8 * 2


@pytest.mark.parametrize("name", NAMES)
def test_stored_activations_equal_the_formula(name):
    for p in STAGES:
        for m in MICROBATCHES:
            want = formulas.peak_formula(name, p, m)
            if want is not None:
                assert peak_activations(sch.make(name, p, m)) == want, (p, m)


def test_interleaving_divides_the_bubble_by_v_at_v_times_the_messages():
    costs = Costs(1, 2, 0)
    for p in STAGES:
        for m in (p, 2 * p):
            flat = check(acts.one_f_one_b(p, m), costs)
            inter = check(sch.interleaved_1f1b(p, m), costs)
            assert inter.idle[0] == pytest.approx(flat.idle[0] / 2)
            n_flat = sum(len(comms.ops_in_order(pr)) for pr in flat.programs)
            n_inter = sum(len(comms.ops_in_order(pr)) for pr in inter.programs)
            assert n_inter == 2 * n_flat + 2 * 2 * m  # v x the hops, plus the loop back (2 m)


def test_zb_h1_beats_1f1b_at_equal_memory():
    for costs in COSTS:
        for p in STAGES:
            for m in MICROBATCHES:
                zb, base = check(acts.zb_h1(p, m), costs), check(acts.one_f_one_b(p, m), costs)
                assert max(zb.peak) == max(base.peak)
                if m > 1 or costs.W > 0:
                    assert max(zb.idle) < max(base.idle), (costs, p, m)


def test_zbv_has_no_gap_once_a_stage_starts_at_equal_costs():
    """The paper's zero bubble: from its first action to its last, no stage waits; what
    idles is the start (stages wait for the first forward) and the end."""
    for p in STAGES:
        for m in (2 * p - 1, 2 * p + 1):
            report = check(acts.zbv(p, m), Costs(1, 1, 1))
            for s in range(p):
                mine = sorted((t.start, t.end) for t in report.timeline if t.stage == s)
                assert all(a[1] == pytest.approx(b[0]) for a, b in zip(mine, mine[1:])), (p, m, s)
            assert max(report.peak) == p


def test_lesson07_orders_are_the_same_lists():
    """Lesson 07c's GPipe and 1F1B orders, read as schedules, equal these."""
    from course_lib import pipeline

    for p in STAGES:
        for m in MICROBATCHES:
            for ours, theirs in ((acts.gpipe, pipeline.gpipe_order),
                                 (acts.one_f_one_b, pipeline.one_f_one_b_order)):
                lesson = acts.from_orders("lesson", m, acts.looped_placement(p), theirs)
                assert lesson.stages == ours(p, m).stages


def test_orders_read_as_the_lesson_writes_them():
    s = acts.one_f_one_b(3, 4)
    assert [tuple(a)[:2] for a in s.stages[2][:4]] == [("F", 0), ("B", 0), ("F", 1), ("B", 1)]
    assert str(sch.interleaved_1f1b(2, 2)).splitlines()[1] == \
        "stage 0: F0@c0 F1@c0 F0@c2 F1@c2 B0@c2 B1@c2 B0@c0 B1@c0"
    assert acts.v_placement(3) == (0, 1, 2, 2, 1, 0)


def test_backward_split_equals_the_whole_backward():
    """B then W gives the gradients of one backward, nothing recomputed: B leaves every
    weight gradient untouched, W fills them all."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 6), nn.Tanh(), nn.Linear(6, 6), nn.ReLU(),
                          nn.Linear(6, 3)).double()
    ref = copy.deepcopy(model)
    x, y = torch.randn(7, 5, dtype=torch.float64), torch.randn(7, 3, dtype=torch.float64)
    nn.functional.mse_loss(ref(x), y).backward()
    head, tail = model[:2], model[2:]
    h, first = sch.forward_segments(head, x)
    inp = h.detach().requires_grad_()
    calls = []
    for layer in model:
        layer.register_forward_hook(lambda *_: calls.append(1))
    _, second = sch.forward_segments(tail, inp, loss=lambda o: nn.functional.mse_loss(o, y))
    g = sch.backward_input(second, None)
    assert all(q.grad is None for q in model.parameters())
    assert sch.backward_input(first, g) is None  # the batch needs no gradient
    sch.backward_weight(second)
    sch.backward_weight(first)
    assert len(calls) == 3  # the tail's forward only: W recomputed nothing
    for q, r in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(q.grad, r.grad, rtol=0, atol=1e-15)


def test_simulate_refuses_a_schedule_that_cannot_start():
    s = acts.one_f_one_b(2, 2)
    swapped = acts.Schedule("bad", 2, s.placement, (s.stages[0], (s.stages[1][1],
                                                                 s.stages[1][0]) + s.stages[1][2:]))
    with pytest.raises(ScheduleError):
        simulate(swapped)


# -- on real ranks ------------------------------------------------------------------------------

NAMES = tuple(sch.SCHEDULES)
TOL = 1e-10


def all_schedules(rank: int, world: int, names: tuple, ms: tuple) -> list[dict]:
    """On each rank: one step of every schedule and m, against one process."""
    rows = []
    for name in names:
        for m in ms:
            s = sch.make(name, world, m)
            x, y = ex.make_batch(m, 2 * m)
            record, chunks = ex.run_step(rank, s, ex.build_model(m, blocks=12), x, y,
                                         ex.programs_for(s)[rank])
            want = ex.reference_grads(ex.build_model(m, blocks=12), x, y, s.n_chunks)
            excess = max(float(((q.grad - r).abs() - TOL * (1 + r.abs())).max())
                         for c, chunk in zip(s.chunks_of(rank), chunks)
                         for q, r in zip(chunk.parameters(), want[c]))
            rows.append({"name": name, "m": m, "excess": excess,
                         "order": [(k, j, c) for _, k, j, c, *_ in record.timeline],
                         "peak_bytes": record.peak_bytes, "stored": record.stored,
                         "weights_in_b": record.weights_in_b})
    return rows


def replay_peak(actions, schedule, stored) -> int:
    """The peak of stored bytes the action list implies, from the measured bytes per F."""
    live = peak = 0
    for a in actions:
        if a.kind == "F":
            live += stored[(a.mb, a.chunk)]
        elif a.kind == "W" or not schedule.split_backward(a.mb, a.chunk):
            live -= stored[(a.mb, a.chunk)]
        peak = max(peak, live)
    return peak


# Gradients over the whole grid (p = 2..4, m = 1..8, gloo and scratch) are
# tests/test_pipeline_grid.py's; here one world checks what a rank measures of its own stage.
@pytest.mark.parametrize("p, backend, ms", [(3, "scratch", (1, 3, 8))])
def test_same_gradients_as_one_process_on_real_ranks(p, backend, ms):
    per_rank = spawn(all_schedules, p, NAMES, ms, backend=backend, timeout=120)
    for rank, rows in enumerate(per_rank):
        for row in rows:
            s = sch.make(row["name"], p, row["m"])
            where = f"{row['name']} p={p} m={row['m']} stage {rank}"
            assert row["excess"] <= 0, where
            assert row["order"] == [tuple(a) for a in s.stages[rank]], where
            assert row["weights_in_b"] == 0, where
            assert row["peak_bytes"] == replay_peak(s.stages[rank], s, row["stored"]), where
            if s.placement[-1] != rank:  # chunks of one size (the last one adds the loss)
                unit = row["stored"][(0, s.chunks_of(rank)[0])] * s.chunks_per_stage
                assert row["peak_bytes"] / unit == peak_activations(s)[rank], where
