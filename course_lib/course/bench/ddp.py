"""ddp: our DistributedDataParallel (scratch and gloo) vs torch DDP, and the lesson's variants.

The default model is a stack of transformer-style MLP blocks (LayerNorm, 4x up, GELU, down,
residual): many parameters of mixed sizes, as in real models. `--model mlp` is a plain stack
of square layers: a few large parameters, the case where per-parameter sync is already fine.
Every variant trains its own copy of the same model on the same per-rank batch, with the same
bucket size, in the same processes, interleaved iteration by iteration, so the machine's noise
hits all of them alike. Per variant: median iteration time of the slowest rank, the cost of
communication left exposed (iteration time minus the same step without any communication, the
"local" row), weak-scaling efficiency (local time / variant time) and the ratio to torch DDP.
"""

from __future__ import annotations

import argparse
import time
from typing import Any, Iterable

from course_lib.i18n import N_, _
from course_lib.course.bench.common import Figure, choose, finish, median, slowest_rank
from course_lib import ddp
from course_lib import comm_hooks
from course_lib import backend as backends
from course_lib import dist as scratch
from course_lib.ddp import MiB
from course_lib.backend import free_port
from course_lib.spawn import spawn

# name -> (implementation, backend); "local" runs the same step without communicating.
# The lesson's other steps are asked for by name: "flat" and "bucketed" allocate and free a
# buffer the size of all gradients every step, which raises glibc's mmap and trim thresholds for
# the whole process and so spares every other variant the page faults it pays when run alone.
DEFAULT_VARIANTS = ("local", "torch_ddp/gloo", "torch_ddp_view/gloo", "ddp/gloo", "ddp/scratch",
                    "per_param/scratch")
VARIANTS = {
    "local": ("local", None),
    "torch_ddp/gloo": ("torch_ddp", "gloo"),
    "torch_ddp_view/gloo": ("torch_ddp_view", "gloo"),  # gradient_as_bucket_view=True, like ours
    "ddp/gloo": ("ddp", "gloo"),
    "ddp/scratch": ("ddp", "scratch"),
    "ddp_fp16/scratch": ("ddp_fp16", "scratch"),  # lesson 10's communication hooks
    "ddp_powersgd/scratch": ("ddp_powersgd", "scratch"),
    "ddp_fp16/gloo": ("ddp_fp16", "gloo"),
    "per_param/scratch": ("per_param", "scratch"),
    "per_param/gloo": ("per_param", "gloo"),
    "flat/scratch": ("flat", "scratch"),
    "flat/gloo": ("flat", "gloo"),
    "bucketed/scratch": ("bucketed", "scratch"),
    "bucketed/gloo": ("bucketed", "gloo"),
}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--variants", default=",".join(DEFAULT_VARIANTS),
                   help=f"comma-separated subset of {', '.join(VARIANTS)}")
    p.add_argument("--model", choices=sorted(MODELS), default="blocks",
                   help="blocks: transformer-style MLP blocks (many mixed-size parameters); "
                        "mlp: square linear layers (a few large ones)")
    p.add_argument("--hidden", type=int, default=None,
                   help="width (default: blocks 256, mlp 1024)")
    p.add_argument("--layers", type=int, default=None,
                   help="blocks or layers (default: blocks 16, mlp 8; both 32 MiB of gradients)")
    p.add_argument("--batch", type=int, default=64, help="samples per rank")
    p.add_argument("--bucket-mb", default="25",
                   help="bucket_cap_mb for every DDP; a comma list (0.1,1,10,100) sweeps it: each "
                        "variant runs at each size, named variant@size")
    p.add_argument("--iters", type=int, default=50)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--timeout", type=float, default=600.0)


def make_mlp(hidden: int, layers: int, seed: int = 0):
    import torch
    from torch import nn

    torch.manual_seed(seed)
    mods: list[nn.Module] = []
    for _i in range(layers):
        mods += [nn.Linear(hidden, hidden), nn.ReLU()]
    return nn.Sequential(*mods[:-1])


def make_blocks(hidden: int, layers: int, seed: int = 0):
    """`layers` residual blocks x + down(gelu(up(norm(x)))): six parameters each, of four sizes."""
    import torch
    from torch import nn

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.norm = nn.LayerNorm(hidden)
            self.up, self.down = nn.Linear(hidden, 4 * hidden), nn.Linear(4 * hidden, hidden)

        def forward(self, x):
            return x + self.down(nn.functional.gelu(self.up(self.norm(x))))

    torch.manual_seed(seed)
    return nn.Sequential(*[Block() for _i in range(layers)])


# model -> (builder, default hidden, default layers)
MODELS = {"blocks": (make_blocks, 256, 16), "mlp": (make_mlp, 1024, 8)}


def model_config(model: str = "blocks", hidden: int | None = None,
                 layers: int | None = None) -> tuple[str, int, int]:
    """(model, hidden, layers) with the model's defaults filled in."""
    _, default_hidden, default_layers = MODELS[model]
    return model, hidden or default_hidden, layers or default_layers


def make_model(args: dict):
    """The benchmark's model for `args` (model defaults to "mlp", as the lesson calls it)."""
    model, hidden, layers = model_config(args.get("model", "mlp"), args["hidden"], args["layers"])
    return MODELS[model][0](hidden, layers)


def make_step(name: str, args: dict, dists: dict):
    """Build variant `name`'s model; return (step(), exposed_wait() or None). `dists` maps a
    backend name to its `dist` module (and "rank" to this rank)."""
    import torch
    from torch import nn



    variant, bucket_mb = split_name(name, args)
    impl, backend = VARIANTS[variant]
    model = make_model(args)
    dist = dists.get(backend)
    if impl.startswith("torch_ddp"):
        model = nn.parallel.DistributedDataParallel(
            model, bucket_cap_mb=bucket_mb, gradient_as_bucket_view=impl.endswith("view"))
    elif impl.startswith("ddp"):
        model = ddp.DistributedDataParallel(model, bucket_cap_mb=bucket_mb, dist=dist)
        if impl == "ddp_fp16":
            model.register_comm_hook(comm_hooks.DefaultState(dist=dist),
                                     comm_hooks.fp16_compress_hook)
        elif impl == "ddp_powersgd":  # compressing from the first timed step on
            model.register_comm_hook(comm_hooks.PowerSGDState(
                dist=dist, matrix_approximation_rank=4, start_powerSGD_iter=2),
                comm_hooks.powerSGD_hook)
    params = [p for p in model.parameters()]
    sync = {"per_param": lambda: ddp.allreduce_grads_per_param(params, dist=dist),
            "flat": lambda: ddp.allreduce_grads_flat(params, dist=dist),
            "bucketed": lambda: ddp.allreduce_grads_bucketed(params, bucket_mb,
                                                             dist=dist)}.get(impl)
    opt = torch.optim.SGD(params, lr=1e-3)
    g = torch.Generator().manual_seed(1 + dists["rank"])
    x = torch.randn(args["batch"], args["hidden"], generator=g)
    y = torch.randn(args["batch"], args["hidden"], generator=g)

    def step() -> None:
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        if sync is not None:
            sync()
        opt.step()
        opt.zero_grad(set_to_none=True)

    waited = model.exposed_comm_seconds if impl.startswith("ddp") else None
    return step, waited


def bucket_sizes(arg: str | float) -> list[float]:
    sizes = [float(v) for v in str(arg).split(",") if v.strip()]
    if not sizes or any(v <= 0 for v in sizes):
        raise SystemExit(_("--bucket-mb needs positive sizes, got {arg!r}", arg=arg))
    return sizes


def split_name(name: str, args: dict) -> tuple[str, float]:
    """'ddp/scratch@0.5' -> ('ddp/scratch', 0.5); without '@', the one --bucket-mb."""
    variant, _, mb = name.partition("@")
    return variant, float(mb) if mb else bucket_sizes(args["bucket_mb"])[0]


def measure(names: list[str], args: dict, dists: dict) -> dict:
    """Time every variant, interleaved iteration by iteration, on this rank."""
    barrier = (dists.get("gloo") or dists["scratch"]).barrier
    steps = {n: make_step(n, args, dists) for n in names}
    times: dict[str, list[float]] = {n: [] for n in names}
    waits: dict[str, list[float]] = {n: [] for n in names}
    for it in range(args["warmup"] + args["iters"]):
        for n in names:
            step, waited = steps[n]
            barrier()
            t0 = time.perf_counter()
            step()
            t = time.perf_counter() - t0
            if it >= args["warmup"]:
                times[n].append(t)
                if waited is not None:
                    waits[n].append(waited())
    return {"times": times, "waits": waits}


def _worker(rank: int, world: int, args: dict, names: list[str], gloo_port: int,
            backend: str) -> dict:
    import torch.distributed as tdist


    dists: dict[Any, Any] = {"rank": rank, "gloo": tdist}
    if backend == "scratch":  # spawn set up scratch; add gloo so both run in the same processes

        backends.init("gloo", rank, world, timeout=args["timeout"], gloo_port=gloo_port)
        dists["scratch"] = scratch
    return measure(names, args, dists)


def summarize(results: list[dict], names: list[str], args: dict) -> list[dict]:
    """One row per variant from every rank's `measure` results (slowest rank, median)."""
    n_params = sum(p.numel() for p in make_model(args).parameters())
    rows = []
    for n in names:
        per_iter = slowest_rank([r["times"][n] for r in results])
        rows.append({"variant": n, "model": args.get("model", "mlp"), "world": len(results),
                     "params": n_params,
                     "grad_mib": n_params * 4 / MiB, "bucket_mb": split_name(n, args)[1],
                     "iter_ms": 1e3 * median(per_iter)})
        waits = [r["waits"][n] for r in results]
        rows[-1]["ddp_wait_ms"] = 1e3 * median(slowest_rank(waits)) if waits[0] else None
    local = rows[0]["iter_ms"]
    torch_ms = next((r["iter_ms"] for r in rows if r["variant"] == "torch_ddp/gloo"), None)
    for r in rows:
        r["exposed_comm_ms"] = r["iter_ms"] - local
        r["efficiency"] = local / r["iter_ms"]
        if torch_ms:
            r["vs_torch_ddp"] = r["iter_ms"] / torch_ms
    return rows


def run(args: argparse.Namespace) -> list[dict]:
    names = choose(args.variants, VARIANTS)
    if "local" in names:
        names.remove("local")
    backend = "scratch" if any(VARIANTS[n][1] == "scratch" for n in names) else "gloo"
    sizes = bucket_sizes(args.bucket_mb)
    if len(sizes) > 1:  # a sweep: every variant at every size, in the same processes
        names = [f"{n}@{mb:g}" for n in names for mb in sizes]
    names.insert(0, "local")  # the baseline comes first: summarize() measures against it
    conf = {k: getattr(args, k) for k in ("batch", "bucket_mb", "iters", "warmup", "timeout")}
    conf["model"], conf["hidden"], conf["layers"] = model_config(args.model, args.hidden,
                                                                 args.layers)
    results = spawn(_worker, args.world, conf, names, free_port(), backend, backend=backend,
                    timeout=args.timeout)
    return summarize(results, names, conf)


def plot(rows: list[dict], path: str | None = None) -> Any:
    """Iteration time per variant, split into compute (the local step) and exposed comm (for
    a bucket sweep: step time against bucket size, one line per variant); saved to `path`, or
    returned as a figure (in a notebook)."""
    import matplotlib.pyplot as plt

    if any("@" in r["variant"] for r in rows):
        return plot_sweep(rows, path)

    names = [r["variant"] for r in rows]
    local = rows[0]["iter_ms"]
    fig, ax = plt.subplots(figsize=(8, 0.5 * len(rows) + 1.5))
    ax.barh(names, [local] * len(rows), label=_("compute (local step)"), color="tab:blue")
    ax.barh(names, [max(0.0, r["exposed_comm_ms"]) for r in rows], left=local,
            label=_("exposed communication"), color="tab:orange")
    ax.invert_yaxis()
    ax.set_xlabel(_("iteration time, slowest rank, median (ms)"))
    ax.set_title(_("DDP variants, world {world}, {grad_mib:.0f} MiB of gradients, bucket "
                   "{bucket_mb:g} MiB", world=rows[0]["world"], grad_mib=rows[0]["grad_mib"],
                   bucket_mb=rows[0]["bucket_mb"]))
    ax.legend(loc="lower right")
    return finish(fig, path)


def plot_sweep(rows: list[dict], path: str | None = None) -> Any:
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    local = rows[0]["iter_ms"]
    for variant in dict.fromkeys(r["variant"].partition("@")[0] for r in rows[1:]):
        mine = [r for r in rows[1:] if r["variant"].partition("@")[0] == variant]
        ax.plot([r["bucket_mb"] for r in mine], [r["iter_ms"] for r in mine], "o-",
                label=variant)
    ax.axhline(local, color="gray", linestyle="--", label=_("no communication"))
    ax.set_xscale("log")
    ax.set_xlabel("bucket_cap_mb")
    ax.set_ylabel(_("iteration time, slowest rank, median (ms)"))
    ax.set_title(_("Bucket size sweep, world {world}, {grad_mib:.0f} MiB of gradients",
                   world=rows[0]["world"], grad_mib=rows[0]["grad_mib"]))
    ax.legend()
    return finish(fig, path)


TITLE = N_("DDP against torch's DDP")


def figures(rows: list[dict]) -> Iterable[Figure]:
    for r in rows:
        if r.get("vs_torch_ddp") is not None and not r["variant"].startswith("torch"):
            limit = 0.9 if r["variant"].startswith("ddp") else None
            yield Figure(_("{variant} / torch DDP", variant=r["variant"]), r["vs_torch_ddp"],
                         limit)


ZERO_LIMITS = {"zero1": 1.10, "zero2": 1.10, "zero3": 1.4}
