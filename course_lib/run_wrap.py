"""The data-parallel wrappers of the capstone's run, the course's and PyTorch's (lesson 11b
sketches them; no exercise changes them): `wrap` (lesson 04's DDP, lesson 08's ZeRO-1 / ZeRO-3
over the group that averages gradients), `reduce_moe_grads`, `pipeline_schedule` (lesson 07's
1F1B or torch's) and, for the side-by-side comparison, `wrap_torch` and
`parallelize_blocks_torch`. Each takes the rank's `course_lib.run.RunBase`; importable from
`course_lib.run` too.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch import nn

from course_lib import moe
from course_lib.comm_hooks import bf16_compress_hook
from course_lib.ddp import DistributedDataParallel, allreduce_grads_bucketed
from course_lib.gpt import Block
from course_lib.i18n import _
from course_lib.pipeline import PipelineStage, Schedule1F1B
from course_lib.precision import Precision
from course_lib.run_config import make_optimizer, shard_units
from course_lib.tensor_parallel import shard
from course_lib.zero import ZeroRedundancyOptimizer, fully_shard

__all__ = ["wrap", "reduce_moe_grads", "pipeline_schedule", "parallelize_blocks_torch",
           "wrap_torch"]


def wrap(run: Any) -> tuple[nn.Module, torch.optim.Optimizer]:
    """The course's components over the ranks that hold the same weights (dp, and cp: group
    "dp_cp"): DDP (lesson 04), ZeRO-1 or ZeRO-3 (lesson 08); around them the compute
    precision."""
    cfg, dist, group = run.cfg, run.dist, run.layout.group("dp_cp")
    replicas = cfg.dp * cfg.cp
    if cfg.zero == 3:
        shard_units(run.stage, functools.partial(fully_shard, dist=dist, group=group))
    module: nn.Module = Precision(run.stage, cfg.precision)
    optimizer = make_optimizer(cfg, run.stage.parameters(),
                               functools.partial(ZeroRedundancyOptimizer, dist=dist, group=group))
    if cfg.zero == 0 and cfg.pp == 1 and replicas > 1 and not cfg.n_expert:
        module = DistributedDataParallel(module, dist=dist, group=group)
        if cfg.reduce_dtype == "bf16":
            module.register_comm_hook(group, bf16_compress_hook)
    run.dp_reduced_in_backward = replicas > 1 and (cfg.zero > 0 or cfg.pp == 1)
    return module, optimizer


def reduce_moe_grads(run: Any) -> None:
    """MoE blocks (no DDP): dense gradients averaged over dp; each expert's already sums its
    ep group's tokens (the backward all_to_all brought them): averaged over its expert-data-
    parallel group, then divided by ep."""
    lay, experts = run.layout, {id(p) for p in moe.expert_parameters(run.stage)}
    params = [p for p in run.stage.parameters() if p.grad is not None]
    allreduce_grads_bucketed([p for p in params if id(p) not in experts], dist=run.dist,
                             group=lay.group("dp"))
    mine = [p for p in params if id(p) in experts]
    if lay.dp // lay.ep > 1:
        allreduce_grads_bucketed(mine, dist=run.dist, group=lay.group("edp"))
    for p in mine:
        p.grad.div_(lay.ep)


def pipeline_schedule(run: Any) -> Any:
    """1F1B over the pp group: lesson 07's, or torch.distributed.pipelining's (stack='torch')."""
    cfg, c, group = run.cfg, run.layout.coords, run.layout.group("pp")
    if cfg.stack == "torch":
        from torch.distributed import pipelining

        stage = pipelining.PipelineStage(run.module, c["pp"], cfg.pp, run.device, group=group)
        return pipelining.Schedule1F1B(stage, cfg.micro_batches, loss_fn=run.loss_fn)
    stage = PipelineStage(run.module, c["pp"], cfg.pp, dist=run.dist, group=group)
    # No activation counting in a training run: it costs a Python call per saved tensor.
    return Schedule1F1B(stage, cfg.micro_batches, loss_fn=run.loss_fn, track_memory=False)


def parallelize_blocks_torch(stage: nn.Module, mesh: Any) -> None:
    """DTensor's tensor parallelism in each block, lesson 06's split: q, k, v and fc1 by
    columns, out_proj and fc2 by rows."""
    from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel,
                                                   parallelize_module)

    tp = mesh.size()
    for block in stage:
        if not isinstance(block, Block):
            continue
        attn = block.attn
        # packed rows [q | k | v] put in the order [rank 0's shard | rank 1's | ...] (lesson 06's
        # q, k, v of its heads), so that ColwiseParallel's even split gives each rank its heads
        with torch.no_grad():
            for p in (attn.qkv.weight, attn.qkv.bias):
                p.copy_(torch.cat([shard(p, 0, r, tp, parts=3) for r in range(tp)]))
        attn.local_heads = attn.num_heads // tp
        parallelize_module(block, mesh, {"attn.qkv": ColwiseParallel(),
                                         "attn.out_proj": RowwiseParallel(),
                                         "mlp.fc1": ColwiseParallel(), "mlp.fc2": RowwiseParallel()})


def wrap_torch(run: Any) -> tuple[nn.Module, torch.optim.Optimizer]:
    """PyTorch's own parallelism in the same places, for the side-by-side comparison: DDP,
    ZeroRedundancyOptimizer, FSDP2's fully_shard, DTensor's TP (with FSDP2 over dp), and
    (pipeline_schedule) torch.distributed.pipelining; on torch.distributed."""
    import torch.distributed as tdist
    from torch.distributed.optim import ZeroRedundancyOptimizer as TorchZero

    cfg = run.cfg
    if run.dist is not tdist:
        raise ValueError(_("stack='torch' needs torch.distributed as the process group"))
    from torch.distributed.device_mesh import init_device_mesh

    kind = run.device.type  # never FSDP2's default mesh: it picks the accelerator if there is one
    dp_mesh = None
    if cfg.tp > 1:  # ranks of a tp group are contiguous, as in our layout (pp = 1 here)
        mesh = init_device_mesh(kind, (cfg.dp, cfg.tp), mesh_dim_names=("dp", "tp"))
        parallelize_blocks_torch(run.stage, mesh["tp"])
        dp_mesh = mesh["dp"]
    if cfg.zero == 3:
        dp_mesh = dp_mesh if dp_mesh is not None else init_device_mesh(kind, (cfg.dp,))
        from torch.distributed.fsdp import fully_shard as torch_fully_shard

        shard_units(run.stage, functools.partial(torch_fully_shard, mesh=dp_mesh))
    module: nn.Module = Precision(run.stage, cfg.precision)
    optimizer = make_optimizer(cfg, run.stage.parameters(), TorchZero)
    if cfg.zero in (0, 1) and cfg.dp > 1 and cfg.pp == 1:
        module = torch.nn.parallel.DistributedDataParallel(
            module, device_ids=[run.device.index] if run.device.type == "cuda" else None)
    run.dp_reduced_in_backward = cfg.dp > 1 and cfg.pp == 1
    return module, optimizer
