"""Pipeline parallelism against one process running the whole model on the whole batch.

float64; the pipeline sums the micro-batches' gradients in a different order than the full
batch does, so gradients and parameters agree to rtol=1e-9, atol=1e-12.
"""

from __future__ import annotations

import copy
import re

import pytest
import torch
from torch import nn

from course_lib.pipeline import (PipelineStage, Schedule1F1B, ScheduleGPipe, bubble_fractions,
                                 ideal_bubble, partition, split_sequential)
from course_lib.spawn import spawn

RTOL, ATOL = 1e-9, 1e-12
BATCH, MICROBATCHES, TRAIN_STEPS = 8, (1, 4, 8), 2
SCHEDULES = {"GPipe": ScheduleGPipe, "1F1B": Schedule1F1B}
BACKENDS = ["gloo", "scratch"]  # torch.distributed and course_lib.dist, same code


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    layers = []
    for _ in range(4):
        layers += [nn.Linear(6, 6, dtype=torch.float64), nn.Tanh()]
    return nn.Sequential(*layers)


def _max_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """Largest violation of |a - b| <= ATOL + RTOL |b| (<= 0: equal within tolerance)."""
    return float(((a - b).abs() - (ATOL + RTOL * b.abs())).max())


def _batch(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(BATCH, 6, generator=g, dtype=torch.float64),
            torch.randn(BATCH, 6, generator=g, dtype=torch.float64))


def _run_step(schedule, stage: PipelineStage, x, y, losses):
    if stage.is_first and stage.is_last:
        return schedule.step(x, target=y, losses=losses)
    if stage.is_first:
        return schedule.step(x)
    if stage.is_last:
        return schedule.step(target=y, losses=losses)
    return schedule.step()


def _one_case(rank: int, world: int, schedule_cls, m: int, scale_grads: bool = True,
              group=None, track_memory: bool = True) -> dict:
    """Stage `rank` of `world` stages; on a sub-group, `rank`/`world` are the group's."""
    full = _model()
    ref = copy.deepcopy(full)
    to_ref = {id(p): q for p, q in zip(full.parameters(), ref.parameters())}
    stage = PipelineStage(split_sequential(full, world)[rank], rank, world, group=group)
    params = list(stage.submodule.parameters())
    schedule = schedule_cls(stage, m, loss_fn=nn.functional.mse_loss, scale_grads=scale_grads,
                            track_memory=track_memory)
    opt = torch.optim.SGD(params, lr=0.1)
    opt_ref = torch.optim.SGD(ref.parameters(), lr=0.1)
    errs: dict[str, float] = {}
    for step in range(1 + TRAIN_STEPS):
        x, y = _batch(step)
        opt.zero_grad()
        opt_ref.zero_grad()
        out_ref = ref(x)
        loss_ref = nn.functional.mse_loss(out_ref, y)
        loss_ref.backward()
        losses: list = []
        out = _run_step(schedule, stage, x, y, losses)
        if step == 0:
            errs["grad"] = max(_max_err(p.grad, to_ref[id(p)].grad) for p in params)
            if stage.is_last:
                errs["output"] = _max_err(out, out_ref.detach())
                errs["loss"] = _max_err(torch.stack(losses).mean(), loss_ref.detach())
            events = schedule.events
        opt.step()
        opt_ref.step()
    errs["params"] = max(_max_err(p, to_ref[id(p)]) for p in params)
    return {"errs": errs, "peak_live": schedule.peak_live, "events": events,
            "peak_bytes": schedule.peak_activation_bytes}


def _all_cases(rank: int, world: int) -> dict:
    cases = {(name, m): _one_case(rank, world, cls, m)
             for name, cls in SCHEDULES.items() for m in MICROBATCHES}
    # The wrong version: not dividing the loss by m gives m times the gradient.
    cases["unscaled"] = _one_case(rank, world, ScheduleGPipe, 4, scale_grads=False)["errs"]
    # What the capstone runs: no activation counting, the same step.
    cases["untracked"] = _one_case(rank, world, Schedule1F1B, 4, track_memory=False)
    return cases


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("world", [2, 4])
def test_pp_parity_and_stored_activations(world, backend):
    per_rank = spawn(_all_cases, world, backend=backend, timeout=120)
    for rank, cases in enumerate(per_rank):
        assert cases.pop("unscaled")["grad"] > 0, "parity missed an unscaled loss"
        untracked = cases.pop("untracked")
        assert all(v <= 0 for v in untracked["errs"].values()), untracked["errs"]
        assert (untracked["peak_live"], untracked["peak_bytes"]) == (min(world - rank, 4), 0)
        for (name, m), r in cases.items():
            bad = {k: v for k, v in r["errs"].items() if not v <= 0}
            assert not bad, f"{name} m={m} stage {rank}: beyond rtol={RTOL} atol={ATOL}: {bad}"
            # Every micro-batch went forward then backward once on this stage.
            actions = [(e.action, e.microbatch) for e in r["events"]]
            assert sorted(actions) == sorted([("F", i) for i in range(m)] +
                                             [("B", i) for i in range(m)])
            assert all(e.rank == rank and e.end >= e.start for e in r["events"])
            # Stored activations: GPipe keeps all m; 1F1B at most p (stage s: min(p - s, m)).
            expected = m if name == "GPipe" else min(world - rank, m)
            assert r["peak_live"] == expected, (name, m, rank, r["peak_live"])
            assert r["peak_live"] <= (m if name == "GPipe" else world)
            assert r["peak_bytes"] > 0
    # With as many micro-batches as 8 >= p, 1F1B's first stage stores p, GPipe's stores 8,
    # and the bytes follow.
    first = per_rank[0]
    assert first[("1F1B", 8)]["peak_bytes"] * 8 == first[("GPipe", 8)]["peak_bytes"] * world


SUBGROUP = [1, 3]  # not starting at 0, not contiguous: group ranks differ from global ranks


def _on_subgroup(rank: int, world: int) -> dict | None:
    from course_lib.backend import default_dist

    dist = default_dist()
    sub = dist.new_group(SUBGROUP)  # every rank creates it, as torch requires
    if rank not in SUBGROUP:
        return None
    stage_rank = dist.get_rank(sub)
    r = _one_case(stage_rank, len(SUBGROUP), Schedule1F1B, 4, group=sub)
    return {"errs": r["errs"], "stage": stage_rank}


@pytest.mark.parametrize("backend", BACKENDS)
def test_pipeline_on_a_sub_group(backend):
    """A 2-stage 1F1B pipeline on global ranks 1 and 3 of 4 equals one process, on both
    backends: neighbours are global ranks found with dist.get_global_rank."""
    per_rank = spawn(_on_subgroup, 4, backend=backend, timeout=120)
    assert per_rank[0] is None and per_rank[2] is None
    for rank in SUBGROUP:
        r = per_rank[rank]
        assert r["stage"] == SUBGROUP.index(rank)
        bad = {k: v for k, v in r["errs"].items() if not v <= 0}
        assert not bad, f"stage on rank {rank}: beyond rtol={RTOL} atol={ATOL}: {bad}"


class _ReversedBackward(ScheduleGPipe):
    """A wrong schedule: the last stage runs backwards in reverse micro-batch order."""

    def order(self):
        actions = super().order()
        if self.stage.is_last:
            actions = [a for a in actions if a[0] == "F"] + \
                [a for a in reversed(actions) if a[0] == "B"]
        return actions


def _mismatched_order(rank: int, world: int) -> str:
    stage = PipelineStage(split_sequential(_model(), world)[rank], rank, world)
    x, y = _batch(0)
    try:
        _run_step(_ReversedBackward(stage, 4, loss_fn=nn.functional.mse_loss), stage, x, y, [])
    except RuntimeError as exc:
        return str(exc)
    return "ok"


def test_microbatch_order_mismatch_is_an_error_naming_stage_and_peer():
    # Stage 1 then waits for a message stage 0 will never send: a short group timeout ends it.
    msgs = spawn(_mismatched_order, 2, backend="gloo", timeout=8)
    assert "pipeline stage 0: expected gradient of micro-batch 0 from rank 1 but got " \
           "micro-batch 3" in msgs[0]


def test_partition_balances_costs():
    assert [list(r) for r in partition([1, 1, 1, 1], 2)] == [[0, 1], [2, 3]]
    assert [list(r) for r in partition([5, 0, 5, 0], 2)] == [[0, 1], [2, 3]]
    assert [list(r) for r in partition([4, 1, 1, 1, 1], 2)] == [[0], [1, 2, 3, 4]]
    assert [len(r) for r in partition([1] * 7, 3)] in ([3, 2, 2], [2, 3, 2], [2, 2, 3])
    with pytest.raises(ValueError, match="cannot split 2 layers into 3"):
        partition([1, 1], 3)
    stages = split_sequential(_model(), 4)
    assert [len(s) for s in stages] == [2, 2, 2, 2]
    assert all(isinstance(s[0], nn.Linear) for s in stages)


def test_bubble_fraction_from_events():
    from course_lib.pipeline import Event

    # Two stages, two micro-batches, unit forward and backward: GPipe's ideal timeline.
    events = [Event(0, "F", 0, 0, 1), Event(0, "F", 1, 1, 2), Event(1, "F", 0, 1, 2),
              Event(1, "F", 1, 2, 3), Event(1, "B", 0, 3, 4), Event(1, "B", 1, 4, 5),
              Event(0, "B", 0, 4, 5), Event(0, "B", 1, 5, 6)]
    assert bubble_fractions(events) == {0: pytest.approx(1 / 3), 1: pytest.approx(1 / 3)}
    assert ideal_bubble(2, 2) == pytest.approx(1 / 3)


def test_benchmark_summary_measures_bubble_from_events():
    """The benchmark's row for a 2-stage GPipe step with the ideal timeline (above)."""
    from course_lib.course.bench.pipeline import summarize

    ideal = [(0, "F", 0, 0, 1), (0, "F", 1, 1, 2), (0, "B", 0, 4, 5), (0, "B", 1, 5, 6),
             (1, "F", 0, 1, 2), (1, "F", 1, 2, 3), (1, "B", 0, 3, 4), (1, "B", 1, 4, 5)]

    def record(stage):
        return {"schedule": "gpipe", "m": 2, "seconds": 6.0, "peak_live": 2,
                "peak_bytes": 2**20, "events": [e for e in ideal if e[0] == stage]}

    [row] = summarize(2, [[record(0)], [record(1)]])
    assert row["bubble"] == pytest.approx(1 / 3) and row["ideal_bubble"] == pytest.approx(1 / 3)
    assert row["step_s"] == 6.0 and row["peak_live_per_stage"] == "2/2"
    assert row["peak_act_MiB"] == 1.0


def _peer_gone(rank: int, world: int) -> str:
    if rank == 1:  # leaves the group without running its stage
        from course_lib.backend import default_dist

        default_dist().destroy_process_group()
        return "left without running its stage"
    stage = PipelineStage(split_sequential(_model(), world)[rank], rank, world)
    try:
        ScheduleGPipe(stage, 2, loss_fn=nn.functional.mse_loss).step(_batch(0)[0])
    except RuntimeError as exc:
        return str(exc)
    return "ok"


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_stage_whose_peer_is_gone_fails_naming_stage_rank_and_peer(backend):
    msg = spawn(_peer_gone, 2, backend=backend, timeout=60)[0]
    # gloo fails the receive of the first gradient; the scratch backend the next send, or the
    # receive, whichever comes first after it sees the peer's connection closed.
    assert re.match(r"pipeline stage 0 \(rank 0\): (i?recv|isend).* of .*micro-batch \d with "
                    r"rank 1 failed", msg), msg


def test_pipeline_benchmark_runs_end_to_end(tmp_path):
    """Rows, JSON and plot on tiny sizes, lesson 07c's schedules, 07d's and one of torch's;
    the bubble itself is measured by the lead."""
    import json

    from course_lib.course.bench import __main__ as bench_cli

    out, png = tmp_path / "pipeline.json", tmp_path / "pipeline.png"
    assert bench_cli.main(["pipeline", "--stages", "2", "--microbatches", "1,2", "--width", "16",
                           "--layers-per-stage", "1", "--microbatch-size", "2", "--repeats", "2",
                           "--warmup", "0", "--torch", "interleaved",
                           "--json", str(out), "--plot", str(png)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [(r["schedule"], r["m"], r.get("peak_live_per_stage")) for r in rows[:4]] == [
        ("gpipe", 1, "1/1"), ("gpipe", 2, "2/2"), ("1f1b", 1, "1/1"), ("1f1b", 2, "2/1")]
    assert [(r["schedule"], r["m"]) for r in rows[4:]] == [
        (name, m) for name in ("interleaved", "zb-h1", "zbv", "torch interleaved")
        for m in (1, 2)]
    assert all(0 < r["bubble"] < 1 and 0 < r["ideal_bubble"] < 1 for r in rows[:10])
    assert all(r["step_s"] > 0 for r in rows)
    assert png.stat().st_size > 0
    from course_lib.course.bench.pipeline import figures

    step = {(r["schedule"], r["m"]): r["step_s"] for r in rows}
    got = {f.what: f.value for f in figures(rows) if f.limit is None}
    assert got["2 stages, zbv, m=2: step / 1F1B's"] == step["zbv", 2] / step["1f1b", 2]
    assert got["2 stages, interleaved, m=1: ours / torch's"] == (
        step["interleaved", 1] / step["torch interleaved", 1])
    assert not [w for w in got if "1f1b, " in w]  # 1F1B is the reference, not a row
