"""Symmetric memory (`dist.shared_zeros`): all_reduce on buffers that every rank maps.

Parity with plain single-process PyTorch on 2, 3 and 4 ranks (tolerances as in
test_dist_collectives: floats rtol=atol=1e-5 for float32, 1e-12 for float64, integers exact),
every rank ending with the same bits; the shared path must be the one taken (the flight
recorder's algorithm), and DDP must put its buckets there. Bad input and a missing or dead peer
get an error naming the ranks, never a hang.
"""

from __future__ import annotations

import json
import os

import pytest
import torch

from course_lib.spawn import SpawnError, spawn
from outcome import record_outcome  # tests/ is on sys.path
from test_dist_collectives import make, reference, same  # tests/ is on sys.path

SIZES = [1, 3, 1001, 70001]  # 1 and 3: fewer elements than ranks, some chunks empty
DTYPES = [torch.float32, torch.float64, torch.int64]


def last_algorithm() -> str | None:
    from course_lib import dist
    return dist.flight_record()["groups"]["0"]["entries"][-1]["algorithm"]


def check_parity(rank: int, world: int) -> list[str]:
    from course_lib import dist
    from course_lib.dist import ReduceOp

    failures = []
    for dtype in DTYPES:
        for n in SIZES:
            buf = dist.shared_zeros(n, dtype=dtype)
            if not torch.equal(buf, torch.zeros(n, dtype=dtype)):
                failures.append(f"{dtype} {n}: not zeros at allocation")
            for salt, op in enumerate((ReduceOp.SUM, ReduceOp.AVG, ReduceOp.MAX, ReduceOp.SUM)):
                inputs = [make(r, n, dtype, salt) for r in range(world)]
                buf.copy_(inputs[rank])
                dist.all_reduce(buf, op=op)
                if last_algorithm() != "shared":
                    failures.append(f"{dtype} {n} {op}: took {last_algorithm()}, not shared")
                if not same(buf, reference(inputs, op)):
                    failures.append(f"{dtype} {n} {op}: wrong result")
                # every rank holds the same bits: each chunk was reduced once, then copied
                mine = buf.clone()
                theirs = [torch.empty_like(mine) for _ in range(world)]
                dist.all_gather(theirs, mine)
                if not all(torch.equal(t, mine) for t in theirs):
                    failures.append(f"{dtype} {n} {op}: ranks differ")
    # async, as DDP calls it, on two buffers in flight at once
    a, b = dist.shared_zeros(5000), dist.shared_zeros(7)
    a.fill_(rank + 1)
    b.fill_(10 * (rank + 1))
    works = [dist.all_reduce(a, async_op=True), dist.all_reduce(b, async_op=True)]
    for w in works:
        w.wait()
    total = world * (world + 1) // 2
    if not (torch.all(a == total) and torch.all(b == 10 * total)):
        failures.append("async all_reduces on two shared buffers gave wrong sums")
    # a slice of a shared buffer, or a plain tensor, takes the messages
    part = a[:100].fill_(1.0)
    dist.all_reduce(part)
    if last_algorithm() == "shared" or not torch.all(part == world):
        failures.append("a slice of a shared buffer went the shared way, or summed wrong")
    return failures


@pytest.mark.parametrize("world", [2, 3, 4])
def test_shared_all_reduce_equals_single_process(world):
    results = spawn(check_parity, world, backend="scratch", timeout=240)
    assert results == [[]] * world, results


def check_sub_group_and_files(rank: int, world: int) -> dict:
    """A sub-group's buffer, the files left in /dev/shm, and the shared algorithm by name."""
    from course_lib import dist

    out = {}
    sub = dist.new_group([1, 2])
    if rank in (1, 2):
        buf = dist.shared_zeros(1000, group=sub)
        buf.fill_(rank)
        dist.all_reduce(buf, group=sub, algorithm="shared")
        out["sub_sum"] = buf.unique().tolist()
        out["sub_shared"] = buf.data_ptr() in sub.shared
    dist.barrier()
    with open("/proc/self/maps") as f:  # every file we map is gone from /dev/shm by now
        mapped = [line.split(maxsplit=5)[-1].strip() for line in f if "course_lib-dist-" in line]
    out["mapped"] = len(mapped)
    out["not_unlinked"] = [m for m in mapped if not m.endswith("(deleted)")]
    try:
        dist.all_reduce(torch.ones(4), algorithm="shared")
        out["plain_as_shared"] = None
    except ValueError as exc:
        out["plain_as_shared"] = str(exc)
    try:
        dist.shared_zeros(10 + rank)
        out["mismatch"] = None
    except ValueError as exc:
        out["mismatch"] = str(exc)
    for bad in ((3, 4), 2.5):  # refused before any communication, on every rank alike
        try:
            dist.shared_zeros(bad)
            out[f"bad {bad}"] = None
        except TypeError as exc:
            out[f"bad {bad}"] = str(exc)
    return out


def test_sub_group_buffers_no_files_left_and_clear_errors():
    results = spawn(check_sub_group_and_files, 3, backend="scratch", timeout=120)
    for rank, out in enumerate(results):
        assert out["mapped"] and out["not_unlinked"] == [], out  # unlinked once all mapped
        assert "not a whole buffer from dist.shared_zeros" in out["plain_as_shared"], out
        assert f"rank {rank}: shared_zeros: ranks [1, 2] asked for a size or dtype other " \
               "than rank 0's" in out["mismatch"], out
        for bad in ("(3, 4)", "2.5"):
            assert f"size is a number of elements (the buffer is 1-D), got {bad}" in \
                out[f"bad {bad}"], out
    for rank in (1, 2):
        assert results[rank]["sub_sum"] == [3.0] and results[rank]["sub_shared"], results[rank]


def check_without_shm(rank: int, world: int) -> dict:
    from course_lib import dist
    from course_lib.dist import group

    buf = dist.shared_zeros(100)
    buf.fill_(rank + 1)
    dist.all_reduce(buf)
    return {"shared": buf.data_ptr() in group._world.shared, "algorithm": last_algorithm(),
            "sum": buf.unique().tolist()}


def test_without_shared_memory_every_rank_gets_an_ordinary_tensor(monkeypatch):
    monkeypatch.setenv("COURSE_DIST_SHM", "0")  # links are plain TCP: nothing can be mapped
    for out in spawn(check_without_shm, 2, backend="scratch", timeout=60):
        assert out == {"shared": False, "algorithm": "tree", "sum": [3.0]}, out


def one_rank_cannot(rank: int, world: int) -> list:
    """Rank 1 cannot create its file, then cannot map a peer's: every rank falls back alike."""
    from course_lib import dist
    from course_lib.dist import group, shm, symmetric

    out = []
    real_create, real_map = symmetric._create, shm.map_file
    for trouble in ("create", "map"):
        if rank == 1 and trouble == "create":
            symmetric._create = lambda g, nbytes: (None, None)  # as if /dev/shm were full here
        if rank == 1 and trouble == "map":
            def refuse(name, nbytes, create, writable=True):
                if not create:
                    raise OSError("cannot map")
                return real_map(name, nbytes, create, writable)
            shm.map_file = refuse
        buf = dist.shared_zeros(1000)
        symmetric._create, shm.map_file = real_create, real_map
        buf.fill_(rank + 1)
        dist.all_reduce(buf)
        out.append((buf.data_ptr() in group._world.shared, buf.unique().tolist()))
    return out


def test_when_one_rank_cannot_share_every_rank_gets_an_ordinary_tensor():
    for out in spawn(one_rank_cannot, 3, backend="scratch", timeout=60):
        assert out == [(False, [6.0]), (False, [6.0])], out


def absent_peer(rank: int, world: int, outdir: str, how: str) -> None:
    """Rank 1 never joins the all_reduce: it waits, or dies; rank 0 must raise, naming it."""
    import time

    from course_lib import dist

    g = dist.new_group([0, 1], timeout=3.0)
    buf = dist.shared_zeros(1000, group=g)
    if rank == 1:
        time.sleep(0.5)  # rank 0 is waiting in the all_reduce by now
        if how == "dies":
            os._exit(17)
        time.sleep(7.5)
        return
    record_outcome(lambda: dist.all_reduce(buf, group=g), outdir, 0)


@pytest.mark.parametrize("how", ["waits", "dies"])
def test_a_missing_peer_is_named_not_waited_for_forever(tmp_path, how):
    if how == "dies":
        with pytest.raises(SpawnError) as info:
            spawn(absent_peer, 2, str(tmp_path), how, backend="scratch", timeout=60)
        assert set(info.value.failures) == {1}, info.value
    else:
        spawn(absent_peer, 2, str(tmp_path), how, backend="scratch", timeout=60)
    result = json.loads((tmp_path / "rank0.json").read_text())
    assert result["error"] is not None, result
    assert "rank 0: all_reduce(shared) from rank 1 failed" in result["error"], result
    if how == "waits":
        assert result["type"] == "DistTimeoutError" and "timed out after 3.0s" in result["error"]
        assert result["elapsed"] < 8, result
    else:
        assert result["elapsed"] < 3, result  # the closed link is noticed before the timeout


def ddp_buckets(rank: int, world: int) -> dict:
    from torch import nn

    from course_lib import ddp
    from course_lib.dist import group

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    reference = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    reference.load_state_dict(model.state_dict())
    wrapped = ddp.DistributedDataParallel(model, bucket_cap_mb=0.0002, first_bucket_cap_mb=None)
    opt = torch.optim.SGD(wrapped.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    x = [torch.randn(6, 8, generator=torch.Generator().manual_seed(r)) for r in range(world)]
    for _ in range(3):
        wrapped(x[rank]).square().mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        ref_opt.zero_grad()
        sum(reference(xr).square().mean() for xr in x).div(world).backward()
        ref_opt.step()
    err = max((p - q).abs().max().item() for p, q in zip(model.parameters(),
                                                        reference.parameters()))
    return {"buckets": len(wrapped.buckets),
            "shared": all(b.flat.data_ptr() in group._world.shared for b in wrapped.buckets),
            "max_err": err}


@pytest.mark.parametrize("world", [2, 3])
def test_ddp_buckets_are_shared_and_training_matches_one_process(world):
    for out in spawn(ddp_buckets, world, backend="scratch", timeout=120):
        assert out["buckets"] > 1 and out["shared"], out
        assert out["max_err"] < 1e-6, out  # float32, three SGD steps
