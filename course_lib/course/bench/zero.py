"""zero: our DDP, ZeRO-1, -2 and -3 against torch DDP, ZeroRedundancyOptimizer and FSDP2.

Every variant trains its own copy of the DDP benchmark's block model with Adam (fp32) on gloo, in
the same processes, interleaved iteration by iteration (in a balanced order:
`common.balanced_order`), so the machine's noise hits all of them alike (processes that keep the
memory a step frees: `common.timing_process`). ZeRO-3 wraps each block (or `--unit-blocks` of
them), ours and FSDP2 alike, and, as torchtitan does, lets the last one keep its parameters from
forward to backward, which gathers them at once again. Per variant: median step time of the slowest
rank and its ratio to our DDP and to torch's counterpart; bytes of parameters, gradients and
optimizer state per rank, measured from the tensors' storages and by the closed form; and, in a
separate run per variant (peak resident memory is a high-water mark, so it needs a process of its
own), the peak RSS growth of a rank over building the variant and training a few steps (the
high-water mark reset to the current RSS first). The roofline of each step
(`course_lib.course.bench.roofline`): model FLOPs per rank (6 x linear parameters x samples; no
attention in this model), achieved FLOP/s against the matmul peak measured on every rank at once in
the same run, MFU, and the share of the step not spent computing (1 - compute / step, compute timed
on a local copy of the model: forward and backward, and Adam on the parameters this rank updates).
"""

from __future__ import annotations

import argparse
import functools
import resource
from typing import Any, Iterable

from course_lib.i18n import N_, _
from course_lib.course.bench.common import (KEPT_MEMORY, Figure, balanced_order, choose, clock,
                                           median, slowest_rank, speed_and_state, timing_process)
from course_lib import zero
from course_lib.course.bench.ddp import make_blocks
from course_lib.course.bench.roofline import (bus_bandwidth, calibrate_peak, dense_flops, dp_bytes,
                                              linear_params, roofline)
from course_lib.ddp import DistributedDataParallel
from course_lib.zero import state_bytes, storage_bytes
from course_lib.spawn import spawn

VARIANTS = ("ddp", "zero1", "zero2", "zero3", "torch_ddp", "torch_zero", "torch_fsdp2")
COUNTERPART = {"ddp": "torch_ddp", "zero1": "torch_zero", "zero2": "torch_zero",
               "zero3": "torch_fsdp2"}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--variants", default=",".join(VARIANTS),
                   help=f"comma-separated subset of {', '.join(VARIANTS)}")
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--unit-blocks", type=int, default=1,
                   help="blocks per ZeRO-3 unit, ours and FSDP2's alike (the last takes the rest)")
    p.add_argument("--batch", type=int, default=32, help="samples per rank")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--no-peak", action="store_true", help="skip the per-variant peak runs")
    p.add_argument("--timeout", type=float, default=600.0)


def formula_bytes(variant: str, params: int, world: int) -> float:
    """fp32 Adam, P parameters, N ranks: 16P, 8P + 8P/N, 4P + 12P/N, 16P/N (no padding)."""
    P, N = params, world
    stage = {"ddp": 0, "torch_ddp": 0, "zero1": 1, "torch_zero": 1, "zero2": 2, "zero3": 3,
             "torch_fsdp2": 3}[variant]
    return {0: 16 * P, 1: 8 * P + 8 * P / N, 2: 4 * P + 12 * P / N, 3: 16 * P / N}[stage]


def fsdp_units(model: Any, per_unit: int) -> Any:
    """`model`'s blocks, `per_unit` to a unit: a Sequential of Sequentials (the same modules and
    parameters), each a unit for `fully_shard`. Fewer, larger units: fewer collectives per step,
    more parameters gathered at once."""
    from torch import nn

    if per_unit == 1:
        return model
    blocks = list(model)
    return nn.Sequential(*[nn.Sequential(*blocks[i:i + per_unit])
                           for i in range(0, len(blocks), per_unit)])


def _shard_units(model: Any, fully_shard_fn: Any) -> None:
    """ZeRO-3's units as torchtitan wraps them, ours or FSDP2's: each block (the last keeping its
    parameters from forward to backward), then the root."""
    for i, block in enumerate(model):
        fully_shard_fn(block, reshard_after_forward=i < len(model) - 1)
    fully_shard_fn(model)


def build(variant: str, args: dict) -> tuple[Any, Any]:
    """(model, optimizer) of one variant, on the initialized torch.distributed group."""
    import torch
    import torch.distributed as tdist


    model = make_blocks(args["hidden"], args["layers"])
    adam = torch.optim.Adam
    if variant == "ddp":
        model = DistributedDataParallel(model, dist=tdist)
        return model, adam(model.parameters(), lr=1e-4)
    if variant in ("zero1", "zero2"):
        return model, zero.ZeroRedundancyOptimizer(model.parameters(), adam,
                                                   stage=int(variant[-1]), dist=tdist, lr=1e-4)
    if variant in ("zero3", "torch_fsdp2"):
        model = fsdp_units(model, args.get("unit_blocks", 1))
    if variant == "zero3":
        _shard_units(model, functools.partial(zero.fully_shard, dist=tdist))
        return model, adam(model.parameters(), lr=1e-4)
    if variant == "torch_ddp":
        model = torch.nn.parallel.DistributedDataParallel(model)
        return model, adam(model.parameters(), lr=1e-4)
    if variant == "torch_zero":
        from torch.distributed.optim import ZeroRedundancyOptimizer

        model = torch.nn.parallel.DistributedDataParallel(model)
        return model, ZeroRedundancyOptimizer(model.parameters(), optimizer_class=adam, lr=1e-4)
    if variant == "torch_fsdp2":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (tdist.get_world_size(),))
        _shard_units(model, functools.partial(fully_shard, mesh=mesh))
        return model, adam(model.parameters(), lr=1e-4)
    raise ValueError(_("unknown variant {variant!r}; choose from {variants}", variant=variant,
                       variants=", ".join(VARIANTS)))


def measured_bytes(model: Any, opt: Any) -> int:
    """Parameters + gradients + optimizer state this rank holds, from storages; torch's
    sharded tensors (FSDP2's DTensors) count their local shard."""
    import torch


    if not any(hasattr(p, "to_local") for p in model.parameters()):
        return sum(state_bytes(model, opt).values())

    def local(ts):
        return [t.to_local() if hasattr(t, "to_local") else t for t in ts if t is not None]

    state = [v for s in opt.state.values() for k, v in s.items()
             if isinstance(v, torch.Tensor) and k != "step"]
    return (storage_bytes(local(model.parameters()))
            + storage_bytes(local(p.grad for p in model.parameters())) + storage_bytes(local(state)))


def _step(model: Any, opt: Any, x: Any) -> None:
    opt.zero_grad(set_to_none=True)
    model(x).square().mean().backward()
    opt.step()


def _local_step(model: Any, opt: Any, x: Any) -> tuple[float, float]:
    """Seconds of forward + backward, and of Adam, of a model no one communicates about."""
    t0 = clock(x.device)
    opt.zero_grad(set_to_none=True)
    model(x).square().mean().backward()
    t1 = clock(x.device)
    opt.step()
    return t1 - t0, clock(x.device) - t1


def measure(names: list[str], args: dict, rank: int) -> dict:
    """Time every variant, interleaved, and the same step without communication; then count
    every variant's state bytes. First the matmul peak, every rank at once."""
    import torch
    import torch.distributed as tdist

    tdist.barrier()
    peak = calibrate_peak()
    bandwidth = bus_bandwidth(tdist)
    built = {n: build(n, args) for n in names}
    local = make_blocks(args["hidden"], args["layers"])
    local = (local, torch.optim.Adam(local.parameters(), lr=1e-4))
    x = torch.randn(args["batch"], args["hidden"], generator=torch.Generator().manual_seed(rank))
    times: dict[str, list[float]] = {n: [] for n in names}
    compute: dict[str, list[float]] = {"forward_backward": [], "adam": []}
    for it in range(args["warmup"] + args["iters"]):
        for n in balanced_order(names, it):
            tdist.barrier()
            t0 = clock(x.device)
            _step(*built[n], x)
            if it >= args["warmup"]:
                times[n].append(clock(x.device) - t0)
        tdist.barrier()
        fb, adam = _local_step(*local, x)
        if it >= args["warmup"]:
            compute["forward_backward"].append(fb)
            compute["adam"].append(adam)
    return {"times": times, "bytes": {n: measured_bytes(*built[n]) for n in names},
            "peak": peak, "bandwidth": bandwidth, "compute": compute}


def _rss_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field + ":"))


def _reset_peak() -> int:
    """Restart the resident high-water mark at the current RSS (Linux: clear_refs 5); returns
    the KiB to measure growth from."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return _rss_kib("VmRSS")
    except OSError:  # elsewhere: the mark so far, which can only under-report the growth
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss


def _peak_kib() -> int:
    try:
        return _rss_kib("VmHWM")
    except OSError:
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss


def peak(variant: str, args: dict, rank: int) -> float:
    """MiB of peak RSS growth over building `variant` and training a few steps."""
    import torch

    before = _reset_peak()
    model, opt = build(variant, args)
    x = torch.randn(args["batch"], args["hidden"], generator=torch.Generator().manual_seed(rank))
    for _i in range(3):
        _step(model, opt, x)
    return (_peak_kib() - before) / 1024


def _measure_worker(rank: int, world: int, args: dict, names: list[str]) -> dict:
    timing_process()
    return measure(names, args, rank)


def _peak_worker(rank: int, world: int, args: dict, variant: str) -> float:
    import torch

    torch.set_num_threads(1)
    return peak(variant, args, rank)


def summarize(results: list[dict], names: list[str], args: dict,
              peaks: dict[str, list[float]] | None = None) -> list[dict]:
    model = make_blocks(args["hidden"], args["layers"])
    params = sum(p.numel() for p in model.parameters())
    world = len(results)
    step = {n: 1e3 * median(slowest_rank([r["times"][n] for r in results])) for n in names}
    flops = dense_flops(linear_params(model), args["batch"])  # per rank: its own samples
    has_roofline = all("peak" in r for r in results)
    if has_roofline:
        peak = max(r["peak"] for r in results)  # the best rank: noise only slows
        fb, adam = (median(slowest_rank([r["compute"][k] for r in results]))
                    for k in ("forward_backward", "adam"))
    rows = []
    for n in names:
        row = {"variant": n, "world": world, "params": params, "step_ms": step[n],
               "vs_our_ddp": step[n] / step["ddp"] if "ddp" in step else None,
               "vs_torch": (step[n] / step[COUNTERPART[n]]
                            if COUNTERPART.get(n) in step else None),
               "state_mib": max(r["bytes"][n] for r in results) / 2**20,
               "formula_mib": formula_bytes(n, params, world) / 2**20}
        if has_roofline:  # Adam updates 1/N of the parameters from ZeRO-1 on
            sharded = formula_bytes(n, params, world) < 16 * params
            row.update(roofline(flops, step[n] / 1e3, peak, fb + adam / (world if sharded else 1)))
            stage = 3 if n in ("zero3", "torch_fsdp2") else 0
            row["bus_gbps"] = median(r["bandwidth"] for r in results) / 1e9
            row["dp_mib"] = dp_bytes(params, world, stage) / 2**20
        if peaks:
            row["peak_rss_mib"] = max(peaks[n])
        rows.append(row)
    return rows


def run(args: argparse.Namespace) -> list[dict]:
    names = choose(args.variants, VARIANTS)
    if args.unit_blocks < 1:
        raise SystemExit(_("--unit-blocks must be at least 1, got {n}", n=args.unit_blocks))
    conf = {k: getattr(args, k) for k in ("hidden", "layers", "unit_blocks", "batch", "iters",
                                          "warmup")}
    results = spawn(_measure_worker, args.world, conf, names, backend="gloo",
                    timeout=args.timeout)
    peaks = None if args.no_peak else {
        n: spawn(_peak_worker, args.world, conf, n, backend="gloo", timeout=args.timeout)
        for n in names}
    return summarize(results, names, conf, peaks)


def plot(rows: list[dict], path: str | None = None) -> Any:
    """Step time and state bytes per rank, side by side, per variant."""
    return speed_and_state(rows, "step_ms", _("step time, slowest rank, median (ms)"),
                           _("parameters + gradients + Adam state per rank (MiB)"),
                           _("ZeRO stages, world {world}, {millions:.1f}M parameters, fp32 "
                             "Adam, gloo", world=rows[0]["world"],
                             millions=rows[0]["params"] / 1e6), path)


TITLE = N_("ZeRO and FSDP against our DDP and torch's")
NOTE = KEPT_MEMORY
ZERO_LIMITS = {"zero1": 1.10, "zero2": 1.10, "zero3": 1.4}


def figures(rows: list[dict]) -> Iterable[Figure]:
    for r in rows:
        v = r["variant"]
        if r.get("vs_our_ddp") is not None and v != "ddp" and not v.startswith("torch"):
            yield Figure(_("{variant} / our DDP", variant=v), r["vs_our_ddp"],
                         ZERO_LIMITS.get(v))
        if r.get("vs_torch") is not None and not v.startswith("torch"):
            yield Figure(_("{variant} / torch's counterpart", variant=v), r["vs_torch"], 0.9)
        if r.get("formula_mib"):
            yield Figure(_("{variant}: state bytes / formula", variant=v),
                         r["state_mib"] / r["formula_mib"], None)
