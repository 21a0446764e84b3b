"""GPU bugs caught on a CPU-only CI (issue 47, gpu-audit.md section 5), in one process, no sockets:

1. Components on the `meta` device through a fake process group of 4 ranks: a buffer, bucket,
   shard or flat parameter made on the CPU behind `meta` parameters raises (cross-device copy,
   `p.data = cpu_view`, `set_` onto another device's storage), as it does behind CUDA ones;
   and nothing a component holds may leave `meta`.
2. A fake-CUDA launcher: torch.cuda and init_process_group monkeypatched, so the launch
   contract (LOCAL_RANK -> set_device before init -> NCCL for CUDA data, bound by device_id) and
   the control device (`comm_device`) are checked without a GPU; so are `spawn`'s ranks (each
   its own GPU before its group starts) and the benchmarks' clock (CUDA synchronized first).
3. A process group whose asynchronous outputs stay poisoned (NaN, or -1 for integers) until
   that work's own `wait()`, as a CUDA result is unusable until its stream wait (NCCL marks a
   future complete at enqueue): a communication hook that reads results before waiting gets
   the poison. Run under DDP with lesson 10b's hooks against the plain gradients.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as tdist
from torch import nn

from course_lib import backend



class _Done:
    """A finished Work: wait() returns, its future holds `result`."""

    def __init__(self, result):
        self.result = result

    def wait(self, timeout=None):
        return True

    def is_completed(self):
        return True

    def get_future(self):
        fut = torch.futures.Future()
        fut.set_result(self.result)
        return fut


class FakeDist:
    """A `dist`-like group of `world` ranks in one process, this one rank `rank`: every rank is
    assumed to hold what this one holds (all_gather copies this rank's tensor everywhere,
    reduce_scatter keeps this rank's chunk, all_reduce is the identity: the average of equal
    replicas, and the sum at world 1). Its backend is "fake", so control tensors stay on the
    CPU (`comm_device`)."""

    ReduceOp = tdist.ReduceOp

    def __init__(self, world=4, rank=0):
        self.world, self.rank, self.calls = world, rank, []

    def is_initialized(self):
        return True

    def get_backend(self, group=None):
        return "fake"

    def get_rank(self, group=None):
        return self.rank

    def get_world_size(self, group=None):
        return self.world

    def get_global_rank(self, group, r):
        return r

    def _done(self, name, async_op, result):
        self.calls.append(name)
        return _Done(result) if async_op else None

    def broadcast(self, tensor, src=0, group=None, async_op=False):
        return self._done("broadcast", async_op, [tensor])

    def all_reduce(self, tensor, op=None, group=None, async_op=False):
        if self.world > 1 and op in (None, tdist.ReduceOp.SUM) and tensor.device.type == "cpu":
            tensor.mul_(self.world)  # the sum of equal replicas (meta has no data to scale)
        return self._done("all_reduce", async_op, [tensor])

    def all_gather(self, tensor_list, tensor, group=None, async_op=False):
        for t in tensor_list:
            t.copy_(tensor)
        return self._done("all_gather", async_op, tensor_list)

    def reduce_scatter(self, output, input_list, op=None, group=None, async_op=False):
        output.copy_(input_list[self.rank])
        if self.world > 1 and op in (None, tdist.ReduceOp.SUM) and output.device.type == "cpu":
            output.mul_(self.world)
        return self._done("reduce_scatter", async_op, [output])

    def barrier(self, group=None, async_op=False):
        return self._done("barrier", async_op, [])


def mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 16), nn.GELU(),
                         nn.Linear(16, 4))


def on_meta():
    with torch.device("meta"):
        return mlp()


def assert_on_meta(tensors, what):
    off = [f"{what}[{i}] on {t.device}" for i, t in enumerate(tensors)
           if t is not None and t.device.type != "meta"]
    assert not off, "left the model's device: " + ", ".join(off)


# -- 1. components on meta ------------------------------------------------------------------------


def test_ddp_keeps_meta_parameters_gradients_and_buckets_on_their_device():
    from course_lib.ddp import DistributedDataParallel

    net = on_meta()
    ddp = DistributedDataParallel(net, dist=FakeDist(), bucket_cap_mb=0.001)
    ddp(torch.randn(4, 8, device="meta")).sum().backward()
    assert_on_meta([p for p in net.parameters()], "parameter")
    assert_on_meta([p.grad for p in net.parameters()], "grad")
    assert_on_meta([b.flat for b in ddp.buckets], "bucket")


@pytest.mark.parametrize("stage", [1, 2])
def test_zero_keeps_a_meta_model_on_meta(stage):
    from course_lib.zero import ZeroRedundancyOptimizer

    net = on_meta()
    opt = ZeroRedundancyOptimizer(net.parameters(), torch.optim.SGD, stage=stage,
                                  dist=FakeDist(), lr=0.1)
    net(torch.randn(4, 8, device="meta")).sum().backward()
    opt.step()
    assert_on_meta(list(net.parameters()), "parameter")
    assert_on_meta([b.flat for b in opt.buckets] + [b.shard for b in opt.buckets], "flat/shard")


def test_fully_shard_keeps_a_meta_model_on_meta():
    from course_lib.zero import fully_shard

    net, dist = on_meta(), FakeDist()
    for i in (0, 2):
        fully_shard(net[i], dist=dist)
    fully_shard(net, dist=dist)
    net(torch.randn(4, 8, device="meta")).sum().backward()
    assert_on_meta(list(net.parameters()), "parameter (shard)")
    assert_on_meta([p.grad for p in net.parameters()], "shard grad")


class MailDist(FakeDist):
    """Point-to-point between FakeDists of one process: a send posts (src, dst, tag, tensor)
    to a shared mailbox, a receive copies the first match into its buffer (an irecv when its
    work is waited on). Every tensor handed over is logged as (call, dtype, device)."""

    def __init__(self, world, rank, mailbox, log):
        super().__init__(world, rank)
        self.mailbox, self.log = mailbox, log

    def isend(self, tensor, dst, group=None, tag=0):
        self.log.append(("send", tensor.dtype, tensor.device.type))
        self.mailbox.append((self.rank, dst, tag, tensor))
        return _Done([tensor])

    def _take(self, tensor, src, tag):
        i = next(i for i, (s, d, t, _) in enumerate(self.mailbox)
                 if (s, d, t) == (src, self.rank, tag))
        tensor.copy_(self.mailbox.pop(i)[3])

    def recv(self, tensor, src, group=None, tag=0):
        self.log.append(("recv", tensor.dtype, tensor.device.type))
        self._take(tensor, src, tag)

    def irecv(self, tensor, src, group=None, tag=0):
        self.log.append(("recv", tensor.dtype, tensor.device.type))
        take = self._take

        class Later(_Done):
            def wait(self, timeout=None):  # the copy happens here, as a real wait's would
                take(tensor, src, tag)
                return True

        return Later([tensor])


def test_a_pipeline_stage_receives_data_on_its_device_and_headers_on_the_control_device(
        monkeypatch):
    """Lesson 07b's stage on `meta` parameters: the activation buffers it allocates follow the
    parameters, its headers go where `comm_device` says (the CPU for this fake group)."""
    from course_lib import pipeline_stage as ps

    asked = []
    monkeypatch.setattr(ps, "comm_device", lambda dist, group=None: (
        asked.append((dist, group)), torch.device("cpu"))[1], raising=False)
    mailbox, log = [], []
    dists = [MailDist(2, r, mailbox, log) for r in range(2)]
    with torch.device("meta"):
        stages = [ps.PipelineStage(nn.Linear(3, 3), r, 2, dist=dists[r]) for r in range(2)]
    got = []
    for j in range(2):
        stages[0].send(torch.ones(2, 3, device="meta"), 1, ps.ACTIVATION_TAG, j)
        got.append(stages[1].recv(0, ps.ACTIVATION_TAG, j))  # j = 0 plain, j = 1 posted
        if j == 0:
            stages[1].irecv(0, ps.ACTIVATION_TAG, 1, like=got[0])
    stages[0].wait_sends()
    assert [t.device.type for t in got] == ["meta", "meta"]
    wrong = [entry for entry in log
             if entry[2] != ("cpu" if entry[1] == torch.int64 else "meta")]
    assert not wrong, f"headers must be on the control device, data on meta: {wrong}"
    assert asked == [(dists[0], None), (dists[1], None)]  # the control device: comm_device's


def test_the_schedule_executor_receives_data_on_its_device_and_headers_on_the_control_device():
    """Lesson 07d's executor: the buffers it posts follow the chunks' parameters (data) and
    `comm_device` (headers)."""
    from course_lib import pipeline_multi as ex
    from course_lib.pipeline_comms import Message, Op

    s = ex.sch.make("1f1b", 2, 2)
    with torch.device("meta"):
        chunks = ex.cut(ex.build_model(0, blocks=2), s.n_chunks)
    mailbox, log = [], []
    run = ex.Executor(s, {1: chunks[1]}, [torch.Size([2, 4])] * 2, nn.functional.mse_loss,
                      program=[], dist=MailDist(2, 1, mailbox, log))
    run.works, op = {}, Op(False, 0, Message("act", 0, 0, 1))
    run.post([op])
    header, tensor = run.works[op][-1]
    assert (header.device.type, tensor.device.type) == ("cpu", "meta")
    assert run.header(op.message).device.type == "cpu"
    x, y = ex.make_batch(0, 4, device="meta")
    assert x.device.type == y.device.type == "meta"


def test_tensor_parallel_layers_broadcast_their_bias_on_the_model_device():
    """A row-parallel layer broadcasts its bias at construction: on the unsplit layer's
    device, the only one a NCCL group takes (a CPU bias there is refused)."""
    from course_lib.tensor_parallel import (RowParallelLinear, TensorParallelAttention,
                                            TensorParallelMLP)

    class Recording(FakeDist):
        def broadcast(self, tensor, src=0, group=None, async_op=False):
            devices.append(tensor.device.type)
            return self._done("broadcast", async_op, [tensor])

    devices, dist = [], Recording(world=2)
    with torch.device("meta"):
        fc1, fc2 = nn.Linear(8, 16), nn.Linear(16, 8)
        mha = nn.MultiheadAttention(8, 2, batch_first=True)
    layers = [RowParallelLinear.from_linear(fc2, dist=dist),
              TensorParallelMLP.from_linears(fc1, fc2, dist=dist),
              TensorParallelAttention.from_torch(mha, dist=dist)]
    assert devices and set(devices) == {"meta"}, devices
    assert_on_meta([p for layer in layers for p in layer.parameters()], "parameter")


def test_spawned_ranks_each_get_their_own_gpu_before_the_group_starts(fake_cuda, monkeypatch):
    """course_lib.spawn's ranks on a host with a GPU each: set_device(rank) before `init`
    (the launch contract), LOCAL_RANK set; with fewer GPUs than ranks, no binding."""
    import queue

    from course_lib import spawn

    for name in ("LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)  # restored after the test
    monkeypatch.setattr(spawn.backends, "init", lambda *a, **kw: fake_cuda.append(("init",)))

    def seen(rank, world):
        import os
        return torch.cuda.current_device(), os.environ["LOCAL_RANK"]

    def run_rank(rank, world):
        to_parent, from_parent = queue.Queue(), queue.Queue()
        from_parent.put({})
        from_parent.put("done")
        spawn._worker(rank, world, "none", 5, to_parent, from_parent, seen, (), {})
        return _drain(to_parent)

    assert run_rank(1, 2) == (1, "1")
    assert fake_cuda == [("set_device", 1), ("init",)]
    fake_cuda.clear()
    assert run_rank(3, 8)[1] == "3"
    assert fake_cuda == [("init",)]  # 8 ranks, 4 GPUs: they share, the caller places them


def _drain(q):
    """The result a rank's `_worker` reported (its "ok" message)."""
    while True:
        kind, _, payload = q.get_nowait()
        if kind == "ok":
            return payload
        assert kind != "err", payload


def test_the_benchmark_clock_waits_for_the_gpu(monkeypatch):
    """Kernels and NCCL calls return when queued: a timer must synchronize the CUDA device
    before it reads the clock, and only then."""
    from course_lib.course.bench.common import clock

    synced = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: synced.append(device))
    start = clock("cuda:1")
    assert synced == [torch.device("cuda", 1)]
    assert clock("cpu") >= start and clock(None) >= start and len(synced) == 1
    clock(torch.device("cuda", 0))
    assert synced[-1] == torch.device("cuda", 0)


@pytest.mark.parametrize("call", ["send", "isend", "recv", "all_reduce", "broadcast", "all_gather",
                                  "reduce_scatter", "gather", "scatter"])
def test_the_scratch_backend_refuses_a_device_tensor_by_name(call):
    """It moves host memory through host pointers: a CUDA tensor would segfault in a link.
    `meta` stands in for CUDA: the refusal must come first, naming the device."""
    from course_lib import dist as scratch

    t = torch.ones(4, device="meta")
    args = {"send": (t, 0), "isend": (t, 0), "recv": (t, 0), "all_reduce": (t,),
            "broadcast": (t, 0), "all_gather": ([torch.ones(4, device="meta")], t),
            "reduce_scatter": (torch.ones(4), [t]), "gather": (torch.ones(4), [t]),
            "scatter": (torch.ones(4), [t])}[call]
    with pytest.raises(TypeError, match="meta"):
        getattr(scratch, call)(*args)


# -- 2. a fake CUDA node: the launch contract ------------------------------------------------------


@pytest.fixture
def fake_cuda(monkeypatch):
    """torch.cuda says 4 GPUs; set_device and init_process_group record what they are given."""
    log = []
    current = [0]
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: current[0])

    def set_device(device):
        current[0] = torch.device(device).index if not isinstance(device, int) else device
        log.append(("set_device", current[0]))

    monkeypatch.setattr(torch.cuda, "set_device", set_device)
    monkeypatch.setattr(tdist, "init_process_group",
                        lambda backend=None, **kw: log.append(("init", backend,
                                                               kw.get("device_id"))))
    return log


def test_torchrun_gives_each_rank_its_local_gpu_before_nccl_starts(fake_cuda):
    env = {"RANK": "5", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "4"}
    device = backend.torchrun_init("auto", env=env)
    assert device == torch.device("cuda", 1)  # LOCAL_RANK, never RANK (5 > 4 GPUs)
    assert fake_cuda == [("set_device", 1),
                         ("init", "cpu:gloo,cuda:nccl", torch.device("cuda", 1))]
    assert backend.torchrun_init("cuda", env=env) == torch.device("cuda", 1)


def test_auto_stays_on_the_cpu_when_a_node_has_fewer_gpus_than_ranks(fake_cuda):
    env = {"RANK": "0", "WORLD_SIZE": "8", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "8"}
    assert backend.torchrun_init("auto", env=env) == torch.device("cpu")
    assert fake_cuda == [("init", "gloo", None)]


def test_cuda_without_local_rank_is_an_error(fake_cuda):
    with pytest.raises(RuntimeError, match="LOCAL_RANK"):
        backend.torchrun_init("cuda", env={"RANK": "0", "WORLD_SIZE": "2"})
    assert fake_cuda == []


def test_control_tensors_follow_the_backend(fake_cuda):
    class Named(FakeDist):
        def __init__(self, name):
            super().__init__()
            self.name = name

        def get_backend(self, group=None):
            return self.name

    torch.cuda.set_device(2)
    assert backend.comm_device(Named("nccl")) == torch.device("cuda", 2)
    for name in ("gloo", "cpu:gloo,cuda:nccl", "fake", "mpi"):
        assert backend.comm_device(Named(name)) == torch.device("cpu"), name
    from course_lib import dist as scratch
    assert backend.comm_device(scratch) == torch.device("cpu")


def test_the_capstone_takes_its_device_from_the_command_line(fake_cuda):
    from course_lib.run_config import run_device
    from course_lib.train_loop import parse_args

    cfg, _ = parse_args(["--device", "cuda"])
    assert cfg.device == "cuda"
    torch.cuda.set_device(3)
    assert run_device("cuda") == torch.device("cuda", 3)
    assert run_device("auto") == torch.device("cuda", 3)
    assert run_device("cpu") == torch.device("cpu")


def test_autocast_follows_the_inputs_device(monkeypatch):
    """CPU autocast leaves CUDA tensors in fp32: the region must be the inputs' device's."""
    import contextlib

    from course_lib.precision import precision_forward

    seen = []
    monkeypatch.setattr(torch, "autocast", lambda device_type, *a, **kw: (
        seen.append((device_type, kw.get("dtype"))), contextlib.nullcontext())[1])
    out = precision_forward(nn.Identity(), (torch.ones(2, device="meta"),), "bf16")
    assert seen == [("meta", torch.bfloat16)] and out.device.type == "meta"


# -- 3. results poisoned until wait() --------------------------------------------------------------


def _poison(t):
    t.fill_(float("nan") if t.is_floating_point() else -1)


class _Deferred:
    """An async op's Work under NCCL's contract: its outputs hold garbage until wait()."""

    def __init__(self, outputs, private):
        self.outputs, self.private, self.waited = outputs, private, False

    def wait(self, timeout=None):
        if not self.waited:
            for out, value in zip(self.outputs, self.private):
                out.copy_(value)
            self.waited = True
        return True

    def is_completed(self):
        return True  # as NCCL's: complete at enqueue

    def get_future(self):
        fut = torch.futures.Future()  # the value: the only data a CUDA future makes safe to read
        fut.set_result([p.clone() for p in self.private])
        return fut


class PoisonUntilWait:
    """Wraps a dist: blocking calls pass through; an async call runs now into private copies,
    poisons its real outputs, and writes them only at that Work's own wait()."""

    def __init__(self, inner):
        self.inner = inner

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def _defer(self, outputs, run):
        private = [o.clone() for o in outputs]
        run(private)
        for o in outputs:
            _poison(o)
        return _Deferred(outputs, private)

    def all_reduce(self, tensor, *args, async_op=False, **kw):
        if not async_op:
            return self.inner.all_reduce(tensor, *args, **kw)
        return self._defer([tensor], lambda p: self.inner.all_reduce(p[0], *args, **kw))

    def all_gather(self, tensor_list, tensor, *args, async_op=False, **kw):
        if not async_op:
            return self.inner.all_gather(tensor_list, tensor, *args, **kw)
        return self._defer(tensor_list, lambda p: self.inner.all_gather(p, tensor, *args, **kw))

    def broadcast(self, tensor, *args, async_op=False, **kw):
        if not async_op:
            return self.inner.broadcast(tensor, *args, **kw)
        return self._defer([tensor], lambda p: self.inner.broadcast(p[0], *args, **kw))


def _hooks(dist):
    from course_lib import comm_hooks as H
    from course_lib.hook_states import DefaultState

    return {"none": (None, None),
            "fp16": (DefaultState(dist=dist), H.fp16_compress_hook),
            "topk": (H.TopKState(ratio=1.0, use_error_feedback=False, dist=dist), H.topk_hook),
            "powerSGD": (H.PowerSGDState(start_powerSGD_iter=2, matrix_approximation_rank=16,
                                         use_error_feedback=False, warm_start=False, dist=dist),
                         H.powerSGD_hook)}


@pytest.mark.parametrize("name", ["none", "fp16", "topk", "powerSGD"])
def test_ddp_and_hooks_read_results_only_after_waiting(name):
    """At world 1 every hook is exact (top-k of everything, PowerSGD at full rank): DDP's
    gradients equal the plain ones unless a result is read before its wait."""
    from course_lib.ddp import DistributedDataParallel

    dist = PoisonUntilWait(FakeDist(world=1))
    state, hook = _hooks(dist)[name]
    net = mlp()
    ref = copy.deepcopy(net)
    ddp = DistributedDataParallel(net, dist=dist, bucket_cap_mb=0.001)
    if hook is not None:
        ddp.register_comm_hook(state, hook)
    for step in range(3):  # PowerSGD compresses from its second step on
        x = torch.randn(6, 8, generator=torch.Generator().manual_seed(step))
        for p in list(net.parameters()) + list(ref.parameters()):
            p.grad = None
        ddp(x).square().mean().backward()
        ref(x).square().mean().backward()
        tol = 1e-2 if name == "fp16" else 1e-5
        for (n, p), q in zip(net.named_parameters(), ref.parameters()):
            assert torch.isfinite(p.grad).all(), f"step {step}: {n}'s gradient holds the poison"
            torch.testing.assert_close(p.grad, q.grad, rtol=tol, atol=tol)
