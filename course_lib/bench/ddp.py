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
from typing import Any

from course_lib.bench.common import choose, finish, median, slowest_rank

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
    p.add_argument("--bucket-mb", type=float, default=25.0, help="bucket_cap_mb for every DDP")
    p.add_argument("--iters", type=int, default=50)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--timeout", type=float, default=600.0)


def make_mlp(hidden: int, layers: int, seed: int = 0):
    import torch
    from torch import nn

    torch.manual_seed(seed)
    mods: list[nn.Module] = []
    for _ in range(layers):
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
    return nn.Sequential(*[Block() for _ in range(layers)])


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

    from course_lib import ddp

    impl, backend = VARIANTS[name]
    model = make_model(args)
    dist = dists.get(backend)
    if impl.startswith("torch_ddp"):
        model = nn.parallel.DistributedDataParallel(
            model, bucket_cap_mb=args["bucket_mb"], gradient_as_bucket_view=impl.endswith("view"))
    elif impl == "ddp":
        model = ddp.DistributedDataParallel(model, bucket_cap_mb=args["bucket_mb"], dist=dist)
    params = [p for p in model.parameters()]
    sync = {"per_param": lambda: ddp.allreduce_grads_per_param(params, dist=dist),
            "flat": lambda: ddp.allreduce_grads_flat(params, dist=dist),
            "bucketed": lambda: ddp.allreduce_grads_bucketed(params, args["bucket_mb"],
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

    waited = model.exposed_comm_seconds if impl == "ddp" else None
    return step, waited


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

    from course_lib import backend as backends

    dists: dict[Any, Any] = {"rank": rank, "gloo": tdist}
    if backend == "scratch":  # spawn set up scratch; add gloo so both run in the same processes
        from course_lib import dist as scratch

        backends.init("gloo", rank, world, timeout=args["timeout"], gloo_port=gloo_port)
        dists["scratch"] = scratch
    return measure(names, args, dists)


def summarize(results: list[dict], names: list[str], args: dict) -> list[dict]:
    """One row per variant from every rank's `measure` results (slowest rank, median)."""
    from course_lib.ddp import MiB

    n_params = sum(p.numel() for p in make_model(args).parameters())
    rows = []
    for n in names:
        per_iter = slowest_rank([r["times"][n] for r in results])
        rows.append({"variant": n, "model": args.get("model", "mlp"), "world": len(results),
                     "params": n_params,
                     "grad_mib": n_params * 4 / MiB, "bucket_mb": args["bucket_mb"],
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
    from course_lib.backend import free_port
    from course_lib.spawn import spawn

    names = choose(args.variants, VARIANTS)
    if "local" in names:
        names.remove("local")
    names.insert(0, "local")  # the baseline comes first: summarize() measures against it
    backend = "scratch" if any(VARIANTS[n][1] == "scratch" for n in names) else "gloo"
    conf = {k: getattr(args, k) for k in ("batch", "bucket_mb", "iters", "warmup", "timeout")}
    conf["model"], conf["hidden"], conf["layers"] = model_config(args.model, args.hidden,
                                                                 args.layers)
    results = spawn(_worker, args.world, conf, names, free_port(), backend, backend=backend,
                    timeout=args.timeout)
    return summarize(results, names, conf)


def plot(rows: list[dict], path: str | None = None) -> Any:
    """Iteration time per variant, split into compute (the local step) and exposed comm;
    saved to `path`, or returned as a figure (in a notebook)."""
    import matplotlib.pyplot as plt

    names = [r["variant"] for r in rows]
    local = rows[0]["iter_ms"]
    fig, ax = plt.subplots(figsize=(8, 0.5 * len(rows) + 1.5))
    ax.barh(names, [local] * len(rows), label="compute (local step)", color="tab:blue")
    ax.barh(names, [max(0.0, r["exposed_comm_ms"]) for r in rows], left=local,
            label="exposed communication", color="tab:orange")
    ax.invert_yaxis()
    ax.set_xlabel("iteration time, slowest rank, median (ms)")
    ax.set_title(f"DDP variants, world {rows[0]['world']}, {rows[0]['grad_mib']:.0f} MiB of "
                 f"gradients, bucket {rows[0]['bucket_mb']:g} MiB")
    ax.legend(loc="lower right")
    return finish(fig, path)
