"""DDP parity: our DistributedDataParallel vs one process on the whole batch and vs torch DDP."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from course_lib.spawn import spawn

IN, HIDDEN, OUT = 8, 16, 3
STEPS = 20


def make_model(kind: str, seed: int) -> nn.Module:
    """A small float64 model; float64 makes the only difference the order of float additions."""
    torch.manual_seed(seed)
    if kind == "bn":
        model = nn.Sequential(nn.Linear(IN, HIDDEN), nn.BatchNorm1d(HIDDEN), nn.ReLU(),
                              nn.Linear(HIDDEN, OUT))
    else:
        model = nn.Sequential(nn.Linear(IN, HIDDEN), nn.Tanh(), nn.Linear(HIDDEN, HIDDEN),
                              nn.Tanh(), nn.Linear(HIDDEN, OUT))
    if kind == "frozen":
        model[0].weight.requires_grad_(False)
    return model.double()


def make_optimizer(kind: str, model: nn.Module) -> torch.optim.Optimizer:
    params = [p for p in model.parameters() if p.requires_grad]
    if kind == "adam":
        return torch.optim.Adam(params, lr=0.01)
    return torch.optim.SGD(params, lr=0.1)


def batch(step: int, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The global batch of a step: the same on every rank and in the reference."""
    g = torch.Generator().manual_seed(1000 + step)
    x = torch.randn(size, IN, generator=g, dtype=torch.float64)
    y = torch.randn(size, OUT, generator=g, dtype=torch.float64)
    return x, y


def train(model: nn.Module, opt: torch.optim.Optimizer, rank: int, world: int, b: int,
          micro: int = 1, steps: int = STEPS, after_backward=None,
          set_to_none: bool = True) -> None:
    """`steps` steps; rank `rank` takes its slice of each global batch of world*micro*b samples,
    in `micro` micro-batches (loss scaled by 1/micro, gradient sync only on the last one)."""
    for step in range(steps):
        x, y = batch(step, world * micro * b)
        xs, ys = x[rank::world], y[rank::world]  # strided shard, as DistributedSampler does
        for m in range(micro):
            sl = slice(m * b, (m + 1) * b)
            last = m == micro - 1
            ctx = model.no_sync() if (not last and hasattr(model, "no_sync")) else _null()
            with ctx:
                loss = nn.functional.mse_loss(model(xs[sl]), ys[sl]) / micro
                loss.backward()
        if after_backward is not None:
            after_backward()
        opt.step()
        opt.zero_grad(set_to_none=set_to_none)


class _null:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


def flat_state(model: nn.Module) -> torch.Tensor:
    """Parameters and floating buffers of `model` as one vector."""
    tensors = [p.detach().reshape(-1) for p in model.parameters()]
    tensors += [b.reshape(-1).double() for b in model.buffers()]
    return torch.cat(tensors)


def reference(kind: str, opt_kind: str, world: int, b: int, micro: int = 1) -> torch.Tensor:
    """One process trained on the whole global batch of world*micro*b samples."""
    model = make_model(kind, seed=0)
    opt = make_optimizer(opt_kind, model)
    train(model, opt, rank=0, world=1, b=world * micro * b)
    return flat_state(model)


# Float64 leaves only the order of additions: a 4-rank gloo ring sums in an order that depends
# on the message size, so differently bucketed runs round differently (~1e-16 per step), and
# Adam's normalization amplifies that to ~1e-10 after 20 steps. 1e-7 relative still misses
# nothing real: a sum instead of a mean or a lost bucket is off by order 1.
TOL = dict(rtol=1e-7, atol=1e-9)
B = 4
CASES = [("mlp", "sgd"), ("mlp", "adam"), ("frozen", "sgd"), ("bn", "sgd"), ("bn", "adam")]


class Branchy(nn.Module):
    """Uses `extra` only when told to: a parameter with no gradient on some ranks."""

    def __init__(self, use_extra: bool):
        super().__init__()
        torch.manual_seed(0)
        self.body, self.extra = nn.Linear(IN, OUT), nn.Linear(OUT, OUT)
        self.unused = nn.Linear(OUT, OUT)  # never used anywhere
        self.use_extra = use_extra
        self.double()

    def forward(self, x):
        y = self.body(x)
        return self.extra(y) if self.use_extra else y


def ddp_worker(rank: int, world: int, with_torch: bool, extras: bool) -> dict:
    """Everything that needs a process group, batched into one spawn; `extras` (the lesson's
    simpler variants, unused parameters, bad layouts) run on one world size only."""
    from course_lib import ddp as ours

    out = {}
    for kind, opt_kind in CASES:
        # Ranks start from different weights: construction must broadcast rank 0's.
        model = make_model(kind, seed=rank)
        wrapped = ours.DistributedDataParallel(model, bucket_cap_mb=0.002,
                                               first_bucket_cap_mb=0.0005)
        out["buckets", kind] = len(wrapped.buckets)
        train(wrapped, make_optimizer(opt_kind, wrapped), rank, world, B)
        out["ours", kind, opt_kind] = flat_state(model)
        if with_torch:
            tmodel = make_model(kind, seed=rank)
            tddp = nn.parallel.DistributedDataParallel(tmodel, bucket_cap_mb=0.002)
            train(tddp, make_optimizer(opt_kind, tddp), rank, world, B)
            out["torch", kind, opt_kind] = flat_state(tmodel)
    if not extras:
        return portable(out)
    # The lesson's steps without overlap: per-parameter, one flat buffer, buckets.
    for name in ("per_param", "flat", "bucketed"):
        model = make_model("mlp", seed=rank)
        ours.broadcast_coalesced(list(model.parameters()), 0, dist=ours.default_dist())
        params = list(model.parameters())
        sync = {"per_param": lambda: ours.allreduce_grads_per_param(params),
                "flat": lambda: ours.allreduce_grads_flat(params),
                "bucketed": lambda: ours.allreduce_grads_bucketed(params, 0.001)}[name]
        train(model, make_optimizer("sgd", model), rank, world, B, after_backward=sync)
        out["step", name] = flat_state(model)
    # Default bucket size: one bucket holds the whole model.
    model = make_model("mlp", seed=rank)
    wrapped = ours.DistributedDataParallel(model)
    out["buckets", "default"] = len(wrapped.buckets)
    train(wrapped, make_optimizer("sgd", wrapped), rank, world, B)
    out["ours", "mlp", "default"] = flat_state(model)
    # Gradients zeroed, not dropped: they stay the buckets' views, and the next backward (over
    # 2 micro-batches) accumulates straight into the bucket.
    model = make_model("mlp", seed=rank)
    wrapped = ours.DistributedDataParallel(model, bucket_cap_mb=0.002, first_bucket_cap_mb=0.0005)
    train(wrapped, make_optimizer("sgd", wrapped), rank, world, B // 2, micro=2,
          set_to_none=False)
    out["ours", "mlp", "zeroed"] = flat_state(model)
    out["grad_is_view"] = all(ours.is_view_of(p.grad, v)
                              for b in wrapped.buckets for p, v in zip(b.params, b.views))
    # A parameter unused on some ranks (and one unused everywhere): handled like torch's
    # find_unused_parameters=True; without the flag, a clear error instead of a hang.
    if with_torch:
        for impl in ("ours", "torch"):
            model = Branchy(use_extra=rank % 2 == 0)
            wrapped = (ours.DistributedDataParallel(model, find_unused_parameters=True)
                       if impl == "ours" else
                       nn.parallel.DistributedDataParallel(model, find_unused_parameters=True))
            train(wrapped, torch.optim.SGD(wrapped.parameters(), lr=0.1), rank, world, B,
                  steps=3)
            out[impl, "branchy"] = (flat_state(model), model.unused.weight.grad is None)
    model = Branchy(use_extra=True)
    wrapped = ours.DistributedDataParallel(model)
    try:
        wrapped(torch.ones(2, IN, dtype=torch.float64)).sum().backward()
        out["unused_error"] = None
    except RuntimeError as exc:
        out["unused_error"] = str(exc)
    # Ranks that wrap different models fail at construction, on every rank, instead of hanging.
    odd = nn.Linear(IN, OUT + (rank == world - 1)).double()
    try:
        ours.DistributedDataParallel(odd)
        out["layout_error"] = None
    except RuntimeError as exc:
        out["layout_error"] = str(exc)
    return portable(out)


def portable(out: dict) -> dict:
    """Tensors as numpy arrays: torch tensors sent through a multiprocessing queue are shared
    by file descriptor and vanish when the sending rank exits."""
    def conv(v):
        if isinstance(v, torch.Tensor):
            return v.numpy()
        if isinstance(v, tuple):
            return tuple(conv(x) for x in v)
        return v
    return {k: conv(v) for k, v in out.items()}


def as_tensor(v) -> torch.Tensor:
    return torch.as_tensor(v)


def check_parity(results: list[dict], world: int, with_torch: bool, extras: bool) -> None:
    for kind, opt_kind in CASES:
        ref = reference(kind, opt_kind, world, B)
        for rank, res in enumerate(results):
            ours = as_tensor(res["ours", kind, opt_kind])
            if with_torch:
                torch.testing.assert_close(ours, as_tensor(res["torch", kind, opt_kind]), **TOL,
                                           msg=lambda m: f"{kind}/{opt_kind} rank {rank} vs torch DDP: {m}")
            if kind != "bn":
                # BatchNorm under DDP normalizes with per-rank batch statistics, so it is not
                # the single-process model on the full batch; torch DDP is its reference.
                torch.testing.assert_close(ours, ref, **TOL,
                                           msg=lambda m: f"{kind}/{opt_kind} rank {rank} vs one process: {m}")
        assert results[0]["buckets", kind] > 1  # the small cap really splits the model
    if not extras:
        return
    ref = reference("mlp", "sgd", world, B)
    for rank, res in enumerate(results):
        assert res["buckets", "default"] == 1
        torch.testing.assert_close(as_tensor(res["ours", "mlp", "default"]), ref, **TOL)
        torch.testing.assert_close(as_tensor(res["ours", "mlp", "zeroed"]), ref, **TOL,
                                   msg=lambda m: f"zero_grad(set_to_none=False) rank {rank}: {m}")
        assert res["grad_is_view"]
        for name in ("per_param", "flat", "bucketed"):
            torch.testing.assert_close(as_tensor(res["step", name]), ref, **TOL,
                                       msg=lambda m: f"{name} rank {rank}: {m}")
        if with_torch:
            ours_state, ours_none = res["ours", "branchy"]
            torch_state, torch_none = res["torch", "branchy"]
            torch.testing.assert_close(as_tensor(ours_state), as_tensor(torch_state), **TOL)
            assert ours_none and torch_none  # unused everywhere: .grad stays None
        assert "got no gradient" in res["unused_error"] and "unused.weight" in res["unused_error"]
        # Every rank names the one rank whose model differs (the last), not just "some".
        assert f"rank(s) {len(results) - 1} of the group hold parameters" in res["layout_error"]
        assert f"(seen on rank {rank})" in res["layout_error"]


@pytest.mark.parametrize("world", [2, 4])
def test_ddp_parity_gloo(world):
    """On torch.distributed (gloo): against one process and against torch DDP, side by side."""
    results = spawn(ddp_worker, world, True, world == 2, backend="gloo", timeout=120)
    check_parity(results, world, with_torch=True, extras=world == 2)


@pytest.mark.parametrize("world", [2, 4])
def test_ddp_parity_scratch(world):
    """On course_lib.dist: against one process (torch DDP needs torch.distributed)."""
    results = spawn(ddp_worker, world, False, world == 2, backend="scratch", timeout=120)
    check_parity(results, world, with_torch=False, extras=world == 2)


class RecordingDist:
    """A one-rank `dist`-like object that records each all_reduce (no process group needed)."""

    def __init__(self):
        self.calls: list[int] = []

    def get_world_size(self, group=None):
        return 1

    def get_rank(self, group=None):
        return 0

    def broadcast(self, tensor, src, group=None, async_op=False):
        return None

    def all_gather(self, tensor_list, tensor, group=None, async_op=False):
        tensor_list[0].copy_(tensor)

    def all_reduce(self, tensor, op=None, group=None, async_op=False):
        self.calls.append(tensor.numel())
        return _Done() if async_op else None


class _Done:
    def wait(self):
        return True


class Backwards(nn.Module):
    """Uses its layers in the reverse of registration order, so gradients arrive first-to-last."""

    def __init__(self):
        super().__init__()
        self.a, self.b, self.c = nn.Linear(2, 1), nn.Linear(3, 2), nn.Linear(4, 3)

    def forward(self, x):
        return self.a(self.b(self.c(x)))


def test_make_buckets_reverse_order_caps_and_dtypes():
    from course_lib.ddp import MiB, make_buckets

    params = [torch.zeros(MiB // 4 // 2) for _ in range(5)]  # 0.5 MiB each in float32
    names = {id(p): i for i, p in enumerate(params)}
    got = [[names[id(p)] for p in b] for b in make_buckets(params, 1.0, first_bucket_cap_mb=0.5)]
    assert got == [[4], [3, 2], [1, 0]]
    assert len(make_buckets(params, 25.0)) == 2  # 1 MiB first bucket, then the rest
    mixed = [torch.zeros(3), torch.zeros(3, dtype=torch.float64), torch.zeros(3)]
    assert [len(b) for b in make_buckets(mixed, 25.0)] == [1, 1, 1]
    with pytest.raises(ValueError, match="positive"):
        make_buckets(params, 0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_stage_grad_rounds_as_torchs_reducer(dtype):
    """A staged slice is torch's DDP's product grad * (1 / world) (its reducer's mul_out by a
    wrapped scalar), bit for bit, copied or in place; within one rounding of grad / world; zeros
    for no gradient; the gradient copied from is left as it was."""
    from course_lib.ddp import stage_grad

    g = torch.Generator().manual_seed(0)
    for divisor in (1, 2, 3, 4, 7):
        grad = torch.randn(64, 3, generator=g, dtype=torch.float64).to(dtype)
        before = grad.clone()
        flat = torch.full((2 * grad.numel(),), 5.0, dtype=dtype)
        view, own = flat[:grad.numel()].view_as(grad), flat[grad.numel():].view_as(grad)
        stage_grad(grad, view, divisor)
        own.copy_(grad)
        stage_grad(own, own, divisor)  # a gradient accumulated straight into its slice
        expected = grad * (1 / divisor)
        assert torch.equal(view, expected) and torch.equal(own, expected), (dtype, divisor)
        assert torch.equal(grad, before)
        ulp = torch.finfo(dtype).eps * (grad / divisor).abs()
        assert ((view.double() - (before.double() / divisor)).abs() <= ulp.double()).all()
        stage_grad(None, view, divisor)
        assert torch.equal(view, torch.zeros_like(view))


def test_buckets_launch_in_bucket_order_whatever_order_gradients_arrive():
    from course_lib.ddp import DistributedDataParallel, buckets_to_launch

    assert buckets_to_launch(0, [False, True, True]) == []
    assert buckets_to_launch(0, [True, False, True]) == [0]
    assert buckets_to_launch(1, [True, True, True]) == [1, 2]
    torch.manual_seed(0)
    model = Backwards()
    rec = RecordingDist()
    wrapped = DistributedDataParallel(model, bucket_cap_mb=1e-6, first_bucket_cap_mb=1e-6,
                                      dist=rec)
    assert [b.params for b in wrapped.buckets] == [[p] for p in reversed(list(model.parameters()))]
    rec.calls.clear()
    wrapped(torch.randn(2, 4)).sum().backward()
    # Bucket 0 holds c.bias (registered last), whose gradient arrives last here: launching as
    # buckets complete would start with a's; in bucket order it is c.bias, c.weight, b..., a...
    assert rec.calls == [3, 12, 2, 6, 1, 2]
    names = [n for n, _, _ in wrapped.timeline]
    assert names[:2] == ["forward", "backward"] and names[-1] == "wait"
    assert names.count("bucket 0") == 1 and len(names) == 3 + len(wrapped.buckets)
    assert wrapped.exposed_comm_seconds() >= 0


def test_no_sync_skips_communication_and_bad_models_fail_clearly():
    from course_lib.ddp import DistributedDataParallel

    rec = RecordingDist()
    wrapped = DistributedDataParallel(nn.Linear(3, 1), dist=rec)
    rec.calls.clear()
    with wrapped.no_sync():
        wrapped(torch.ones(1, 3)).sum().backward()
    assert rec.calls == []
    wrapped(torch.ones(1, 3)).sum().backward()
    assert rec.calls == [4]
    frozen = nn.Linear(3, 1).requires_grad_(False)
    with pytest.raises(ValueError, match="no parameter that requires grad"):
        DistributedDataParallel(frozen, dist=rec)
    with pytest.raises(TypeError, match="wraps an nn.Module"):
        DistributedDataParallel(lambda x: x, dist=rec)


def where_buckets_live_worker(rank: int, world: int) -> dict:
    """DDP on the world, then through a CountingDist bound to the sub-group of ranks
    0..world-2, as the graders run learners' code (the last rank sits out): where its buckets
    live, what it sends, and the parameters after training."""
    from course_lib import ddp as ours
    from course_lib import dist
    from course_lib.counting import CountingDist
    from course_lib.dist import symmetric
    from course_lib.dist.group import resolve

    out = {}
    model = make_model("mlp", seed=rank)
    wrapped = ours.DistributedDataParallel(model, bucket_cap_mb=0.002, first_bucket_cap_mb=0.0005)
    out["world shared"] = [symmetric.holds(resolve(None, "test"), b.flat) is not None
                           for b in wrapped.buckets]
    train(wrapped, make_optimizer("sgd", wrapped), rank, world, B)
    out["world state"] = flat_state(model)
    sub = dist.new_group(list(range(world - 1)))
    if rank == world - 1:
        return portable(out)
    counting = CountingDist(dist, sub)  # group=None in every call now means `sub`
    model = make_model("mlp", seed=rank)
    wrapped = ours.DistributedDataParallel(model, bucket_cap_mb=0.002, first_bucket_cap_mb=0.0005,
                                           dist=counting)
    out["sub shared"] = [symmetric.holds(sub, b.flat) is not None for b in wrapped.buckets]
    counting.reset()
    train(wrapped, make_optimizer("sgd", wrapped), rank, world - 1, B)
    out["sub calls"] = (dict(counting.calls), len(wrapped.buckets))
    out["sub state"] = flat_state(model)
    return portable(out)


def test_ddp_asks_its_dist_for_shared_buckets_on_its_own_group():
    """On our dist every bucket lives in shared memory (all_reduce reads it in place), also
    through a CountingDist bound to a sub-group, which must allocate on that group: allocating
    on the world there would wait for the rank that sits out. Results still equal one process."""
    world = 3
    results = spawn(where_buckets_live_worker, world, backend="scratch", timeout=30)
    for rank, res in enumerate(results):
        assert len(res["world shared"]) > 1 and all(res["world shared"]), rank
        torch.testing.assert_close(as_tensor(res["world state"]),
                                   reference("mlp", "sgd", world, B), **TOL)
        if rank == world - 1:
            continue
        assert len(res["sub shared"]) > 1 and all(res["sub shared"]), rank
        calls, buckets = res["sub calls"]
        assert calls == {"all_reduce": STEPS * buckets}, calls
        torch.testing.assert_close(as_tensor(res["sub state"]),
                                   reference("mlp", "sgd", world - 1, B), **TOL)
