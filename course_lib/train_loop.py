"""The capstone's loop around its step, and the ways to start it (lesson 11c sketches it; no
exercise changes it).

- `run_steps(run)`: step a `course_lib.train.Run` up to `cfg.steps` (from the newest checkpoint
  in `cfg.checkpoint_dir`, if any): the learning-rate schedule, the validation loss and samples
  every so many steps, lesson 09's checkpoints, a tqdm bar on rank 0 (`cfg.progress`) or rank 0's
  steps appended to `cfg.progress_file`; every rank returns the same losses.
- `watch(cluster, train, cfg)`: the same run on a notebook's cluster, rank 0's bar and samples
  shown live in the notebook while the engines train.
- `one_process(train, cfg)`: a process group of one, here (the reference every layout is
  compared with).
- `torchrun(cfg, ...)`, `flags`, `parse_args`, `cli_main`: `python -m course_lib.train`, under
  torchrun or with `course_lib.spawn`.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

from course_lib.i18n import _
from course_lib.processes import run_session
from course_lib.recovery import CheckpointManager
from course_lib.run import TrainConfig, check_config, learning_rate


def _due(every: int, step: int, last: int) -> bool:
    """Whether an evaluation (or a sample) is due after `step` steps: before training, every
    `every` steps, and after the last."""
    return bool(every) and (step % every == 0 or step == last)


def run_steps(run: Any, after_backward: Callable[[Any], None] | None = None) -> dict[str, Any]:
    """Train `run` up to step `run.cfg.steps`; what every rank returns (the same losses)."""
    cfg = run.cfg
    rank = run.dist.get_rank()
    manager = CheckpointManager(cfg.checkpoint_dir, dist=run.dist) if cfg.checkpoint_dir else None
    first = run.resume(manager) if manager else 0
    run.after_backward = after_backward
    tokens = cfg.batch_size * cfg.block_size
    bar = report = None
    if cfg.progress and rank == 0:
        from tqdm.auto import tqdm
        bar = tqdm(total=cfg.steps, initial=first, desc=f"dp={cfg.dp} tp={cfg.tp} pp={cfg.pp}"
                   + (f" cp={cfg.cp}" if cfg.cp > 1 else "") + (" sp" if cfg.sp else ""))
    if cfg.progress_file and rank == 0:
        report = open(cfg.progress_file, "a", encoding="utf-8")
    losses, skipped, times, val, samples = [], [], [], [], []

    def milestones(step: int) -> dict[str, Any]:
        out: dict[str, Any] = {}
        if _due(cfg.eval_every, step, cfg.steps):
            val.append((step, run.evaluate()))
            out["val"] = val[-1][1]
        if _due(cfg.sample_every, step, cfg.steps):
            samples.append((step, run.sample(cfg.sample)))
            out["sample"] = samples[-1][1]
        return out

    try:
        news = milestones(first) if first == 0 else {}
        for step in range(first, cfg.steps):
            if report is not None and news:
                report.write(json.dumps({"step": step, **news}) + "\n")
                report.flush()
            for group in run.optimizer.param_groups:
                group["lr"] = learning_rate(cfg, step)
            x, y = next(run.data)
            start = time.perf_counter()
            loss, skip = run.step(x, y)
            times.append(time.perf_counter() - start)
            run.steps_done += 1
            losses.append(loss)
            skipped.append(skip)
            news = milestones(step + 1)
            if manager and cfg.checkpoint_every and (step + 1) % cfg.checkpoint_every == 0:
                manager.save(run.state(), step + 1)
            if bar is not None:
                bar.set_postfix(loss=f"{loss:.3f}", tok_s=f"{tokens / times[-1]:,.0f}")
                bar.update()
            if report is not None:
                report.write(json.dumps({"step": step + 1, "loss": loss,
                                         "tokens_per_s": tokens / times[-1], **news}) + "\n")
                report.flush()
                news = {}
    finally:
        if bar is not None:
            bar.close()
        if report is not None:
            report.close()
    steady = times[1:] or times or [float("nan")]  # the first step also warms up
    return {"rank": rank, "coords": run.layout.coords, "first_step": first, "losses": losses,
            "skipped": skipped, "step_s": sum(steady) / len(steady),
            "tokens_per_s": tokens * len(steady) / sum(steady), "memory": run.memory,
            "scale": run.scaler.scale if run.scaler else None,
            "val": val, "samples": samples,
            "sample": (samples[-1][1] if samples else run.sample(cfg.sample)) if cfg.sample
            else None,
            "config": dataclasses.asdict(cfg)}


def one_process(train: Callable[..., dict], cfg: TrainConfig, **kwargs: Any) -> dict[str, Any]:
    """`train(cfg, **kwargs)` in this process alone (a process group of one, set up and torn
    down here)."""
    from course_lib import dist as scratch

    scratch.init_process_group(rank=0, world_size=1)
    try:
        return train(cfg, dist=scratch, **kwargs)
    finally:
        scratch.destroy_process_group()


def one_process_config(cfg: TrainConfig) -> TrainConfig:
    """`cfg` on one process: the same model, batches and numerics, no parallelism, on the CPU
    (`one_process` runs on the scratch backend, a host backend)."""
    return dataclasses.replace(cfg, dp=1, tp=1, pp=1, cp=1, sp=False, zero=0, micro_batches=1,
                               reduce_dtype="fp32", progress=False, progress_file="",
                               device="cpu")


# --- a run on a notebook's cluster, watched ------------------------------------------------------

def watch(cluster: Any, train: Callable[..., dict], cfg: TrainConfig, *,
          timeout: float = 3600.0, poll: float = 0.5) -> list[dict]:
    """`cluster.run(train, cfg)` with rank 0's progress shown here as it trains: a tqdm bar
    (loss, tokens per second), the validation losses and the samples as they come. Rank 0
    appends its steps to a file that this process reads (the engines are local)."""
    import threading

    from tqdm.auto import tqdm

    with tempfile.TemporaryDirectory(prefix="capstone-") as tmp:
        path = Path(tmp) / "progress.jsonl"
        path.touch()
        job = dataclasses.replace(cfg, progress=False, progress_file=str(path))
        done: dict[str, Any] = {}

        def target() -> None:
            try:
                done["result"] = cluster.run(train, job, timeout=timeout)
            except BaseException as exc:  # noqa: BLE001 - raised again in the caller
                done["error"] = exc

        thread = threading.Thread(target=target, daemon=True)
        start, last = time.perf_counter(), {}
        thread.start()
        bar = tqdm(total=cfg.steps, desc=f"rank 0, (dp, tp, pp) = ({cfg.dp}, {cfg.tp}, {cfg.pp})")
        with open(path, encoding="utf-8") as f:
            while True:
                alive = thread.is_alive()
                for line in f.readlines():
                    event = json.loads(line)
                    if "loss" in event:
                        last = event
                        bar.update(event["step"] - bar.n)
                        bar.set_postfix(loss=f"{event['loss']:.3f}",
                                        tok_s=f"{event['tokens_per_s']:,.0f}")
                    if "val" in event:
                        bar.write(_("step {step:5}: validation loss {loss:.3f}",
                                    step=event["step"], loss=event["val"]))
                    if "sample" in event:
                        bar.write("    " + event["sample"].replace("\n", "\n    "))
                if not alive:
                    break
                thread.join(poll)
        bar.close()
    if "error" in done:
        raise done["error"]
    minutes = (time.perf_counter() - start) / 60
    print(_("rank 0: {steps} steps in {minutes:.1f} min, last loss {loss:.3f}, "
            "{tokens_per_s:,.0f} tokens/s in the steps", steps=last.get("step", 0),
            minutes=minutes, loss=last.get("loss", float("nan")),
            tokens_per_s=done["result"][0]["tokens_per_s"]))
    return done["result"]


# --- the command line: python -m course_lib.train ------------------------------------------------

def flags(cfg: TrainConfig) -> list[str]:
    """The command-line flags that reproduce `cfg` (those that differ from the defaults)."""
    out, defaults = [], TrainConfig()
    for f in dataclasses.fields(TrainConfig):
        value = getattr(cfg, f.name)
        if f.name not in ("progress", "progress_file") and value != getattr(defaults, f.name):
            flag = "--" + f.name.replace("_", "-")
            out += [flag] if f.type == "bool" else [flag, str(value)]
    return out


def torchrun(cfg: TrainConfig, nproc_per_node: int, json_file: str | os.PathLike, *,
             timeout: float = 600.0) -> dict[str, Any]:
    """Run `cfg` under torchrun on this host (`torchrun --nproc-per-node N -m course_lib.train
    ...`), in its own process group, and return rank 0's result."""
    # Its agent's logs in a folder removed afterwards (by default torchrun leaves a
    # /tmp/torchelastic_* folder behind at every run).
    with tempfile.TemporaryDirectory(prefix="course-torchrun-") as logs:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node",
               str(nproc_per_node), "--log-dir", logs, "-m", "course_lib.train", *flags(cfg),
               "--json", str(json_file)]
        run_session(cmd, timeout, f"torchrun --nproc-per-node {nproc_per_node}",
                    env={"OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")})
    with open(json_file) as f:
        return json.load(f)


def _maybe_float(text: str) -> float | None:
    return None if text.lower() == "none" else float(text)


FLAG_HELP = {
    "dp": "data-parallel ranks (default %(default)s)",
    "tp": "tensor-parallel ranks: each block's heads and hidden units split "
          "(default %(default)s)",
    "pp": "pipeline stages (default %(default)s)",
    "cp": "context-parallel ranks: each sequence split in zigzag parts, attention by ring "
          "attention (lesson 12b); dp x cp x tp x pp = the world (default %(default)s)",
    "sp": "sequence parallelism on the tp ranks: norms and residuals split along the "
          "sequence (lesson 12a); needs tp > 1",
    "zero": "0: DDP; 1: ZeRO-1; 3: ZeRO-3 (default %(default)s)",
    "clip_grad_norm": "clip the whole model's gradient norm to this (default: no clipping)",
}


def parse_args(argv: list[str] | None = None) -> tuple[TrainConfig, argparse.Namespace]:
    p = argparse.ArgumentParser(prog="python -m course_lib.train",
                                description="The capstone's GPT on a (dp, tp, pp, cp) layout.")
    defaults = TrainConfig()
    for f in dataclasses.fields(TrainConfig):
        flag = "--" + f.name.replace("_", "-")
        if f.name in ("progress", "progress_file"):
            continue  # rank 0 always shows a bar when run from the command line
        if f.type == "bool":
            p.add_argument(flag, action="store_true", help=FLAG_HELP.get(f.name))
        else:
            kind = {"int": int, "float": float, "str": str,
                    "float | None": _maybe_float}[f.type]
            p.add_argument(flag, type=kind, default=getattr(defaults, f.name),
                           help=FLAG_HELP.get(f.name))
    p.add_argument("--json", metavar="FILE", help="write the loss per step (and the run) here")
    p.add_argument("--backend", default="gloo", help="without torchrun: course_lib.spawn's "
                   "backend (gloo or scratch)")
    args = p.parse_args(argv)
    cfg = TrainConfig(**{f.name: getattr(args, f.name) for f in dataclasses.fields(TrainConfig)
                         if f.name not in ("progress", "progress_file")}, progress=True)
    return cfg, args


def cli_main(argv: list[str] | None, train: Callable[..., dict],
             spawn_rank: Callable[..., dict]) -> int:
    """The command line: under torchrun (RANK and WORLD_SIZE set) `train` on torch.distributed
    (`course_lib.backend.torchrun_init`: NCCL on this rank's GPU, or gloo); otherwise
    `course_lib.spawn(spawn_rank, dp * tp * pp, cfg)`."""
    cfg, args = parse_args(argv)
    world = cfg.dp * cfg.cp * cfg.tp * cfg.pp
    launched = "RANK" in os.environ and "WORLD_SIZE" in os.environ  # torchrun, or any env://
    if launched:
        import torch.distributed as tdist
        check_config(cfg, int(os.environ["WORLD_SIZE"]))
        from course_lib.backend import torchrun_init
        cfg = dataclasses.replace(cfg, device=str(torchrun_init(cfg.device)))
        try:
            result = train(cfg, dist=tdist)
            tdist.barrier()  # no rank tears its connections down while a peer still uses them
        finally:
            tdist.destroy_process_group()
            # Free the groups (a Run's cycles hold them) while the interpreter runs: a gloo
            # worker thread that releases a tensor during interpreter shutdown aborts the rank.
            gc.collect()
    else:
        check_config(cfg, world)
        from course_lib.spawn import spawn
        result = spawn(spawn_rank, world, cfg, backend=args.backend)[0]
    if args.json and result["rank"] == 0:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    if result["rank"] == 0:
        print(_("final loss {loss:.4f} after {steps} steps, {tokens_per_s:,.0f} tokens/s",
                loss=result["losses"][-1], steps=cfg.steps, tokens_per_s=result["tokens_per_s"]))
    if launched:  # the group is gone and the results written: skip the interpreter's teardown,
        sys.stdout.flush()  # where a gloo thread still releasing a tensor aborts the rank
        sys.stderr.flush()
        os._exit(0)
    return 0
