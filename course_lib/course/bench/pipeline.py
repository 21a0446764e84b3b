"""Pipeline schedules: time per step, measured bubble vs (p-1)/(m+p-1), stored activations.

Schedules: lesson 07c's `gpipe` and `1f1b` (course_lib.pipeline), and lesson 07d's
`interleaved` (v = 2), `zb-h1` and `zbv` (course_lib.pipeline_multi's executor, the same model
cut into chunks). For 07d's, the row's model is the simulated bubble with the F, B and W
measured in the same run (`course_lib.pipeline_check`), which equals each closed form where one
exists. `--torch` times torch.distributed.pipelining's counterparts on the same model
(`torch interleaved`, `torch zbv`, `torch interleaved-zb`; no ZB-H1 there).

Each stage is the same stack of wide linear layers (one thread per rank), so stages are
balanced and compute dominates the point-to-point traffic: the conditions under which the
bubble should follow (p - 1) / (m + p - 1). The bubble is measured from the recorded events:
per stage, 1 - busy time / the step's span over all stages; a row reports the mean over stages
(median over repeats).
"""

from __future__ import annotations

from typing import Iterable

import argparse

from course_lib.i18n import N_, _
from course_lib.course.bench.common import Figure, clock, median, slowest_rank
from course_lib.backend import default_dist
from course_lib.pipeline import PipelineStage, Schedule1F1B, ScheduleGPipe, split_sequential
from course_lib.pipeline import Event, bubble_fractions, ideal_bubble
from course_lib.spawn import spawn

SCHEDULES = ("gpipe", "1f1b", "interleaved", "zb-h1", "zbv")
MULTI = ("interleaved", "zb-h1", "zbv")  # lesson 07d's, run by course_lib.pipeline_multi
TORCH = {"interleaved": "ScheduleInterleaved1F1B", "zbv": "ScheduleZBVZeroBubble",
         "interleaved-zb": "ScheduleInterleavedZeroBubble"}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--stages", default="2,4", help="comma-separated numbers of stages")
    p.add_argument("--microbatches", default="1,2,4,8", help="comma-separated values of m")
    p.add_argument("--schedules", default="gpipe,1f1b,interleaved,zb-h1,zbv",
                   help=f"subset of {SCHEDULES}")
    p.add_argument("--torch", default="", help=f"torch's counterparts to time, of {tuple(TORCH)}")
    p.add_argument("--width", type=int, default=1024, help="features of every linear layer")
    p.add_argument("--layers-per-stage", type=int, default=8,
                   help="linear+ReLU blocks per stage (more: stages closer to equal, since "
                        "stage 0 computes no input gradient)")
    p.add_argument("--microbatch-size", type=int, default=64, help="rows per micro-batch")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--backend", default="gloo", choices=("gloo", "scratch"))


def run_stage(rank: int, world: int, cfg: dict) -> list[dict]:
    """One stage: for each schedule and m, warm-up steps then timed steps; per-step records."""
    import torch
    from torch import nn


    torch.manual_seed(0)
    width, layers = cfg["width"], cfg["layers_per_stage"] * world
    model = nn.Sequential(*(m for _ in range(layers) for m in (nn.Linear(width, width),
                                                                 nn.ReLU())))
    stage = PipelineStage(split_sequential(model, world)[rank], rank, world)
    dist = default_dist()
    classes = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}
    records = []
    for name in [n for n in cfg["schedules"] if n in classes]:
        for m in cfg["microbatches"]:
            schedule = classes[name](stage, m, loss_fn=nn.functional.mse_loss)
            x = torch.randn(m * cfg["microbatch_size"], width)
            for i in range(cfg["warmup"] + cfg["repeats"]):
                stage.submodule.zero_grad(set_to_none=True)
                dist.barrier()
                start = clock(x.device)
                if stage.is_first and stage.is_last:
                    schedule.step(x, target=x)
                elif stage.is_first:
                    schedule.step(x)
                elif stage.is_last:
                    schedule.step(target=x)
                else:
                    schedule.step()
                elapsed = clock(x.device) - start
                if i >= cfg["warmup"]:
                    records.append({"schedule": name, "m": m, "seconds": elapsed,
                                    "events": [tuple(e) for e in schedule.events],
                                    "peak_live": schedule.peak_live,
                                    "peak_bytes": schedule.peak_activation_bytes})
    return records + run_multi(rank, world, cfg) + run_torch(rank, world, cfg)


def _model(world: int, cfg: dict, chunks_per_stage: int = 1):
    """The benchmark's model: at least one linear layer in each of the stages' chunks."""
    from torch import nn

    width, layers = cfg["width"], max(cfg["layers_per_stage"], chunks_per_stage) * world
    return nn.Sequential(*(m for _ in range(layers) for m in (nn.Linear(width, width),
                                                             nn.ReLU())))


def run_multi(rank: int, world: int, cfg: dict) -> list[dict]:
    """Lesson 07d's schedules on the same model: warm-up then timed steps, per-step records
    (events as (stage, kind, mb, chunk, start, end))."""
    import torch

    from course_lib import pipeline_multi as ex
    from course_lib.pipeline_schedules import make

    dist, records = default_dist(), []
    for name in [n for n in cfg["schedules"] if n in MULTI]:
        for m in cfg["microbatches"]:
            torch.manual_seed(0)
            s = make(name, world, m)
            x = torch.randn(m * cfg["microbatch_size"], cfg["width"])
            runner, chunks = ex.make_executor(rank, s, _model(world, cfg, 2), x.chunk(m)[0],
                                              ex.programs_for(s)[rank])
            batch = ex.feed(rank, s, x, x)
            for i in range(cfg["warmup"] + cfg["repeats"]):
                for chunk in chunks:
                    chunk.zero_grad(set_to_none=True)
                dist.barrier()
                start = clock(x.device)
                record = runner.step(*batch)
                elapsed = clock(x.device) - start
                if i >= cfg["warmup"]:
                    records.append({"schedule": name, "m": m, "seconds": elapsed,
                                    "timeline": record.timeline,
                                    "peak_units": record.peak_bytes / max(
                                        record.bytes_per_microbatch, 1),
                                    "peak_bytes": record.peak_bytes})
    return records


def run_torch(rank: int, world: int, cfg: dict) -> list[dict]:
    """torch.distributed.pipelining's counterparts on the same model (gloo only), timed."""
    import torch
    from torch import nn
    from torch.distributed import pipelining

    from course_lib import pipeline_actions as acts

    dist, records = default_dist(), []
    for name in cfg.get("torch", []):
        placement = acts.v_placement(world) if name == "zbv" else acts.looped_placement(world, 2)
        for m in cfg["microbatches"]:
            torch.manual_seed(0)
            chunks = split_sequential(_model(world, cfg, 2), len(placement))
            mine = [c for c, at in enumerate(placement) if at == rank]
            stages = [pipelining.PipelineStage(chunks[c], c, len(placement),
                                               torch.device("cpu")) for c in mine]
            x = torch.randn(m * cfg["microbatch_size"], cfg["width"])
            try:
                schedule = getattr(pipelining, TORCH[name])(stages, m,
                                                            loss_fn=nn.functional.mse_loss)
            except (ValueError, RuntimeError) as exc:  # a schedule that refuses this m
                records.append({"schedule": f"torch {name}", "m": m, "error": str(exc)[:80]})
                continue
            args = (x,) if placement[0] == rank else ()
            kwargs = {"target": x} if placement[-1] == rank else {}
            for i in range(cfg["warmup"] + cfg["repeats"]):
                dist.barrier()
                start = clock(x.device)
                schedule.step(*args, **kwargs)
                elapsed = clock(x.device) - start
                if i >= cfg["warmup"]:
                    records.append({"schedule": f"torch {name}", "m": m, "seconds": elapsed})
    return records


def _multi_row(p: int, name: str, m: int, runs: list[list[dict]]) -> dict:
    """A row of lesson 07d's schedules: bubble measured, and simulated from measured costs."""
    from course_lib import pipeline_check as chk
    from course_lib.pipeline_actions import Action
    from course_lib.pipeline_schedules import make

    s, bubbles = make(name, p, m), []
    for per_rank in runs:
        timeline = [chk.Timed(e[0], Action(*e[1:4]), e[4], e[5]) for r in per_rank
                    for e in r["timeline"]]
        bubbles.append(sum(chk.bubble_fractions(timeline, p)) / p)
    v = s.chunks_per_stage
    costs = chk.Costs(*(v * median([t.end - t.start for t in timeline
                                    if t.action.kind == k] or [0.0]) for k in "FBW"))
    sim = chk.bubble_fractions(chk.simulate(s, costs), p)
    return {"stages": p, "schedule": name, "m": m,
            "step_s": median(slowest_rank([[r["seconds"] for r in pr] for pr in zip(*runs)])),
            "bubble": median(bubbles), "ideal_bubble": sum(sim) / p,
            "peak_live_per_stage": "/".join(f"{r['peak_units']:.2g}" for r in runs[-1]),
            "peak_act_MiB": max(r["peak_bytes"] for r in runs[-1]) / 2**20}


def summarize(p: int, per_rank: list[list[dict]]) -> list[dict]:
    rows = []
    n = len(per_rank[0])
    order = list(SCHEDULES) + [f"torch {t}" for t in TORCH]
    keys = sorted({(r["schedule"], r["m"]) for r in per_rank[0]},
                  key=lambda k: (order.index(k[0]), k[1]))
    for name, m in keys:
        idx = [i for i in range(n) if (per_rank[0][i]["schedule"], per_rank[0][i]["m"]) ==
               (name, m)]
        if name.startswith("torch"):
            first = per_rank[0][idx[0]]
            rows.append({"stages": p, "schedule": name, "m": m, "step_s": None if "error" in
                         first else median(slowest_rank([[per_rank[r][i]["seconds"]
                                                          for i in idx] for r in range(p)]))})
            continue
        if name in MULTI:
            rows.append(_multi_row(p, name, m, [[per_rank[r][i] for r in range(p)]
                                                for i in idx]))
            continue
        times = slowest_rank([[per_rank[r][i]["seconds"] for i in idx] for r in range(p)])
        bubbles = []
        for i in idx:
            events = [Event(*e) for r in range(p) for e in per_rank[r][i]["events"]]
            per_stage = bubble_fractions(events)
            bubbles.append(sum(per_stage.values()) / len(per_stage))
        last = idx[-1]
        rows.append({
            "stages": p, "schedule": name, "m": m,
            "step_s": median(times),
            "bubble": median(bubbles), "ideal_bubble": ideal_bubble(p, m),
            "peak_live_per_stage": "/".join(str(per_rank[r][last]["peak_live"])
                                            for r in range(p)),
            "peak_act_MiB": max(per_rank[r][last]["peak_bytes"] for r in range(p)) / 2**20,
        })
    return rows


def _ints(text: str) -> list[int]:
    return [int(v) for v in text.split(",") if v.strip()]


def run(args: argparse.Namespace) -> list[dict]:
    schedules = [s.strip().lower() for s in args.schedules.split(",") if s.strip()]
    unknown = set(schedules) - set(SCHEDULES)
    if unknown:
        raise SystemExit(_("unknown schedules {unknown}; choose from {schedules}",
                           unknown=sorted(unknown), schedules=SCHEDULES))
    cfg = {"width": args.width, "layers_per_stage": args.layers_per_stage,
           "microbatch_size": args.microbatch_size, "repeats": args.repeats,
           "warmup": args.warmup, "schedules": schedules, "microbatches": _ints(args.microbatches),
           "torch": [t.strip() for t in args.torch.split(",") if t.strip()
                     and args.backend == "gloo"]}  # torch's schedules need torch.distributed
    if set(cfg["torch"]) - set(TORCH):
        raise SystemExit(_("unknown torch schedules; choose from {schedules}",
                           schedules=tuple(TORCH)))
    rows = []
    for p in _ints(args.stages):
        per_rank = spawn(run_stage, p, cfg, backend=args.backend, timeout=600)
        rows += summarize(p, per_rank)
    return rows


def plot(rows: list[dict], path: str) -> None:
    """Measured bubble vs m for each schedule and p, against (p - 1) / (m + p - 1)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    plot_bubble(rows, ax)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_bubble(rows: list[dict], ax) -> None:
    """Bubble fraction vs number of micro-batches: measured points, ideal curve."""
    for p in sorted({r["stages"] for r in rows}):
        ms = sorted({r["m"] for r in rows if r["stages"] == p})
        ax.plot(ms, [(p - 1) / (m + p - 1) for m in ms], "k--", lw=1,
                label=f"(p-1)/(m+p-1), p={p}")
        for name, marker in zip(SCHEDULES, "os^vD"):
            pts = [(r["m"], r["bubble"]) for r in rows if r["stages"] == p and
                   r["schedule"] == name]
            if pts:
                ax.plot(*zip(*pts), marker, label=_("{name}, p={p} (measured)", name=name,
                                                    p=p))
    ax.set_xscale("log", base=2)
    ax.set_xlabel(_("micro-batches m"))
    ax.set_ylabel(_("bubble (idle share of the step)"))
    ax.legend(fontsize=8)


def plot_gantt(events, ax, title: str = "") -> None:
    """The measured schedule: one row per stage, F and B boxes labelled by micro-batch."""
    events = [Event(*e) for e in events]
    t0 = min(e.start for e in events)
    colors = {"F": "tab:blue", "B": "tab:orange", "W": "tab:green"}
    for e in events:
        ax.barh(e.rank, (e.end - e.start) * 1e3, left=(e.start - t0) * 1e3, height=0.8,
                color=colors[e.action], edgecolor="white")
        ax.text((e.start - t0 + (e.end - e.start) / 2) * 1e3, e.rank, str(e.microbatch),
                ha="center", va="center", fontsize=7, color="white")
    ranks = sorted({e.rank for e in events})
    ax.set_yticks(ranks, [_("stage {n}", n=r) for r in ranks])
    ax.invert_yaxis()
    ax.set_xlabel(_("ms (blue: forward, orange: backward; numbers: micro-batch)"))
    ax.set_title(title)


def plot_timeline(timeline, ax, title: str = "") -> None:
    """A schedule's timeline (`course_lib.pipeline_check.Timed`, simulated or measured): one
    row per stage; F blue, B orange, W green; a stage's later chunks hatched; numbers:
    micro-batch."""
    t0 = min(t.start for t in timeline)
    colors = {"F": "tab:blue", "B": "tab:orange", "W": "tab:green"}
    p = max(t.stage for t in timeline) + 1
    for t in timeline:
        ax.barh(t.stage, t.end - t.start, left=t.start - t0, height=0.8,
                color=colors[t.action.kind], edgecolor="white",
                hatch="//" if t.action.chunk >= p else None)
        ax.text(t.start - t0 + (t.end - t.start) / 2, t.stage, str(t.action.mb),
                ha="center", va="center", fontsize=7, color="white")
    ax.set_yticks(range(p), [_("stage {n}", n=s) for s in range(p)])
    ax.invert_yaxis()
    ax.set_title(title, fontsize=9)


TITLE = N_("Pipeline schedules: bubble against the model")


def figures(rows: list[dict]) -> Iterable[Figure]:
    """Each schedule's bubble against the model; its step time against 1F1B's with the same
    stages and m; and each of torch's counterparts against ours of the same name."""
    for r in [r for r in rows if r.get("bubble") is not None]:
        yield Figure(_("{stages} stages, {schedule}, m={m}: bubble - model", stages=r["stages"],
                       schedule=r["schedule"], m=r["m"]), r["bubble"] - r["ideal_bubble"],
                     0.1 if r["stages"] == 2 else None, unit="")
    step = {(r["stages"], r["schedule"], r["m"]): r["step_s"] for r in rows if r.get("step_s")}
    for (p, name, m), seconds in step.items():
        if name.startswith("torch "):
            ours = step.get((p, name.removeprefix("torch "), m))
            if ours:
                yield Figure(_("{stages} stages, {schedule}, m={m}: ours / torch's", stages=p,
                               schedule=name.removeprefix("torch "), m=m), ours / seconds, None)
        elif name != "1f1b" and step.get((p, "1f1b", m)):
            yield Figure(_("{stages} stages, {schedule}, m={m}: step / 1F1B's", stages=p,
                           schedule=name, m=m), seconds / step[p, "1f1b", m], None)
