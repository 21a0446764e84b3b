#!/usr/bin/env python3
"""course_lib on GPUs, checked outside the test suite: what one device (or one node) can prove.

    PYTHONPATH=. python3 tools/gpu_smoke.py [--device cuda|cpu] [--only NAME ...] [--json FILE]

Every check runs in fresh processes with a timeout, so a hang, an EFAULT or a segfault is a
FAIL line, not a dead runner; one line per check, and with --json the results as a list.

On one GPU: NCCL at world size 1 for every component and the capstone (against its CPU
reference), autocast on the GPU, and two ranks sharing cuda:0 over gloo (which stages CUDA
tensors through host memory) and over the scratch backend (which refuses them by name). With 2
GPUs or more, a rank per GPU on NCCL: lesson 07d's executor running every pipeline schedule in
NCCL's per-pair order, and tensor parallelism's bias broadcast. With 4 GPUs or more, also every
capstone layout under torchrun on NCCL, its losses against one process's. `--device cpu` runs the same checks on the CPU (gloo in place of NCCL, no GPU-only
check): tests/test_gpu_smoke.py runs a few of them that way, so the script cannot rot.
"""
from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import os
import secrets
import socket
import subprocess
import sys
import tempfile
import time

CHECKS: dict = {}  # name -> (function, world size, timeout in seconds, needs)


def check(name, world=1, timeout=120, needs="any"):
    """needs: "any" (CPU or GPU), "cuda" (a GPU), "gpus2" (a GPU per rank for 2 ranks; on the
    CPU, gloo), "gpus4" (a node of 4 GPUs)."""
    def register(fn):
        CHECKS[name] = (fn, world, timeout, needs)
        return fn
    return register


def result(**kw):  # what rank 0 reports; the runner reads the last RESULT line
    print("RESULT " + json.dumps(kw), flush=True)


def device():
    import torch
    return torch.device(os.environ["SMOKE_DEVICE"], 0) if os.environ["SMOKE_DEVICE"] == "cuda" \
        else torch.device("cpu")


def init(backend, rank, world, port, seconds=60):
    """torch.distributed on this rank; "nccl" means NCCL on a GPU and gloo on the CPU."""
    import torch
    import torch.distributed as dist
    from datetime import timedelta
    extra = {}
    if device().type == "cuda":
        torch.cuda.set_device(0)  # one GPU: every rank on cuda:0
        if backend == "nccl":
            extra = {"device_id": torch.device("cuda", 0)}
    elif backend == "nccl":
        backend = "gloo"
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world, timeout=timedelta(seconds=seconds), **extra)
    return dist


def mlp(seed=0):
    import torch
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(),
                               torch.nn.Linear(64, 64), torch.nn.GELU(),
                               torch.nn.Linear(64, 8)).to(device())


def batch(seed):
    import torch
    g = torch.Generator().manual_seed(seed)
    return torch.randn(16, 32, generator=g).to(device())


def close(a, b, rtol=1e-5, atol=1e-6):
    import torch
    return all(torch.allclose(x, y, rtol=rtol, atol=atol) for x, y in zip(a, b))


def on_device(tensors):
    want = device().type
    return all(t.device.type == want for t in tensors)


@check("autocast")
def _autocast(rank, world, port):
    import torch
    from course_lib.precision import precision_forward
    net, x = mlp(), batch(1)
    ref = net(x)
    with torch.autocast(device().type, dtype=torch.bfloat16):
        want = net(x).float()
    got = precision_forward(net, (x,), "bf16")
    result(ok=bool(torch.equal(got, want)) and not torch.equal(got, ref) and on_device([got]),
           why="bf16 output is not autocast's on the inputs' device")


def _ddp_like(wrap, rank, world, port, steps=2):
    import torch
    dist = init("nccl", rank, world, port)
    net = mlp()
    ref = copy.deepcopy(net)
    model, opt = wrap(net, dist)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    for step in range(steps):
        x = batch(step)
        opt.zero_grad()
        model(x).square().mean().backward()
        opt.step()
        ref_opt.zero_grad()
        ref(x).square().mean().backward()
        ref_opt.step()
    x = batch(99)
    with torch.no_grad():
        got, want = model(x), ref(x)
    result(ok=on_device(list(net.parameters()) + [got]) and close([got], [want], 1e-4, 1e-5),
           why="parameters off the device, or outputs off the one-process reference")


@check("ddp.w1")
def _ddp(rank, world, port):
    import torch
    from course_lib.ddp import DistributedDataParallel
    _ddp_like(lambda net, dist: (DistributedDataParallel(net, dist=dist, bucket_cap_mb=0.01),
                                 torch.optim.SGD(net.parameters(), lr=0.1)), rank, world, port)


@check("zero1.w1")
def _zero1(rank, world, port):
    import torch
    from course_lib.zero import ZeroRedundancyOptimizer
    _ddp_like(lambda net, dist: (net, ZeroRedundancyOptimizer(
        net.parameters(), torch.optim.SGD, stage=1, dist=dist, lr=0.1)), rank, world, port)


@check("zero2.w1")
def _zero2(rank, world, port):
    import torch
    from course_lib.zero import ZeroRedundancyOptimizer
    _ddp_like(lambda net, dist: (net, ZeroRedundancyOptimizer(
        net.parameters(), torch.optim.SGD, stage=2, dist=dist, lr=0.1)), rank, world, port)


@check("fsdp.w1")
def _fsdp(rank, world, port):
    import torch
    from course_lib.zero import fully_shard

    def wrap(net, dist):
        for i in (0, 2):
            fully_shard(net[i], dist=dist)
        fully_shard(net, dist=dist)
        return net, torch.optim.SGD(net.parameters(), lr=0.1)
    _ddp_like(wrap, rank, world, port)


@check("tp.w1")
def _tp(rank, world, port):
    import torch
    dist = init("nccl", rank, world, port)
    from course_lib.tensor_parallel import TensorParallelMLP
    torch.manual_seed(0)
    fc1, fc2 = torch.nn.Linear(32, 64).to(device()), torch.nn.Linear(64, 32).to(device())
    tp = TensorParallelMLP.from_linears(fc1, fc2, dist=dist)
    x = batch(2)
    y = tp(x)
    want = fc2(torch.nn.functional.gelu(fc1(x)))
    result(ok=on_device([y]) and close([y], [want], 1e-4, 1e-5))


@check("hooks.w1")
def _hooks(rank, world, port):
    import torch
    dist = init("nccl", rank, world, port)
    from course_lib import comm_hooks as H
    from course_lib.ddp import DistributedDataParallel
    from course_lib.hook_states import DefaultState
    bad = []
    for name, state, hook in [("fp16", DefaultState(dist=dist), H.fp16_compress_hook),
                              ("bf16", DefaultState(dist=dist), H.bf16_compress_hook),
                              ("topk", H.TopKState(ratio=1.0, dist=dist), H.topk_hook),
                              ("powerSGD", H.PowerSGDState(start_powerSGD_iter=2, dist=dist),
                               H.powerSGD_hook)]:
        try:
            net = mlp()
            ref = copy.deepcopy(net)
            ddp = DistributedDataParallel(net, dist=dist, bucket_cap_mb=0.01)
            ddp.register_comm_hook(state, hook)
            for step in range(3):
                x = batch(step)
                rng = torch.cuda.get_rng_state() if device().type == "cuda" else None
                for p in list(net.parameters()) + list(ref.parameters()):
                    p.grad = None
                ddp(x).square().mean().backward()
                ref(x).square().mean().backward()
                if rng is not None and not torch.equal(rng, torch.cuda.get_rng_state()):
                    bad.append(f"{name}: the hook moved the CUDA RNG")
            grads, want = [p.grad for p in net.parameters()], [p.grad for p in ref.parameters()]
            tol = {"fp16": 2e-3, "bf16": 2e-2, "topk": 1e-5, "powerSGD": None}[name]
            if not on_device(grads) or not all(torch.isfinite(g).all() for g in grads) or (
                    tol is not None and not close(grads, want, tol, tol)):
                bad.append(f"{name}: gradients off")
        except Exception as exc:  # noqa: BLE001 - reported
            bad.append(f"{name}: {type(exc).__name__}: {str(exc).splitlines()[0][:160]}")
    result(ok=not bad, why="; ".join(bad))


@check("checkpoint.w1")
def _checkpoint(rank, world, port):
    import torch
    dist = init("nccl", rank, world, port)
    from course_lib import checkpoint
    from course_lib.zero import Piece
    d = device()
    src = {"w": torch.randn(64, 64, device=d), "b": torch.arange(10., device=d),
           "p": Piece(torch.randn(100, device=d), 0, torch.Size([100])), "step": 3}
    dst = {"w": torch.zeros(64, 64, device=d), "b": torch.zeros(10, device=d),
           "p": Piece(torch.zeros(100, device=d), 0, torch.Size([100])), "step": 0}
    with tempfile.TemporaryDirectory() as folder:
        checkpoint.save(src, folder, dist=dist)
        checkpoint.load(dst, folder, dist=dist)
    result(ok=all(torch.equal(src[k], dst[k]) for k in "wb") and on_device([dst["w"]])
           and torch.equal(src["p"].tensor, dst["p"].tensor) and dst["step"] == 3)


def small_run(**kw):
    from course_lib.train import TrainConfig
    return TrainConfig(steps=3, n_layer=2, n_head=2, n_embd=32, block_size=16, batch_size=8,
                       optimizer="sgd", lr=0.1, **kw)


@check("train.w1", timeout=240)
def _train(rank, world, port):
    from course_lib.train import reference_losses, train
    cfg = small_run(device=device().type)
    want = reference_losses(dataclasses.replace(cfg, device="cpu"))  # drawn before init
    dist = init("nccl", rank, world, port)
    got = train(cfg, dist=dist)["losses"]
    result(ok=all(abs(a - b) <= 1e-3 * abs(b) for a, b in zip(got, want)),
           why=f"losses {got} vs the CPU reference {want}")


@check("gloo-probe.w2", world=2, timeout=150)
def _probe(rank, world, port):
    import torch
    dist = init("gloo", rank, world, port, seconds=20)

    def t(n=4):
        return torch.full((n,), float(rank + 1), device=device())
    ops = {"broadcast": lambda: dist.broadcast(t(), 0),
           "all_reduce": lambda: dist.all_reduce(t()),
           "all_gather": lambda: dist.all_gather([t() for _ in range(world)], t()),
           "reduce_scatter": lambda: dist.reduce_scatter(t(), [t() for _ in range(world)]),
           "send/recv": lambda: dist.send(t(), 1) if rank == 0 else dist.recv(t(), 0)}
    table = {}
    for name, op in ops.items():  # send/recv last: it may take the process down
        try:
            op()
            table[name] = "ok"
        except Exception as exc:  # noqa: BLE001 - reported
            table[name] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:100]}"
        print(f"PROBE {name}: {table[name]}", flush=True)
    result(ok=True, table=table)


@check("ddp.gloo.w2", world=2)
def _ddp_gloo(rank, world, port):
    dist = init("gloo", rank, world, port)
    from course_lib.ddp import DistributedDataParallel
    net = mlp()
    ref = copy.deepcopy(net)
    ddp = DistributedDataParallel(net, dist=dist, bucket_cap_mb=0.01)
    x = batch(7)
    ddp(x.chunk(world)[rank]).square().mean().backward()
    ref(x).square().mean().backward()
    grads = [p.grad for p in net.parameters()]
    result(ok=on_device(grads) and close(grads, [p.grad for p in ref.parameters()], 1e-4, 1e-6))


@check("nccl.same-gpu.w2", world=2, needs="cuda")
def _same_gpu(rank, world, port):
    import torch
    try:
        dist = init("nccl", rank, world, port, seconds=30)
        dist.all_reduce(torch.ones(4, device="cuda"))
        torch.cuda.synchronize()
        result(ok=False, why="two NCCL ranks on one GPU were accepted")
    except Exception as exc:  # noqa: BLE001 - the expected outcome
        result(ok="Duplicate GPU" in str(exc) or "invalid usage" in str(exc).lower(),
               why=str(exc).splitlines()[0][:200])


def init_own_gpu(rank, world, port, seconds=60):
    """torch.distributed with a GPU per rank (`course_lib.spawn.bind_local_gpu`, then
    "cpu:gloo,cuda:nccl" bound to it), or gloo on the CPU; returns (dist, device)."""
    import torch
    import torch.distributed as dist
    from datetime import timedelta
    from course_lib.spawn import bind_local_gpu
    mine = bind_local_gpu(rank, world) if device().type == "cuda" else None
    extra = {} if mine is None else {"device_id": mine}
    dist.init_process_group("gloo" if mine is None else "cpu:gloo,cuda:nccl",
                            init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=seconds), **extra)
    return dist, mine or torch.device("cpu")


def report_all(dist, bad):
    """Every rank's failures, reported by rank 0 (the runner reads rank 0's RESULT)."""
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, bad)
    if dist.get_rank() == 0:
        result(ok=not any(every), why="; ".join(b for rank in every for b in rank)[-600:])


@check("pipeline.gpus2", world=2, timeout=180, needs="gpus2")
def _pipeline(rank, world, port):
    """Lesson 07d's executor, every schedule at m = 1, 3 and 8, a stage per GPU: headers over
    gloo, activations and gradients over NCCL, in each pair's one order; the gradients of one
    process in float64."""
    import torch
    from course_lib import pipeline_multi as ex
    from course_lib import pipeline_schedules as sch
    dist, mine = init_own_gpu(rank, world, port)
    bad = []
    for name in sch.SCHEDULES:
        for m in (1, 3, 8):
            s = sch.make(name, world, m)
            x, y = ex.make_batch(m, 2 * m)
            _, chunks = ex.run_step(rank, s, ex.build_model(m).to(mine), x.to(mine), y.to(mine),
                                    ex.programs_for(s)[rank])
            want = ex.reference_grads(ex.build_model(m), x, y, s.n_chunks)
            got = [q.grad for c in chunks for q in c.parameters()]
            ref = [r for c in s.chunks_of(rank) for r in want[c]]
            if not (all(g is not None and g.device == mine for g in got)
                    and all(torch.allclose(g.cpu(), r, rtol=1e-10, atol=1e-10)
                            for g, r in zip(got, ref))):
                bad.append(f"{name} m={m} stage {rank}")
    report_all(dist, bad)


@check("tp.gpus2", world=2, needs="gpus2")
def _tp_bias(rank, world, port):
    """Tensor parallelism on a GPU per rank: the row-parallel bias broadcast at construction
    (NCCL refuses a CPU tensor), then the MLP against the unsplit one."""
    import torch
    dist, mine = init_own_gpu(rank, world, port)
    from course_lib.tensor_parallel import TensorParallelMLP
    torch.manual_seed(0)
    fc1, fc2 = torch.nn.Linear(32, 64).to(mine), torch.nn.Linear(64, 32).to(mine)
    tp = TensorParallelMLP.from_linears(fc1, fc2, dist=dist)
    x = batch(2).to(mine)
    y = tp(x)
    want = fc2(torch.nn.functional.gelu(fc1(x)))
    ok = y.device == mine and all(p.device == mine for p in tp.parameters()) and close(
        [y], [want], 1e-4, 1e-5)
    report_all(dist, [] if ok else [f"rank {rank}: off the GPU or off the unsplit MLP"])


@check("scratch.w2", world=2)
def _scratch(rank, world, port):
    import torch
    from course_lib import dist as scratch
    folder = os.environ["SMOKE_TMP"]
    host, p = scratch.listen()
    with open(os.path.join(folder, f"addr{rank}.tmp"), "w") as f:
        f.write(f"{host} {p}")
    os.replace(os.path.join(folder, f"addr{rank}.tmp"), os.path.join(folder, f"addr{rank}"))
    addresses = []
    for r in range(world):
        path = os.path.join(folder, f"addr{r}")
        while not os.path.exists(path):
            time.sleep(0.05)
        with open(path) as f:
            h, q = f.read().split()
        addresses.append((h, int(q)))
    scratch.init_process_group("scratch", rank=rank, world_size=world, addresses=addresses,
                               secret=bytes.fromhex(os.environ["SMOKE_SECRET"]), timeout=30)
    outcome = []
    for n in (1000, 1 << 20):  # the staging buffer's path, then the links' (shm slots)
        t = torch.full((n,), float(rank + 1), device=device())
        try:
            scratch.all_reduce(t)
            outcome.append(bool((t == 3.0).all()) and device().type == "cpu")
        except TypeError as exc:  # the host backend refuses device memory, by name
            outcome.append(device().type == "cuda" and "cuda" in str(exc))
    scratch.destroy_process_group()
    result(ok=all(outcome), why="neither the sum on the CPU nor a refusal naming cuda")


LAYOUTS = [dict(dp=4), dict(dp=4, zero=1), dict(dp=4, zero=3), dict(tp=4), dict(pp=4),
           dict(pp=4, micro_batches=4), dict(dp=2, tp=2), dict(dp=2, pp=2, micro_batches=2),
           dict(tp=2, pp=2), dict(dp=2, tp=2, zero=3)]


@check("train.layouts.gpus4", timeout=540, needs="gpus4")
def _layouts(rank, world, port):
    """Every layout of 4 ranks under torchrun, one GPU each, against one process's losses."""
    from course_lib.train import reference_losses
    from course_lib.train_loop import flags
    bad = []
    for layout in LAYOUTS:
        cfg = small_run(device=os.environ["SMOKE_DEVICE"], n_head=4, n_layer=4, **layout)
        want = reference_losses(dataclasses.replace(cfg, device="cpu"))
        with tempfile.TemporaryDirectory() as folder:
            out = os.path.join(folder, "run.json")
            cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "4",
                   "--master-port", str(port), "-m", "course_lib.train", *flags(cfg),
                   "--json", out]
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
            if proc.returncode:
                bad.append(f"{layout}: exit {proc.returncode}: {proc.stderr[-200:]}")
                continue
            with open(out) as f:
                got = json.load(f)["losses"]
        if not all(abs(a - b) <= 2e-3 * abs(b) for a, b in zip(got, want)):
            bad.append(f"{layout}: {got} vs {want}")
        print(f"PROBE {layout}: {'ok' if not bad or layout not in str(bad[-1]) else 'FAIL'}",
              flush=True)
    result(ok=not bad, why="; ".join(bad)[-600:])


def child(name, rank, world, port):
    import torch
    if device().type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    CHECKS[name][0](rank, world, port)


def run(name, tmp, device_kind):
    fn, world, timeout, _ = CHECKS[name]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "SMOKE_TMP": tempfile.mkdtemp(dir=tmp), "SMOKE_DEVICE": device_kind,
           "SMOKE_SECRET": secrets.token_hex(32), "PYTHONUNBUFFERED": "1",
           "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),
           "PYTHONPATH": os.pathsep.join(filter(None, [here, os.environ.get("PYTHONPATH")]))}
    procs = [subprocess.Popen([sys.executable, os.path.abspath(__file__), "--child", name,
                               str(r), str(world), str(port)], stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True, env=env,
                              start_new_session=True) for r in range(world)]
    start, outs = time.monotonic(), []
    for p in procs:
        try:
            outs.append(p.communicate(timeout=max(1, timeout - (time.monotonic() - start)))[0])
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            outs.append(p.communicate()[0] + f"\nTIMEOUT after {timeout}s")
    lines = [line for line in outs[0].splitlines() if line.startswith("RESULT ")]
    res = json.loads(lines[-1][7:]) if lines else {"ok": False}
    if not lines:  # the error, or how the process ended (-11: SIGSEGV)
        tail = [line for o in outs for line in o.splitlines() if line.strip()][-3:]
        res["why"] = f"exit codes {[p.returncode for p in procs]}: " + " | ".join(tail)[-300:]
    res.update(name=name, device=device_kind, seconds=round(time.monotonic() - start, 1),
               probe=[line for line in outs[0].splitlines() if line.startswith("PROBE ")])
    return res


def runnable(needs, device_kind):
    import torch
    if device_kind == "cpu":
        return needs in ("any", "gpus2")
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    return {"any": gpus >= 1, "cuda": gpus >= 1, "gpus2": gpus >= 2, "gpus4": gpus >= 4}[needs]


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "--child":
        return child(argv[1], int(argv[2]), int(argv[3]), int(argv[4]))
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--only", nargs="*", help="these checks only")
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args(argv)
    import torch
    gpu = torch.cuda.is_available()
    print(f"torch {torch.__version__}, CUDA {torch.version.cuda}, "
          f"NCCL {torch.cuda.nccl.version() if gpu else None}, "
          f"{torch.cuda.device_count() if gpu else 0} x "
          f"{torch.cuda.get_device_name(0) if gpu else 'no GPU'}, device {args.device}",
          flush=True)
    if args.device == "cuda" and not gpu:
        print("no GPU here: run with --device cpu for the CPU checks")
        return 2
    unknown = set(args.only or ()) - CHECKS.keys()
    if unknown:
        ap.error(f"unknown checks {sorted(unknown)}; known: {', '.join(CHECKS)}")
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.only or CHECKS:
            if not runnable(CHECKS[name][3], args.device):
                print(f"SKIP {name} (needs {CHECKS[name][3]})", flush=True)
                continue
            r = run(name, tmp, args.device)
            results.append(r)
            why = "" if r["ok"] else r.get("why", "")
            print(f"{'PASS' if r['ok'] else 'FAIL'} {name} ({r['seconds']}s) {why}", flush=True)
            for line in r["probe"]:
                print("    " + line)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    failed = sum(not r["ok"] for r in results)
    print(f"{len(results) - failed} passed, {failed} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
