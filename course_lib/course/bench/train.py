"""train: the capstone's GPT on each (dp, tp, pp) layout and on PyTorch's own stack, side by side.

Every variant is a `course_lib.train.Run` of the same model and batches on the same gloo process
group, built once and stepped in turn, iteration by iteration (in a balanced order:
`common.balanced_order`), so the machine's noise hits all of them alike (in processes that keep the
memory a step frees: `common.timing_process`). Per variant: median step time of the slowest rank,
tokens per second, the ratio to torch's counterpart (DDP, ZeroRedundancyOptimizer, FSDP2's
fully_shard, DTensor's TP with FSDP2, torch.distributed.pipelining's 1F1B), and the bytes of
parameters, gradients and optimizer state of the fullest rank, measured from the tensors' storages
and by the formula the capstone notebook states. The roofline of each step
(`course_lib.course.bench.roofline`): model FLOPs per rank (6 x N x tokens plus attention, over the
4 ranks), achieved FLOP/s against the matmul peak measured on every rank at once in the same run,
MFU, and the share of the step not spent computing (1 - compute / step; compute: a local GPT's
forward, backward and AdamW on this rank's samples, timed in the same loop, divided by tp x pp,
with AdamW on 1/dp of the parameters under ZeRO).
"""

from __future__ import annotations

import argparse
from typing import Any, Iterable

from course_lib.i18n import N_, _
from course_lib.course.bench.common import (KEPT_MEMORY, Figure, balanced_order, choose, clock,
                                           median, slowest_rank, speed_and_state, timing_process)
from course_lib.course.bench.roofline import (bus_bandwidth, calibrate_peak, dp_bytes, gpt_flops,
                                              roofline)
from course_lib.train import TrainConfig
from course_lib.train import Run
from course_lib.spawn import spawn

VARIANTS = {  # name: (dp, tp, pp, zero, stack)
    "dp4": (4, 1, 1, 0, "course"),
    "dp4-zero1": (4, 1, 1, 1, "course"),
    "dp4-zero3": (4, 1, 1, 3, "course"),
    "dp2-tp2": (2, 2, 1, 0, "course"),
    "dp2-pp2": (2, 1, 2, 0, "course"),
    "tp2-pp2": (1, 2, 2, 0, "course"),
    "dp2-tp2-zero1": (2, 2, 1, 1, "course"),
    "dp2-tp2-zero3": (2, 2, 1, 3, "course"),
    "torch-ddp": (4, 1, 1, 0, "torch"),
    "torch-zero1": (4, 1, 1, 1, "torch"),
    "torch-fsdp2": (4, 1, 1, 3, "torch"),
    "torch-tp-fsdp2": (2, 2, 1, 3, "torch"),
    "torch-pp": (2, 1, 2, 0, "torch"),
}
COUNTERPART = {"dp4": "torch-ddp", "dp4-zero1": "torch-zero1",
               "dp4-zero3": "torch-fsdp2", "dp2-tp2-zero3": "torch-tp-fsdp2",
               "dp2-pp2": "torch-pp"}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--variants", default=",".join(VARIANTS),
                   help="comma-separated subset of: " + ", ".join(VARIANTS))
    p.add_argument("--steps", type=int, default=12, help="timed steps per variant")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--batch-size", type=int, default=16, help="global batch, in sequences")
    p.add_argument("--micro-batches", type=int, default=2)
    p.add_argument("--precision", default="fp32", choices=("fp32", "bf16"))
    p.add_argument("--n-layer", type=int, default=4)
    p.add_argument("--n-embd", type=int, default=128)
    p.add_argument("--block-size", type=int, default=64)
    p.add_argument("--timeout", type=float, default=900.0)


def config(name: str, args: dict) -> Any:
    dp, tp, pp, zero, stack = VARIANTS[name]
    return TrainConfig(dp=dp, tp=tp, pp=pp, zero=zero, stack=stack, steps=0,
                       batch_size=args["batch_size"], micro_batches=args["micro_batches"],
                       precision=args["precision"], n_layer=args["n_layer"],
                       n_embd=args["n_embd"], block_size=args["block_size"])


def formula_bytes(cfg: Any, vocab_size: int, coords: dict[str, int]) -> float:
    """fp32 weights, gradients and AdamW's two moments of the rank at `coords`: 16 bytes per
    local parameter with DDP, 8 + 8/dp with ZeRO-1, 16/dp with ZeRO-3. Local parameters: the
    blocks of its stage, their matrices and column biases split by tp (12C^2 + 7C each), norms
    and row biases whole (6C); the embeddings (V + T)C on the first stage, the final norm (2C)
    and, with pp > 1, the tied head's own copy VC on the last."""
    c = cfg.n_embd
    local = cfg.n_layer // cfg.pp * ((12 * c * c + 7 * c) / cfg.tp + 6 * c)
    if coords["pp"] == 0:
        local += (vocab_size + cfg.block_size) * c
    if coords["pp"] == cfg.pp - 1:
        local += 2 * c + (vocab_size * c if cfg.pp > 1 else 0)
    per_param = {0: 16, 1: 8 + 8 / cfg.dp, 3: 16 / cfg.dp}[cfg.zero]
    return per_param * local


def measure(names: list[str], args: dict) -> dict:
    """Build every variant on this rank, then step them in turn; per variant the step times,
    the state bytes and the formula's bytes."""
    import torch.distributed as tdist

    timing_process()
    tdist.barrier()
    peak = calibrate_peak()
    bandwidth = bus_bandwidth(tdist)
    runs = {n: Run(config(n, args), dist=tdist) for n in names}
    first = next(iter(runs.values()))
    local = {dp: _local_model(first, args["batch_size"] // dp)
             for dp in sorted({VARIANTS[n][0] for n in names})}
    times: dict[str, list[float]] = {n: [] for n in names}
    compute: dict[int, dict[str, list[float]]] = {dp: {"fb": [], "adam": []} for dp in local}
    for i in range(args["warmup"] + args["steps"]):
        for n in balanced_order(names, i):
            run = runs[n]
            x, y = next(run.data)
            tdist.barrier()
            start = clock(x.device)
            run.step(x, y)
            if i >= args["warmup"]:
                times[n].append(clock(x.device) - start)
        tdist.barrier()
        for dp, (model, opt, x, y) in local.items():
            fb, adam = _local_step(model, opt, x, y)
            if i >= args["warmup"]:
                compute[dp]["fb"].append(fb)
                compute[dp]["adam"].append(adam)
    return {"times": times, "peak": peak, "bandwidth": bandwidth, "compute": compute,
            "vocab_size": first.vocab_size,
            "bytes": {n: sum(r.memory.values()) for n, r in runs.items()},
            "formula": {n: formula_bytes(r.cfg, r.vocab_size, r.layout.coords)
                        for n, r in runs.items()}}


def _local_model(run: Any, sequences: int) -> tuple[Any, Any, Any, Any]:
    """The run's GPT whole, in this process alone, with AdamW and `sequences` random ones."""
    import torch

    from course_lib.gpt import GPT

    torch.manual_seed(0)
    model = GPT(run.cfg.model_config(run.vocab_size))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    ids = torch.randint(0, run.vocab_size, (sequences, run.cfg.block_size + 1))
    return model, opt, ids[:, :-1], ids[:, 1:]


def _local_step(model: Any, opt: Any, x: Any, y: Any) -> tuple[float, float]:
    """Seconds of forward + backward, and of AdamW, with no communication."""
    import torch.nn.functional as F

    t0 = clock(x.device)
    opt.zero_grad(set_to_none=True)
    F.cross_entropy(model(x).flatten(0, 1), y.flatten()).backward()
    t1 = clock(x.device)
    opt.step()
    return t1 - t0, clock(x.device) - t1


def _worker(rank: int, world: int, args: dict, names: list[str]) -> dict:
    return measure(names, args)


def summarize(results: list[dict], names: list[str], args: dict) -> list[dict]:
    tokens = args["batch_size"] * args["block_size"]
    step = {n: median(slowest_rank([r["times"][n] for r in results])) for n in names}
    has_roofline = all("peak" in r for r in results)
    if has_roofline:
        flops = gpt_flops(args["n_layer"], args["n_embd"], results[0]["vocab_size"],
                          args["block_size"], tokens)["total"] / len(results)  # per rank
        peak = max(r["peak"] for r in results)  # the best rank: noise only slows
    rows = []
    for n in names:
        fullest = max(range(len(results)), key=lambda k: results[k]["bytes"][n])
        measured, formula = results[fullest]["bytes"][n], results[fullest]["formula"][n]
        counterpart = COUNTERPART.get(n)
        dp, tp, pp, zero, stack = VARIANTS[n]
        rows.append({"variant": n, "layout": f"({dp},{tp},{pp})", "zero": zero, "stack": stack,
                     "step_ms": 1e3 * step[n], "tokens_per_s": tokens / step[n],
                     "vs_torch": step[n] / step[counterpart] if counterpart in step else None,
                     "state_mib": measured / 2**20, "formula_mib": formula / 2**20,
                     "vs_formula": measured / formula})
        if has_roofline:
            fb, adam = (median(slowest_rank([r["compute"][dp][k] for r in results]))
                        for k in ("fb", "adam"))
            rows[-1].update(roofline(flops, step[n], peak,
                                     (fb + adam / (dp if zero else 1)) / (tp * pp)))
            params = formula / {0: 16, 1: 8 + 8 / dp, 3: 16 / dp}[zero]  # the fullest rank's
            rows[-1]["bus_gbps"] = median(r["bandwidth"] for r in results) / 1e9
            rows[-1]["dp_mib"] = (dp_bytes(params, dp, zero) / 2**20 if tp == pp == 1
                                  else None)  # tp and pp traffic: not in this model
    return rows


def run(args: argparse.Namespace) -> list[dict]:
    names = choose(args.variants, VARIANTS)
    conf = {k: getattr(args, k) for k in ("steps", "warmup", "batch_size", "micro_batches",
                                          "precision", "n_layer", "n_embd", "block_size")}
    results = spawn(_worker, 4, conf, names, backend="gloo", timeout=args.timeout)
    return summarize(results, names, conf)


def plot(rows: list[dict], path: str | None = None) -> Any:
    """Tokens per second and state bytes per rank (measured, and the formula), per variant."""
    return speed_and_state(rows, "tokens_per_s",
                           _("tokens per second (slowest rank, median step)"),
                           _("parameters + gradients + AdamW state, fullest rank (MiB)"),
                           _("The capstone GPT on 4 ranks (gloo): layouts and torch's stack"),
                           path)


def quick_args(**overrides: Any) -> argparse.Namespace:
    """The benchmark's defaults (what the notebook and the tests shrink)."""
    p = argparse.ArgumentParser()
    add_arguments(p)
    return argparse.Namespace(**{**vars(p.parse_args([])), **overrides})


TITLE = N_("The capstone's layouts against torch's stack")
NOTE = KEPT_MEMORY


def figures(rows: list[dict]) -> Iterable[Figure]:
    for r in rows:
        if r.get("stack") == "course" and r.get("vs_torch") is not None:
            yield Figure(_("{layout} {variant} / torch's stack", layout=r["layout"],
                           variant=r["variant"]), r["vs_torch"], 1.0)
    for r in rows:
        if r.get("vs_formula") is not None:
            yield Figure(_("{variant}: memory / formula", variant=r["variant"]),
                         r["vs_formula"], None)
