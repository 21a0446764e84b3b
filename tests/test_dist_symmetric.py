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


def ranks_agree(t: torch.Tensor, world: int) -> bool:
    """Whether every rank holds the same bits as this one's `t`."""
    from course_lib import dist

    theirs = [torch.empty_like(t) for _ in range(world)]
    dist.all_gather(theirs, t.clone())
    return all(torch.equal(x, t) for x in theirs)


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
                if not ranks_agree(buf, world):
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


def absent_peer(rank: int, world: int, outdir: str, how: str, path: str) -> None:
    """Rank 1 never joins the all_reduce: it waits, or dies; rank 0 must raise, naming it.
    `path`: a shared buffer's all_reduce, or a staged one (after a first call both join,
    which makes the staging buffer)."""
    import time

    from course_lib import dist

    g = dist.new_group([0, 1], timeout=3.0)
    if path == "shared":
        buf = dist.shared_zeros(1000, group=g)
    else:
        dist.all_reduce(torch.ones(4), group=g)
        buf = torch.ones(1000)
    if rank == 1:
        time.sleep(0.5)  # rank 0 is waiting in the all_reduce by now
        if how == "dies":
            os._exit(17)
        last = os.path.join(outdir, "rank10.json" if path == "one_shot" else "rank0.json")
        deadline = time.monotonic() + 10.0
        while not os.path.exists(last) and time.monotonic() < deadline:
            time.sleep(0.05)  # alive, and silent, until rank 0 has recorded what it met
        return
    record_outcome(lambda: dist.all_reduce(buf, group=g), outdir, 0)
    if path == "one_shot" and how == "waits":  # out of step now: later calls say so at once
        record_outcome(lambda: dist.all_reduce(torch.ones(4), group=g), outdir, 10)


@pytest.mark.parametrize("path", ["shared", "one_shot"])
@pytest.mark.parametrize("how", ["waits", "dies"])
def test_a_missing_peer_is_named_not_waited_for_forever(tmp_path, how, path):
    if how == "dies":
        with pytest.raises(SpawnError) as info:
            spawn(absent_peer, 2, str(tmp_path), how, path, backend="scratch", timeout=60)
        assert set(info.value.failures) == {1}, info.value
    else:
        spawn(absent_peer, 2, str(tmp_path), how, path, backend="scratch", timeout=60)
    result = json.loads((tmp_path / "rank0.json").read_text())
    assert result["error"] is not None, result
    assert f"rank 0: all_reduce({path}) from rank 1 failed" in result["error"], result
    if how == "waits":
        assert result["type"] == "DistTimeoutError" and "timed out after 3.0s" in result["error"]
        assert result["elapsed"] < 8, result
    else:
        assert result["elapsed"] < 3, result  # the closed link is noticed before the timeout
    if path == "one_shot" and how == "waits":
        later = json.loads((tmp_path / "rank10.json").read_text())
        assert "an earlier all_reduce through the group's shared memory failed" in \
            later["error"] and later["elapsed"] < 1, later


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


# --- the group's staging buffer: all_reduce(algorithm="one_shot") on ordinary tensors ---------

ONE_SHOT_SIZES = [1, 1001, 40000, 70001]  # 70001 float64 (560 KB): three pieces of a half each
OPS = ["SUM", "AVG", "PRODUCT", "MIN", "MAX"]


def check_one_shot(rank: int, world: int) -> list[str]:
    """Every op and dtype against one process; the same bits on every rank; "auto" stages what
    fits a half and leaves larger tensors to the table; shapes other than 1-D come back whole."""
    from course_lib import dist
    from course_lib.dist import ReduceOp, symmetric

    failures = []
    for dtype in DTYPES:
        for n in ONE_SHOT_SIZES:
            for salt, name in enumerate(OPS):
                op = ReduceOp[name]
                inputs = [make(r, n, dtype, salt) for r in range(world)]
                if op is ReduceOp.PRODUCT:  # keep products of many values finite and exact
                    inputs = [x.sign() if dtype is torch.int64 else x.clamp(-1, 1)
                              for x in inputs]
                for algorithm in ("one_shot", "auto"):
                    t = inputs[rank].clone()
                    dist.all_reduce(t, op=op, algorithm=algorithm)
                    fits = t.nbytes <= symmetric.ONE_SHOT_MAX_BYTES
                    if algorithm == "auto" and (last_algorithm() == "one_shot") != fits:
                        failures.append(f"{dtype} {n}: auto took {last_algorithm()}")
                    if not same(t, reference(inputs, op)):
                        failures.append(f"{algorithm} {dtype} {n} {name}: wrong result")
                    if algorithm == "one_shot" and not ranks_agree(t, world):
                        failures.append(f"{dtype} {n} {name}: ranks differ")
    grid = torch.arange(12.0).view(3, 4).t() * (rank + 1)  # not contiguous, 2-D
    dist.all_reduce(grid, algorithm="one_shot")
    total = world * (world + 1) // 2
    if not torch.equal(grid, torch.arange(12.0).view(3, 4).t() * total):
        failures.append("a transposed 2-D tensor came back wrong")
    flags = torch.tensor([rank == 0, False, True])
    dist.all_reduce(flags, op=ReduceOp.MAX, algorithm="one_shot")
    if flags.tolist() != [True, False, True]:
        failures.append(f"bool MAX gave {flags.tolist()}")
    return failures


@pytest.mark.parametrize("world", [2, 3, 4])
@pytest.mark.parametrize("check", [check_parity, check_one_shot], ids=["shared", "one_shot"])
def test_all_reduce_through_shared_memory_equals_single_process(check, world):
    results = spawn(check, world, backend="scratch", timeout=300)
    assert results == [[]] * world, results


def one_shot_in_call_order(rank: int, world: int) -> dict:
    """Async calls run on the group's worker, blocking ones on the caller's thread: the staged
    calls still run in call order, and a sub-group stages through a buffer of its own."""
    from course_lib import dist

    a = [torch.full((100 + i,), float(rank + i)) for i in range(6)]
    works = []
    for i, t in enumerate(a):
        if i % 3 == 2:
            dist.all_reduce(t)
        else:
            works.append(dist.all_reduce(t, async_op=True))
    for w in works:
        w.wait()
    want = [sum(r + i for r in range(world)) for i in range(6)]
    out = {"sums": [t.unique().tolist() for t in a], "want": [[float(w)] for w in want]}
    sub = dist.new_group([0, 1])
    if rank < 2:
        t = torch.full((10,), rank + 1.0)
        dist.all_reduce(t, group=sub)
        out["sub"] = t.unique().tolist()
        out["own_buffer"] = sub.staging is not dist.group._world.staging and bool(sub.staging)
    return out


def test_staged_calls_keep_call_order_async_or_not():
    for rank, out in enumerate(spawn(one_shot_in_call_order, 3, backend="scratch", timeout=60)):
        assert out["sums"] == out["want"], out
        if rank < 2:
            assert out["sub"] == [3.0] and out["own_buffer"], out


def one_shot_mismatch(rank: int, world: int) -> dict:
    """Ranks that pass different sizes or dtypes get an error naming the peer, a dtype the wire
    has no number for a TypeError, and the group goes on."""
    from course_lib import dist

    out = {}
    for what, t in (("size", torch.ones(10 + (rank == 1))),
                    ("dtype", torch.ones(10, dtype=torch.float64 if rank == 1 else torch.float32))):
        try:
            dist.all_reduce(t, algorithm="one_shot")
            out[what] = None
        except dist.DistError as exc:
            out[what] = str(exc)
    try:
        dist.all_reduce(torch.ones(3, dtype=torch.uint16), algorithm="one_shot")
        out["uint16"] = None
    except TypeError as exc:
        out["uint16"] = str(exc)
    t = torch.full((5,), rank + 1.0)
    dist.all_reduce(t)  # the ranks stopped at the same call: still in step
    out["after"] = t.unique().tolist()
    return out


def test_mismatched_tensors_are_named_and_the_group_goes_on():
    results = spawn(one_shot_mismatch, 3, backend="scratch", timeout=60)
    for rank, out in enumerate(results):
        assert out["after"] == [6.0], out
        peer = 1 if rank != 1 else 2  # the first peer whose tensor differs, in reading order
        assert f"rank {rank}: all_reduce(one_shot) from rank {peer} failed: tensor mismatch" \
            in out["size"], out
        n = 11 if rank != 1 else 10
        assert f"rank {peer} passed {n} elements of torch.float32" in out["size"], out
        want = "torch.float64" if rank != 1 else "torch.float32"
        assert f"rank {peer} passed 10 elements of {want}" in out["dtype"], out
        assert f"rank {rank}: all_reduce(one_shot): dtype torch.uint16 has no number on the " \
               "wire" in out["uint16"], out


def one_shot_without_shm(rank: int, world: int) -> dict:
    from course_lib import dist

    t = torch.ones(10)
    dist.all_reduce(t)
    out = {"auto": last_algorithm(), "sum": t.unique().tolist()}
    try:
        dist.all_reduce(t, algorithm="one_shot")
    except ValueError as exc:
        out["one_shot"] = str(exc)
    return out


def test_one_shot_without_shared_memory_is_a_clear_error(monkeypatch):
    monkeypatch.setenv("COURSE_DIST_SHM", "0")
    for rank, out in enumerate(spawn(one_shot_without_shm, 2, backend="scratch", timeout=60)):
        assert out["auto"] == "tree" and out["sum"] == [2.0], out
        assert f"rank {rank}: all_reduce(one_shot) needs every rank of the group on this " \
               "machine" in out["one_shot"], out


def staging_cannot_be_made(rank: int, world: int) -> list:
    """Rank 1 cannot create its staging file: the first staged call sends messages instead, on
    every rank, and later calls take the table's algorithm."""
    from course_lib.dist import symmetric
    from course_lib import dist

    if rank == 1:
        symmetric._create = lambda g, nbytes: (None, None)
    out = []
    for _ in range(2):
        t = torch.full((100,), rank + 1.0)
        dist.all_reduce(t)
        out.append((last_algorithm(), t.unique().tolist()))
    return out


def test_when_the_staging_buffer_cannot_be_made_messages_carry_the_call():
    for out in spawn(staging_cannot_be_made, 3, backend="scratch", timeout=60):
        assert out == [("one_shot", [6.0]), ("tree", [6.0])], out
