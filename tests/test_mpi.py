"""course_lib.mpi: MPI as a `dist`. The collectives (all_to_all's: tests/test_mpi_alltoall.py)
equal one process's results; our DDP (with
and without a compression hook) and ZeRO-1 on MPI equal one process on the whole batch; a
peer that never sends is a named error; no mpiexec is a clear error."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

from course_lib import mpi

pytestmark = pytest.mark.mpi
WORLD = 3


def make(rank: int, n: int, dtype: torch.dtype, salt: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(100 * rank + n + salt)
    if dtype == torch.bool:
        return torch.rand(n, generator=g) > 0.5
    if dtype.is_floating_point:
        return torch.randn(n, generator=g).to(dtype)
    return torch.randint(-5, 6, (n,), generator=g).to(dtype)


def check_collectives(dist, rank: int, world: int) -> list[str]:
    """Every collective and p2p call of a `dist` against what one process computes."""
    bad = []

    def expect(what, got, want, tol=0.0):
        ok = (torch.allclose(got.double(), want.double(), rtol=tol, atol=tol) if tol
              else torch.equal(got, want))
        if not ok:
            bad.append(f"rank {rank}: {what}: {got.flatten()[:4].tolist()} vs "
                       f"{want.flatten()[:4].tolist()}")

    ops = {"SUM": lambda x: x.sum(0), "MAX": lambda x: x.amax(0), "MIN": lambda x: x.amin(0),
           "PRODUCT": lambda x: x.prod(0)}
    for dtype in (torch.float64, torch.float32, torch.int64, torch.int32, torch.float16,
                  torch.bfloat16):
        inputs = [make(r, 7, dtype) for r in range(world)]
        stacked = torch.stack(inputs)
        tol = 1e-2 if dtype in (torch.float16, torch.bfloat16) else 0.0
        for name, fn in ops.items():
            t = inputs[rank].clone()
            dist.all_reduce(t, op=getattr(dist.ReduceOp, name))
            want = fn(stacked.double() if tol else stacked).to(dtype)
            expect(f"all_reduce {name} {dtype}", t, want, tol or (1e-6 if dtype.is_floating_point else 0))
        t = inputs[rank].clone()
        dist.all_reduce(t, op=dist.ReduceOp.AVG)
        want = (stacked.double().mean(0).to(dtype) if dtype.is_floating_point
                else torch.div(stacked.sum(0), world, rounding_mode="floor"))
        expect(f"all_reduce AVG {dtype}", t, want, tol or (1e-6 if dtype.is_floating_point else 0))
    flags = [make(r, 9, torch.bool) for r in range(world)]
    t = flags[rank].clone()
    dist.all_reduce(t)
    expect("all_reduce bool (or)", t, torch.stack(flags).any(0))
    full = [make(r, 12, torch.float32).view(3, 4) for r in range(world)]
    t = full[rank].clone().t()  # non-contiguous: reduced and written back in place
    work = dist.all_reduce(t, async_op=True)
    work.wait()
    expect("async all_reduce of a transpose", t, torch.stack(full).sum(0).t(), 1e-6)
    for src in range(world):
        t = full[rank].clone()
        dist.broadcast(t, src=src)
        expect(f"broadcast src={src}", t, full[src])
        t = full[rank].clone()
        dist.reduce(t, dst=src)
        expect(f"reduce dst={src}", t, torch.stack(full).sum(0) if rank == src else full[rank],
               1e-6)
    out = [torch.empty(3, 4) for _ in range(world)]
    dist.all_gather(out, full[rank])
    for i in range(world):
        expect(f"all_gather[{i}]", out[i], full[i])
    pieces = [[make(r, 5, torch.float64, salt=i) for i in range(world)] for r in range(world)]
    t = torch.empty(5, dtype=torch.float64)
    dist.reduce_scatter(t, pieces[rank])
    expect("reduce_scatter", t, sum(pieces[r][rank] for r in range(world)), 1e-12)
    got = [torch.empty(3, 4) for _ in range(world)] if rank == 1 else None
    dist.gather(full[rank], got, dst=1)
    if rank == 1:
        for i in range(world):
            expect(f"gather[{i}]", got[i], full[i])
    t = torch.empty(3, 4)
    dist.scatter(t, full if rank == 0 else None, src=0)
    expect("scatter", t, full[rank])
    # Point to point with tags: two messages to the next rank, received in the other order.
    nxt, prv = (rank + 1) % world, (rank - 1) % world
    a, b = torch.full((4,), float(rank)), torch.full((2,), 10.0 + rank)
    works = [dist.isend(a, nxt, tag=1), dist.isend(b, nxt, tag=2)]
    rb, ra = torch.empty(2), torch.empty(4)
    dist.recv(rb, prv, tag=2)
    dist.irecv(ra, prv, tag=1).wait()
    for w in works:
        w.wait()
    expect("recv tag 2", rb, torch.full((2,), 10.0 + prv))
    expect("recv tag 1", ra, torch.full((4,), float(prv)))
    # A sub-group: global ranks in src/dst, its own rank numbering.
    evens = dist.new_group([r for r in range(world) if r % 2 == 0])
    if rank % 2 == 0:
        t = torch.tensor([float(rank)])
        dist.all_reduce(t, group=evens)
        expect("all_reduce on the even ranks", t, torch.tensor([float(sum(range(0, world, 2)))]))
        if dist.get_rank(evens) != rank // 2:
            bad.append(f"rank {rank}: get_rank(evens) = {dist.get_rank(evens)}")
    dist.barrier()
    from test_mpi_alltoall import check_alltoall  # tests/ is on sys.path

    return bad + check_alltoall(dist, rank, world)


def _model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 12), nn.Tanh(), nn.Linear(12, 12), nn.Tanh(),
                         nn.Linear(12, 3)).double()


def _train(model: nn.Module, opt, rank: int, world: int, steps: int = 8) -> torch.Tensor:
    dtype = next(model.parameters()).dtype
    for step in range(steps):
        g = torch.Generator().manual_seed(step)
        x = torch.randn(4 * WORLD, 6, generator=g, dtype=torch.float64).to(dtype)
        y = torch.randn(4 * WORLD, 3, generator=g, dtype=torch.float64).to(dtype)
        nn.functional.mse_loss(model(x[rank::world]), y[rank::world]).backward()
        opt.step()
        opt.zero_grad()
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def ddp_params(rank: int, world: int, dist) -> dict[str, torch.Tensor]:
    """Our DDP (several buckets; and with the fp16 hook) and ZeRO-1 on `dist`, from ranks that
    start with different weights."""
    from course_lib import comm_hooks, zero
    from course_lib.ddp import DistributedDataParallel

    out = {}
    ddp = DistributedDataParallel(_model(rank), dist=dist, bucket_cap_mb=0.0005,
                                  first_bucket_cap_mb=0.0002)
    out["ddp"] = _train(ddp, torch.optim.Adam(ddp.parameters(), lr=0.01), rank, world)
    ddp = DistributedDataParallel(_model(rank).float(), dist=dist)
    ddp.register_comm_hook(comm_hooks.DefaultState(dist=dist), comm_hooks.fp16_compress_hook)
    out["fp16 hook"] = _train(ddp, torch.optim.SGD(ddp.parameters(), lr=0.1), rank, world)
    model = _model(rank)  # ZeRO reduces the gradients itself: a plain model, not DDP's
    opt = zero.ZeroRedundancyOptimizer(model.parameters(), torch.optim.Adam, dist=dist, lr=0.01)
    out["zero1"] = _train(model, opt, rank, world)
    return out


def reference() -> torch.Tensor:
    """One process on the whole batch: what every data-parallel run must end with."""
    model = _model(0)
    return _train(model, torch.optim.Adam(model.parameters(), lr=0.01), 0, 1)


def test_ddp_and_collectives_on_mpi_equal_one_process(tmp_path):
    """DDP and ZeRO-1 on MPI against one process on the whole batch, the reference that
    test_ddp.py and test_zero.py hold the scratch and gloo runs to (the lesson compares MPI
    and scratch directly)."""
    if why := mpi.unavailable():
        pytest.skip(why)
    from pathlib import Path

    worker = Path(__file__).with_name("mpi_worker.py")
    mpi.launch(WORLD, [str(worker), str(tmp_path)], timeout=180)
    ranks = [json.loads((tmp_path / f"rank-{r}.json").read_text()) for r in range(WORLD)]
    assert not [m for r in ranks for m in r["bad"]], [m for r in ranks for m in r["bad"]][:20]
    timeout = ranks[0]["timeout"]
    assert timeout and "rank 0: recv from with rank 1 (mpi) timed out" in timeout
    want = reference()
    for key in ("ddp", "zero1", "fp16 hook"):
        for r in ranks:
            assert r[key] == ranks[0][key], key  # every rank holds the same parameters
    for key in ("ddp", "zero1"):
        # float64: only the order of additions differs (MPI's against one process): 1e-9.
        torch.testing.assert_close(torch.tensor(ranks[0][key], dtype=torch.float64), want,
                                   rtol=1e-9, atol=1e-11, msg=key)
    # The fp16 hook: one process's SGD in float32, to float16's rounding of 3 ranks' halves.
    model = _model(0).float()
    plain = _train(model, torch.optim.SGD(model.parameters(), lr=0.1), 0, 1)
    torch.testing.assert_close(torch.tensor(ranks[0]["fp16 hook"]), plain, rtol=5e-3, atol=5e-4)


def test_mpi_without_mpiexec_is_a_clear_error(monkeypatch):
    for var in ("PMI_RANK", "PMIX_RANK", "OMPI_COMM_WORLD_RANK", "PMI_FD", "PMI_PORT",
                "HYDI_CONTROL_FD"):
        monkeypatch.delenv(var, raising=False)
    with pytest.raises(RuntimeError, match="not started by mpiexec"):
        mpi.init_process_group()
    with pytest.raises(RuntimeError, match="call init_process_group"):
        mpi.all_reduce(torch.ones(1))


def test_mpiexec_that_outlives_its_timeout_is_ended():
    if why := mpi.unavailable():
        pytest.skip(why)
    import time

    import psutil

    before = {p.pid for p in psutil.Process().children(recursive=True)}
    start = time.monotonic()
    with pytest.raises(RuntimeError, match="mpiexec -n 2 did not finish within 3s"):
        mpi.launch(2, ["-c", "import time; time.sleep(120)"], timeout=3)
    assert time.monotonic() - start < 20
    left = [p for p in psutil.Process().children(recursive=True) if p.pid not in before]
    assert psutil.wait_procs(left, timeout=5)[1] == [], left
    # The MPI ranks themselves (grandchildren, in mpiexec's own process group) are gone too:
    # looked for by their command line, only to check.
    deadline = time.monotonic() + 5
    while True:
        ranks = [p for p in psutil.process_iter(["cmdline"])
                 if "import time; time.sleep(120)" in " ".join(p.info["cmdline"] or [])]
        if not ranks or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert ranks == [], ranks
