"""ZeRO-1, ZeRO-2 and ZeRO-3 (fully_shard) against one process on the whole batch.

One spawn per (backend, world size) trains every stage with every optimizer for 10 steps on a
model with uneven shapes, a frozen parameter and tied weights, in float64; the parameters must
equal one process's to rtol 1e-9. The same spawns count state bytes and communication (scratch),
run torch's counterparts (gloo, world 2) and feed bad input (scratch, world 3): each test below
reads its part of the results, so the file starts 6 process groups, not 11.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

from course_lib import zero
from course_lib.spawn import SpawnError, spawn

STEPS, B, IN = 10, 3, 15
TOL = dict(rtol=1e-9, atol=1e-12)
OPTIMIZERS = {
    "sgd": (torch.optim.SGD, dict(lr=0.05, momentum=0.9)),
    "adam": (torch.optim.Adam, dict(lr=0.01)),
    "adamw": (torch.optim.AdamW, dict(lr=0.01, weight_decay=0.1)),
}


class Block(nn.Module):
    def __init__(self, width: int = IN):
        super().__init__()
        self.fc = nn.Linear(width, width)

    def forward(self, h):
        return torch.tanh(self.fc(h))


class Net(nn.Module):
    """Uneven shapes (7, 15), (15, 3), (16, 17); a frozen parameter; an input and output layer
    sharing one weight; a parameter used twice in one forward; two blocks to shard as units."""

    def __init__(self):
        super().__init__()
        self.w1 = nn.Parameter(torch.randn(7, 15) * 0.3)
        self.w2 = nn.Parameter(torch.randn(15, 3) * 0.3)
        self.w3 = nn.Parameter(torch.randn(16, 17) * 0.3)
        self.frozen = nn.Parameter(torch.randn(IN) * 0.1, requires_grad=False)
        self.inp = nn.Linear(IN, IN)
        self.out = nn.Linear(IN, IN, bias=False)
        self.out.weight = self.inp.weight
        self.blocks = nn.Sequential(Block(), Block())

    def forward(self, x):
        h = torch.tanh(x @ self.w1.T) @ self.w1 + self.frozen
        h = self.blocks(self.inp(h))
        z = self.out(h)
        return z @ self.w2 + (torch.tanh(torch.cat([z, h[:, :1]], 1)) @ self.w3)[:, :3]


def make_net(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return Net().double()


def batch(step: int, size: int):
    g = torch.Generator().manual_seed(500 + step)
    return (torch.randn(size, IN, generator=g, dtype=torch.float64),
            torch.randn(size, 3, generator=g, dtype=torch.float64))


def trainable(model):
    return [p for p in model.parameters() if p.requires_grad]


def reference(opt_name: str, world: int) -> dict:
    model = make_net()
    cls, kw = OPTIMIZERS[opt_name]
    opt = cls(trainable(model), **kw)
    for step in range(STEPS):
        x, y = batch(step, world * B)
        opt.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _train(model, opt, rank, world):
    for step in range(STEPS):
        x, y = batch(step, world * B)
        opt.zero_grad()
        nn.functional.mse_loss(model(x[rank::world]), y[rank::world]).backward()
        opt.step()


def run_stages(rank: int, world: int) -> dict:
    from course_lib import zero
    from course_lib.backend import default_dist

    out = {}
    for opt_name, (cls, kw) in OPTIMIZERS.items():
        for stage in (1, 2):
            model = make_net(seed=rank)  # different on each rank: construction broadcasts rank 0's
            opt = zero.ZeroRedundancyOptimizer(model.parameters(), cls, stage=stage, **kw)
            _train(model, opt, rank, world)
            out[stage, opt_name] = {k: v.numpy().copy() for k, v in model.state_dict().items()}
        model = make_net(seed=rank)
        for block in model.blocks:
            zero.fully_shard(block)
        zero.fully_shard(model)
        opt = cls(model.parameters(), **kw)
        _train(model, opt, rank, world)
        full = zero.full_state_dict(model, rank0_only=False)
        out[3, opt_name] = {k: v.numpy().copy() for k, v in full.items()}
        pieces = zero.sharded_state_dict(model)
        out["pieces", opt_name] = {k: (v.tensor.numpy().copy(), v.offset, tuple(v.shape))
                                   for k, v in pieces.items() if isinstance(v, zero.Piece)}
    out["dist"] = type(default_dist()).__name__
    return out


def run_on_sub_group(rank: int, world: int) -> dict | None:
    """ZeRO-1, -2 and -3 on global ranks 1 and 3 only, passed as `group`."""
    from course_lib import zero
    from course_lib.backend import default_dist

    group = default_dist().new_group([1, 3])
    if rank not in (1, 3):
        return None
    me, cls, kw = [1, 3].index(rank), *OPTIMIZERS["adam"]
    out = {}
    for stage in (1, 2, 3):
        model = make_net(seed=0 if rank == 1 else 7)  # the group's first rank is global rank 1
        if stage == 3:
            for block in model.blocks:
                zero.fully_shard(block, group=group)
            zero.fully_shard(model, group=group)
            opt = cls(model.parameters(), **kw)
        else:
            opt = zero.ZeroRedundancyOptimizer(model.parameters(), cls, stage=stage, group=group,
                                               **kw)
        _train(model, opt, me, 2)
        state = (zero.full_state_dict(model, rank0_only=False) if stage == 3
                 else model.state_dict())
        out[stage] = {k: v.numpy().copy() for k, v in state.items()}
    return out


def run_all(rank: int, world: int, backend: str) -> dict:
    out = {"stages": run_stages(rank, world)}
    if world == 4:
        out["sub group"] = run_on_sub_group(rank, world)
    if backend == "scratch":
        out["accounting"] = run_accounting(rank, world)
    if backend == "scratch" and world == 3:
        out["bad"] = run_bad_inputs(rank, world)
    return out


_RUNS: dict = {}


def results_for(backend: str, world: int, part: str) -> list:
    """Each rank's results of `part`, from the one spawn of (backend, world) this file makes."""
    if (backend, world) not in _RUNS:
        _RUNS[backend, world] = spawn(run_all, world, backend, backend=backend, timeout=300)
    return [res[part] for res in _RUNS[backend, world]]


# gloo on 2 and 4 ranks (the spawns the torch comparison and the sub-group test make anyway);
# the odd world size on our transport, where uneven shards and padding are ours to get right.
@pytest.mark.parametrize("backend,world", [("scratch", 2), ("scratch", 3), ("scratch", 4),
                                           ("gloo", 2), ("gloo", 4)])
def test_every_stage_equals_one_process(backend, world):
    results = results_for(backend, world, "stages")
    for opt_name in OPTIMIZERS:
        ref = reference(opt_name, world)
        for stage in (1, 2, 3):
            for rank, res in enumerate(results):
                got = res[stage, opt_name]
                assert set(got) == set(ref), (stage, opt_name, set(got) ^ set(ref))
                for name, want in ref.items():
                    torch.testing.assert_close(
                        torch.as_tensor(got[name]), want, **TOL,
                        msg=lambda m: f"ZeRO-{stage} {opt_name} rank {rank} {name}: {m}")
        # The sharded state dict's pieces tile every sharded parameter exactly once.
        for name, want in ref.items():
            owners = [res["pieces", opt_name][name] for res in results
                      if name in res["pieces", opt_name]]
            if not owners:
                continue  # not sharded (a buffer, or a parameter outside every unit)
            flat = torch.full((want.numel(),), float("nan"), dtype=want.dtype)
            for values, offset, shape in owners:
                assert shape == tuple(want.shape)
                assert flat[offset:offset + len(values)].isnan().all(), f"{name}: overlap"
                flat[offset:offset + len(values)] = torch.as_tensor(values)
            torch.testing.assert_close(flat.view_as(want), want, **TOL)


# --- memory and communication: fp32 Adam, counted from storages and from the collectives ---

D, UNITS = 33, 4  # 4 blocks of 33*33 + 33 = 1122 parameters each


def blocks_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[Block(D) for _ in range(UNITS)])


def _peak_sampler(zero, model, opt, peaks: list):
    """Sample the state bytes right after every point where ZeRO's memory grows."""
    def total():
        return sum(zero.state_bytes(model, opt).values())

    def after(cls, name):
        original = getattr(cls, name)

        def wrapped(self, *args, **kwargs):
            out = original(self, *args, **kwargs)
            peaks.append(total())
            return out
        setattr(cls, name, wrapped)
        return lambda: setattr(cls, name, original)
    return [after(zero._FlatParam, "wait_gather"), after(zero.FSDPUnit, "_on_grad"),
            after(zero._Bucket, "launch_reduce")]


def run_accounting(rank: int, world: int) -> dict:
    from course_lib import zero
    from course_lib.backend import default_dist
    from course_lib.counting import CountingDist
    from course_lib.ddp import DistributedDataParallel

    out = {}
    for variant in ("ddp", "zero1", "zero2", "zero3"):
        counting = CountingDist(default_dist())
        model = blocks_model()
        if variant == "ddp":
            model = DistributedDataParallel(model, dist=counting)
            opt = torch.optim.Adam(model.parameters(), lr=1e-3)
        elif variant == "zero3":
            for block in model:
                zero.fully_shard(block, dist=counting)
            zero.fully_shard(model, dist=counting)
            opt = torch.optim.Adam(model.parameters(), lr=1e-3)
        else:
            opt = zero.ZeroRedundancyOptimizer(model.parameters(), torch.optim.Adam,
                                               stage=int(variant[-1]), dist=counting, lr=1e-3)
        peaks: list[int] = []
        prefetched: list[bool] = []
        if variant == "zero3":  # after each block's forward: is the next block's gather started?
            for block, nxt in zip(model[:-1], model[1:]):
                block.register_forward_hook(
                    lambda *_, nxt=nxt: prefetched.append(any(
                        f.gathering is not None or f.gathered for f in nxt._zero_unit.flats)))
        x = torch.randn(4, D, generator=torch.Generator().manual_seed(rank))
        for step in range(2):
            if step == 1:  # count the second step only: construction and warm-up are done
                counting.reset()
                restore = _peak_sampler(zero, model, opt, peaks)
            opt.zero_grad()
            model(x).square().mean().backward()
            opt.step()
        for undo in restore:
            undo()
        out[variant] = {"bytes": zero.state_bytes(model, opt), "peak": max(peaks, default=0),
                        "prefetched": prefetched,
                        "sent": counting.sent_bytes(), "calls": dict(counting.calls)}
    return out


def padded(n: int, world: int) -> int:
    return -(-n // world) * world


@pytest.mark.parametrize("world", [2, 3, 4])
def test_state_bytes_and_traffic_follow_the_closed_forms(world):
    """fp32 Adam, P parameters, N ranks: DDP 16P; ZeRO-1 8P + 8P/N; ZeRO-2 4P + 12P/N;
    ZeRO-3 16P/N (padding to a multiple of N included); traffic: ZeRO-1/2 = DDP, ZeRO-3 1.5x."""
    results = results_for("scratch", world, "accounting")
    unit = D * D + D
    P, N = UNITS * unit, world
    Pp = padded(P, N)  # ZeRO-1/2: one bucket holds every parameter
    Pu = UNITS * padded(unit, N)  # ZeRO-3: each block padded on its own
    want = {
        "ddp": {"parameters": 4 * P, "gradients": 4 * P, "optimizer state": 8 * P},
        "zero1": {"parameters": 4 * Pp, "gradients": 4 * P, "optimizer state": 8 * Pp // N},
        "zero2": {"parameters": 4 * Pp, "gradients": 4 * Pp // N, "optimizer state": 8 * Pp // N},
        "zero3": {"parameters": 4 * Pu // N, "gradients": 4 * Pu // N,
                  "optimizer state": 8 * Pu // N},
    }
    closed = {"ddp": 16 * P, "zero1": 8 * P + 8 * P / N, "zero2": 4 * P + 12 * P / N,
              "zero3": 16 * P / N}
    for rank, res in enumerate(results):
        for variant, expected in want.items():
            assert res[variant]["bytes"] == expected, (variant, rank, res[variant]["bytes"])
            # padding costs at most N-1 elements per flat buffer, of every kind of state
            assert abs(sum(expected.values()) - closed[variant]) <= 16 * UNITS * (N - 1)
        ring = 2 * (N - 1) / N * 4 * P  # an all_reduce of every gradient, by the ring model
        assert res["ddp"]["sent"] == pytest.approx(ring)
        assert res["ddp"]["calls"] == {"all_reduce": 1}
        for variant in ("zero1", "zero2"):
            assert res[variant]["sent"] == pytest.approx(ring * Pp / P)
            assert res[variant]["calls"] == {"reduce_scatter": 1, "all_gather": 1}
        assert res["zero3"]["sent"] == pytest.approx(1.5 * ring * Pu / P)
        assert res["zero3"]["calls"] == {"all_gather": 2 * UNITS, "reduce_scatter": UNITS}
        # The first forward records the order; from the second on, each block's forward runs
        # while the next block's all-gather is already under way.
        assert res["zero3"]["prefetched"] == [False] * (UNITS - 1) + [True] * (UNITS - 1)
        # Peaks of parameter, gradient and optimizer state during a step, as formulas:
        sharded = sum(want["zero3"].values())
        gathered = 4 * padded(unit, N)
        # ZeRO-3: own unit and the prefetched one gathered, and at most two full gradients
        assert sharded < res["zero3"]["peak"] <= sharded + 4 * gathered
        # ZeRO-1: the full gradients and their flattened copy; ZeRO-2: only the flat copy
        for variant, extra in (("zero1", 4 * Pp + 4 * Pp // N), ("zero2", 4 * Pp + 4 * unit)):
            steady = sum(want[variant].values())
            assert steady < res[variant]["peak"] <= steady + extra, (variant, res[variant])


# --- side by side with torch's ZeroRedundancyOptimizer and FSDP2 on gloo ---


def run_torch_counterparts(rank: int, world: int) -> dict:
    import torch.distributed as tdist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard as torch_fully_shard
    from torch.distributed.optim import ZeroRedundancyOptimizer as TorchZero
    from torch.nn.parallel import DistributedDataParallel as TorchDDP

    from course_lib import zero

    out = {}
    cls, kw = OPTIMIZERS["adamw"]
    model = make_net()
    ddp = TorchDDP(model)
    opt = TorchZero(trainable(model), optimizer_class=cls, **kw)
    _train(ddp, opt, rank, world)
    out["torch zero"] = {k: v.numpy().copy() for k, v in model.state_dict().items()}
    model = make_net()
    mesh = init_device_mesh("cpu", (world,))
    for block in model.blocks:
        torch_fully_shard(block, mesh=mesh)
    torch_fully_shard(model, mesh=mesh)
    opt = cls(model.parameters(), **kw)
    _train(model, opt, rank, world)
    out["torch fsdp2"] = {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).numpy().copy()
                          for k, v in model.state_dict().items()}
    model = make_net()
    for block in model.blocks:
        zero.fully_shard(block, dist=tdist)
    zero.fully_shard(model, dist=tdist)
    opt = cls(model.parameters(), **kw)
    _train(model, opt, rank, world)
    out["ours"] = {k: v.numpy().copy() for k, v in
                   zero.full_state_dict(model, rank0_only=False).items()}
    return out


def test_ours_and_torchs_counterparts_agree_on_gloo():
    # A spawn of its own, so a crash inside torch fails this comparison only. torch's FSDP2 on
    # gloo has ended a rank with SIGSEGV inside torch once (on CI): a run that a signal ends is
    # repeated once, with its native stack shown; a wrong value is never repeated.
    try:
        results = spawn(run_torch_counterparts, 2, backend="gloo", timeout=300)
    except SpawnError as exc:
        if not exc.signals:
            raise
        warnings.warn(f"torch's counterparts crashed, repeated once:\n{exc}")
        results = spawn(run_torch_counterparts, 2, backend="gloo", timeout=300)
    ref = reference("adamw", 2)
    for rank, res in enumerate(results):
        for impl in ("ours", "torch zero", "torch fsdp2"):
            for name, want in ref.items():
                torch.testing.assert_close(torch.as_tensor(res[impl][name]), want, **TOL,
                                           msg=lambda m: f"{impl} rank {rank} {name}: {m}")


# --- bad input: a clear error, on every rank, before anything hangs ---


def run_bad_inputs(rank: int, world: int) -> dict:
    from course_lib import zero

    def error(fn):
        try:
            fn()
        except (ValueError, RuntimeError, TypeError, NotImplementedError) as exc:
            return f"{type(exc).__name__}: {exc}"
        return None

    out = {}
    odd = nn.Linear(4, 3 + (rank == world - 1))  # the last rank's model differs
    out["shapes zero"] = error(lambda: zero.ZeroRedundancyOptimizer(odd.parameters(),
                                                                    torch.optim.SGD, lr=0.1))
    out["shapes fsdp"] = error(lambda: zero.fully_shard(nn.Linear(4, 3 + (rank == world - 1))))
    typed = nn.Linear(4, 3).to(torch.float64 if rank == 0 else torch.float32)
    out["dtypes"] = error(lambda: zero.ZeroRedundancyOptimizer(typed.parameters(),
                                                               torch.optim.SGD, lr=0.1))
    out["empty"] = error(lambda: zero.ZeroRedundancyOptimizer([], torch.optim.SGD, lr=0.1))
    out["stage"] = error(lambda: zero.ZeroRedundancyOptimizer(odd.parameters(), torch.optim.SGD,
                                                              stage=3, lr=0.1))
    opt = zero.ZeroRedundancyOptimizer(nn.Linear(2, 2).parameters(), torch.optim.SGD, lr=0.1)
    out["added"] = error(lambda: opt.add_param_group({"params": [nn.Parameter(torch.ones(2))]}))
    grown = zero.fully_shard(nn.Linear(2, 2))
    grown.extra = nn.Parameter(torch.ones(2))
    out["added fsdp"] = error(lambda: grown(torch.ones(1, 2)))
    out["twice"] = error(lambda: zero.fully_shard(zero.fully_shard(nn.Linear(2, 2))))
    # More ranks than elements: some ranks hold only padding, and training is still exact.
    tiny = nn.Linear(1, 1, bias=False).double()
    torch.nn.init.constant_(tiny.weight, 0.5)
    opt = zero.ZeroRedundancyOptimizer(tiny.parameters(), torch.optim.SGD, stage=2, lr=0.1)
    x = torch.full((1, 1), float(rank + 1), dtype=torch.float64)
    tiny(x).sum().backward()
    opt.step()
    out["tiny"] = tiny.weight.item()
    small = nn.Linear(1, 1, bias=False).double()
    torch.nn.init.constant_(small.weight, 0.5)
    zero.fully_shard(small)
    opt = torch.optim.SGD(small.parameters(), lr=0.1)
    small(x).sum().backward()
    opt.step()
    out["tiny fsdp"] = zero.full_state_dict(small, rank0_only=False)["weight"].item()
    return out


def test_bad_input_gets_a_clear_error_naming_the_ranks():
    world = 3
    results = results_for("scratch", world, "bad")
    for rank, res in enumerate(results):
        for key in ("shapes zero", "shapes fsdp"):
            assert f"rank(s) {world - 1} of the group hold parameters" in res[key], res[key]
        assert "rank(s) 1, 2 of the group" in res["dtypes"]
        assert "empty parameter list" in res["empty"]
        assert "stage must be 1 or 2" in res["stage"]
        assert "cannot be added after construction" in res["added"]
        assert "changed after it was wrapped" in res["added fsdp"]
        assert "already sharded" in res["twice"]
        # d/dw of sum(w * x) is x; the mean over ranks of (rank + 1) is 2
        assert res["tiny"] == pytest.approx(0.5 - 0.1 * 2, rel=1e-12)
        assert res["tiny fsdp"] == pytest.approx(0.5 - 0.1 * 2, rel=1e-12)


@pytest.mark.parametrize("backend", ["scratch", "gloo"])
def test_every_stage_on_a_sub_group(backend):
    results = results_for(backend, 4, "sub group")
    assert results[0] is None and results[2] is None
    ref = reference("adam", 2)
    for rank in (1, 3):
        for stage, got in results[rank].items():
            for name, want in ref.items():
                torch.testing.assert_close(torch.as_tensor(got[name]), want, **TOL,
                                           msg=lambda m: f"ZeRO-{stage} rank {rank} {name}: {m}")


def test_a_weight_tied_across_sibling_units_is_an_error():
    """Two sibling units would each shard their own copy of a tied weight and untie it
    silently; the second unit says so instead (shard their common parent)."""
    from course_lib import dist as scratch

    emb = nn.Embedding(5, 4)
    head = nn.Linear(4, 5, bias=False)
    head.weight = emb.weight
    scratch.init_process_group(rank=0, world_size=1)
    try:
        zero.fully_shard(emb, dist=scratch)
        with pytest.raises(ValueError, match="also used inside another fully_shard unit"):
            zero.fully_shard(head, dist=scratch)
    finally:
        scratch.destroy_process_group()


def test_a_flat_layouts_views_hand_autograd_one_gradient_for_the_whole_buffer():
    """`views` splits the buffer once, so autograd writes its gradient in one pass (one slice
    per tensor would zero-fill a buffer-sized gradient per tensor and add them up); each
    tensor's gradient lands at its place and the padding's is zero."""
    from course_lib.sharding import FlatLayout

    layout = FlatLayout([(3, 2), (5,), (4, 4)], 4, torch.float32)  # 27 elements, padded to 28
    flat = torch.randn(layout.padded_numel, requires_grad=True)
    views = layout.views(flat)
    assert [v.shape for v in views] == layout.shapes
    assert len({v.grad_fn.next_functions[0][0] for v in views}) == 1
    sum((i + 1) * v.sum() for i, v in enumerate(views)).backward()
    expected = layout.flatten([torch.full(s, i + 1.0) for i, s in enumerate(layout.shapes)])
    assert torch.equal(flat.grad, expected)
    assert flat.grad[layout.numel:].eq(0).all()
