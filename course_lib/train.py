"""The capstone's training run: a small GPT on (dp, tp, pp) ranks with everything the course built.

One entry point, `train(config)`, runs on every rank of a process group, whichever started it:
the course's cluster, `course_lib.spawn`, or torchrun (`python -m course_lib.train --dp 2 --tp 2
...` reads RANK, WORLD_SIZE and MASTER_ADDR as torchrun sets them). The layout object says which
ranks share what: tensor parallelism inside each block (lesson 06), a 1F1B pipeline across stages
(lesson 07), DDP (lesson 04) or ZeRO (lesson 08) over the data-parallel ranks, micro-batches
accumulated as in lesson 05, and bf16 or fp16 compute with fp32 master weights.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import sys
import time
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn

from course_lib.backend import default_dist
from course_lib.comm_hooks import bf16_compress_hook
from course_lib.data import DistributedSampler
from course_lib.ddp import DistributedDataParallel, allreduce_grads_bucketed
from course_lib.gpt import (GPT, CharTokenizer, GPTConfig, load_text, parallelize_blocks,
                            set_activation_checkpointing)
from course_lib.layout import ParallelLayout, check_degrees
from course_lib.pipeline import PipelineStage, Schedule1F1B
from course_lib.processes import run_session
from course_lib.zero import ZeroRedundancyOptimizer, fully_shard, state_bytes, storage_bytes

PRECISIONS = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass(frozen=True)
class TrainConfig:
    """One run: the layout, the model, the batch and the numerics (the CLI's flags)."""
    dp: int = 1
    tp: int = 1
    pp: int = 1
    zero: int = 0                 # 0: DDP over dp; 1: ZeRO-1; 3: ZeRO-3 (fully_shard)
    precision: str = "fp32"       # compute dtype under autocast; master weights stay fp32
    reduce_dtype: str = "fp32"    # "bf16": gradients all-reduced in bf16 (DDP's hook)
    checkpoint_activations: bool = False
    steps: int = 20
    batch_size: int = 16          # the global batch, in sequences
    micro_batches: int = 1        # per data-parallel rank: accumulation or pipeline micro-batches
    lr: float = 1e-3
    seed: int = 0
    text: str = "shakespeare"
    block_size: int = 64
    n_layer: int = 4
    n_head: int = 4
    n_embd: int = 128
    init_scale: float = 2.0 ** 16  # fp16's loss scaler
    growth_interval: int = 200
    sample: int = 0               # characters to sample from the trained model (pp = 1)
    stack: str = "course"         # "torch": torch's DDP, ZeroRedundancyOptimizer or FSDP2 instead
    progress: bool = False

    def model_config(self, vocab_size: int) -> GPTConfig:
        return GPTConfig(vocab_size=vocab_size, block_size=self.block_size,
                         n_layer=self.n_layer, n_head=self.n_head, n_embd=self.n_embd)


def check_config(cfg: TrainConfig, world_size: int) -> None:
    """A ValueError naming the numbers that do not fit, before anything is allocated."""
    check_degrees(cfg.dp, cfg.tp, cfg.pp, world_size)
    problems = []
    if cfg.n_embd % cfg.n_head:
        problems.append(f"n_embd={cfg.n_embd} is not divisible by n_head={cfg.n_head}")
    if cfg.n_head % cfg.tp:
        problems.append(f"n_head={cfg.n_head} is not divisible by tp={cfg.tp}")
    if cfg.n_layer % cfg.pp:
        problems.append(f"n_layer={cfg.n_layer} is not divisible by pp={cfg.pp}")
    if cfg.batch_size % (cfg.dp * cfg.micro_batches):
        problems.append(f"batch_size={cfg.batch_size} is not divisible by dp={cfg.dp} x "
                        f"micro_batches={cfg.micro_batches}")
    if cfg.zero not in (0, 1, 3):
        problems.append(f"zero={cfg.zero}: choose 0 (DDP), 1 or 3")
    if cfg.zero and cfg.pp > 1:
        problems.append(f"zero={cfg.zero} with pp={cfg.pp}: ZeRO runs on layouts without a "
                        "pipeline here")
    for name in ("precision", "reduce_dtype"):
        if getattr(cfg, name) not in PRECISIONS:
            problems.append(f"{name}={getattr(cfg, name)!r}: choose one of {list(PRECISIONS)}")
    if cfg.reduce_dtype != "fp32" and (cfg.zero or cfg.pp > 1):
        problems.append(f"reduce_dtype={cfg.reduce_dtype!r} is DDP's comm hook: it needs "
                        "zero=0 and pp=1")
    if cfg.stack not in ("course", "torch"):
        problems.append(f"stack={cfg.stack!r}: choose 'course' or 'torch'")
    if cfg.stack == "torch" and (cfg.tp > 1 or cfg.pp > 1 or cfg.reduce_dtype != "fp32"):
        problems.append(f"stack='torch' runs torch's data-parallel wrappers: it needs tp=1 and "
                        f"pp=1 (got tp={cfg.tp}, pp={cfg.pp}) and fp32 reduction")
    if cfg.sample and cfg.pp > 1:
        problems.append(f"sample={cfg.sample} needs the whole model on a rank (pp=1)")
    if problems:
        raise ValueError("TrainConfig: " + "; ".join(problems))


class Precision(nn.Module):
    """Runs `module` in a compute precision while its parameters stay fp32."""

    def __init__(self, module: nn.Module, precision: str):
        super().__init__()
        self.module, self.precision = module, precision

    def forward(self, *args: torch.Tensor) -> torch.Tensor:
        return precision_forward(self.module, args, self.precision)


def precision_forward(module: nn.Module, args: tuple, precision: str) -> torch.Tensor:
    """`module(*args)` with its matmuls in `precision` (autocast: the weights are cast per op,
    the fp32 masters are what the optimizer updates) and the output back in fp32, so the loss
    and whatever the next stage adds to it are computed in fp32."""
    dtype = PRECISIONS[precision]
    if dtype is None:
        return module(*args)
    with torch.autocast("cpu", dtype=dtype):
        out = module(*args)
    return out.float()


def update_scale(scale: float, growth_tracker: int, found_inf: bool, *,
                 growth_factor: float = 2.0, backoff_factor: float = 0.5,
                 growth_interval: int = 2000) -> tuple[float, int]:
    """The dynamic loss scale after a step (torch.amp.GradScaler's rule): an overflow shrinks
    it and restarts the count; `growth_interval` clean steps in a row grow it."""
    if found_inf:
        return scale * backoff_factor, 0
    growth_tracker += 1
    if growth_tracker == growth_interval:
        return scale * growth_factor, 0
    return scale, growth_tracker


class DynamicLossScaler:
    """fp16's loss scaling: multiply the loss, unscale the gradients, skip the step on every
    rank when any rank's gradients overflowed."""

    def __init__(self, init_scale: float = 2.0 ** 16, growth_interval: int = 2000):
        self.scale, self.growth_tracker, self.growth_interval = init_scale, 0, growth_interval

    def unscale_(self, tensors: list[torch.Tensor], *, dist: Any, group: Any = None) -> bool:
        """Divide the gradients by the scale; True if any rank's are not finite."""
        found = torch.zeros(1)
        for t in tensors:
            if t.grad is not None:
                t.grad.div_(self.scale)
                found = torch.maximum(found, (~torch.isfinite(t.grad)).any().float())
        dist.all_reduce(found, op=dist.ReduceOp.MAX, group=group)
        return bool(found.item())

    def update(self, found_inf: bool) -> None:
        self.scale, self.growth_tracker = update_scale(
            self.scale, self.growth_tracker, found_inf, growth_interval=self.growth_interval)


class TextWindows(torch.utils.data.Dataset):
    """Non-overlapping windows of block_size + 1 ids: (input, the input shifted by one)."""

    def __init__(self, ids: torch.Tensor, block_size: int):
        self.ids, self.block_size = ids, block_size

    def __len__(self) -> int:
        return (len(self.ids) - 1) // self.block_size

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        start = i * self.block_size
        chunk = self.ids[start:start + self.block_size + 1]
        return chunk[:-1], chunk[1:]


def batches(dataset: TextWindows, per_rank: int, dp: int, dp_rank: int, seed: int):
    """This data-parallel rank's (x, y) for each step, forever: its strided share of the
    global batch, so the dp ranks of a step together read what one process would."""
    sampler = DistributedSampler(dataset, num_replicas=dp, rank=dp_rank, seed=seed,
                                 drop_last=True)
    epoch = 0
    while True:
        sampler.set_epoch(epoch)
        order = list(sampler)
        for i in range(0, len(order) - per_rank + 1, per_rank):
            xs, ys = zip(*(dataset[j] for j in order[i:i + per_rank]))
            yield torch.stack(xs), torch.stack(ys)
        epoch += 1


def stage_layers(model: GPT, pp: int, pp_rank: int) -> nn.Sequential:
    """Pipeline stage `pp_rank`'s part of the model: an equal share of the blocks, the
    embedding on the first stage and the head on the last."""
    blocks = list(model)[1:-1]
    per = len(blocks) // pp
    layers = blocks[pp_rank * per:(pp_rank + 1) * per]
    if pp_rank == 0:
        layers = [model[0], *layers]
    if pp_rank == pp - 1:
        layers = [*layers, model[-1]]
    return nn.Sequential(*layers)


def tied_groups(layout: ParallelLayout) -> Any:
    """For pp > 1, the group of the first and last stage that share the tied embedding
    (every rank creates every such group, in the same order); None otherwise."""
    if layout.pp == 1:
        return None
    mine = None
    for dp_rank in range(layout.dp):
        for tp_rank in range(layout.tp):
            ranks = [layout.rank_of(pp=p, dp=dp_rank, tp=tp_rank) for p in (0, layout.pp - 1)]
            group = layout.dist.new_group(ranks)
            if layout.rank in ranks:
                mine = group
    return mine


class Run:
    """Everything one rank holds for a run: its layout, its part of the model, the optimizer."""

    def __init__(self, cfg: TrainConfig, dist: Any = None):
        self.cfg, self.dist = cfg, default_dist(dist)
        check_config(cfg, self.dist.get_world_size())
        self.layout = ParallelLayout(cfg.dp, cfg.tp, cfg.pp, dist=self.dist)
        self.tied_group = tied_groups(self.layout)
        c = self.layout.coords
        text = load_text(cfg.text)
        self.tokenizer = CharTokenizer(text)
        dataset = TextWindows(self.tokenizer.encode(text), cfg.block_size)
        self.data = batches(dataset, cfg.batch_size // cfg.dp, cfg.dp, c["dp"], cfg.seed)
        torch.manual_seed(cfg.seed)  # every rank builds the same whole model, then keeps its part
        self.model = GPT(cfg.model_config(self.tokenizer.vocab_size))
        set_activation_checkpointing(self.model, cfg.checkpoint_activations)
        if cfg.tp > 1:
            parallelize_blocks(self.model, dist=self.dist, group=self.layout.group("tp"))
        self.stage = stage_layers(self.model, cfg.pp, c["pp"])
        self.is_first, self.is_last = c["pp"] == 0, c["pp"] == cfg.pp - 1
        self.module, self.optimizer = (wrap_torch if cfg.stack == "torch" else wrap)(self)
        self.scaler = (DynamicLossScaler(cfg.init_scale, cfg.growth_interval)
                       if cfg.precision == "fp16" else None)
        self.vocab_size = self.tokenizer.vocab_size
        self.steps_done, self.memory = 0, {}

    def sample(self, n: int) -> str:
        """`n` characters sampled after a newline, the same on every rank (TP ranks compute
        together, each drawing from the same seeded generator)."""
        start = torch.tensor([[self.tokenizer.index["\n"]]])
        ids = self.model.generate(start, n, generator=torch.Generator().manual_seed(self.cfg.seed))
        return self.tokenizer.decode(ids[0, 1:])

    def loss_fn(self, logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        loss = F.cross_entropy(logits.reshape(-1, self.vocab_size), target.reshape(-1))
        return loss * self.scaler.scale if self.scaler else loss

    def stepped_tensors(self) -> list[torch.Tensor]:
        """What the optimizer updates (and whose .grad the scaler unscales)."""
        if isinstance(self.optimizer, ZeroRedundancyOptimizer):
            return [b.shard for b in self.optimizer.buckets]
        return [p for g in self.optimizer.param_groups for p in g["params"]]

    def forward_backward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor | None:
        """Gradients of this step's batch in .grad; the local mean loss (last stage only)."""
        k = self.cfg.micro_batches
        if self.cfg.pp > 1:
            stage = PipelineStage(self.module, self.layout.coords["pp"], self.cfg.pp,
                                  dist=self.dist, group=self.layout.group("pp"))
            schedule = Schedule1F1B(stage, k, loss_fn=self.loss_fn)
            losses: list[torch.Tensor] = []
            if self.is_first:
                schedule.step(x)
            elif self.is_last:
                schedule.step(target=y, losses=losses)
            else:
                schedule.step()
            return torch.stack(losses).mean() if self.is_last else None
        total = torch.zeros(())
        for i, (xb, yb) in enumerate(zip(x.chunk(k), y.chunk(k))):
            skip = i < k - 1 and hasattr(self.module, "no_sync")
            with self.module.no_sync() if skip else contextlib.nullcontext():
                loss = self.loss_fn(self.module(xb), yb)
                (loss / k).backward()
            total += loss.detach() / k
        return total

    def reduce_grads(self) -> None:
        """What DDP or ZeRO did not: sum the tied embedding's two copies, average over dp."""
        if self.cfg.pp == 1:
            return
        if self.tied_group is not None:
            tied = self.stage[0].wte.weight if self.is_first else self.stage[-1].weight
            self.dist.all_reduce(tied.grad, group=self.tied_group)
        if self.cfg.dp > 1:
            params = [p for p in self.stage.parameters() if p.grad is not None]
            allreduce_grads_bucketed(params, dist=self.dist, group=self.layout.group("dp"))

    def step(self, x: torch.Tensor, y: torch.Tensor,
             after_backward: Callable[["Run"], None] | None = None) -> tuple[float, bool]:
        """One optimizer step; (the global batch's mean loss, whether the step was skipped)."""
        local = self.forward_backward(x, y)
        self.reduce_grads()
        if after_backward is not None:
            after_backward(self)
        skipped = False
        if self.scaler is not None:
            skipped = self.scaler.unscale_(self.stepped_tensors(), dist=self.dist)
            scale = self.scaler.scale
            self.scaler.update(skipped)
        if not skipped:
            self.optimizer.step()
        if self.steps_done == 0:  # the steady state's bytes: gradients and Adam's moments exist
            self.memory = memory(self)
        self.optimizer.zero_grad(set_to_none=True)
        self.steps_done += 1
        # Every rank gets the loss: the last stage's tp-rank-0 ranks hold it, one per dp rank.
        share = torch.zeros(1)
        if local is not None and self.layout.coords["tp"] == 0:
            share += local.float() / (scale if self.scaler else 1.0) / self.cfg.dp
        self.dist.all_reduce(share)
        return share.item(), skipped


def wrap(run: Run) -> tuple[nn.Module, torch.optim.Optimizer]:
    """The course's components over the data-parallel group: DDP (lesson 04), ZeRO-1 or
    ZeRO-3 (lesson 08); around them the compute precision."""
    cfg, dist, group = run.cfg, run.dist, run.layout.group("dp")
    if cfg.zero == 3:  # a unit per block; the root holds the embedding and its tied head
        for block in list(run.stage)[1:-1]:
            fully_shard(block, dist=dist, group=group)
        fully_shard(run.stage, dist=dist, group=group)
    module: nn.Module = Precision(run.stage, cfg.precision)
    if cfg.zero == 1:
        optimizer: torch.optim.Optimizer = ZeroRedundancyOptimizer(
            run.stage.parameters(), torch.optim.AdamW, dist=dist, group=group, **adamw(cfg))
    else:
        optimizer = torch.optim.AdamW(run.stage.parameters(), **adamw(cfg))
    if cfg.zero == 0 and cfg.pp == 1 and cfg.dp > 1:
        module = DistributedDataParallel(module, dist=dist, group=group)
        if cfg.reduce_dtype == "bf16":
            module.register_comm_hook(group, bf16_compress_hook)
    return module, optimizer


def wrap_torch(run: Run) -> tuple[nn.Module, torch.optim.Optimizer]:
    """PyTorch's own wrappers in the same places, for the side-by-side comparison: DDP,
    ZeroRedundancyOptimizer, FSDP2's fully_shard (tp = pp = 1, on torch.distributed)."""
    import torch.distributed as tdist
    from torch.distributed.optim import ZeroRedundancyOptimizer as TorchZero

    cfg = run.cfg
    if run.dist is not tdist:
        raise ValueError("stack='torch' needs torch.distributed as the process group")
    if cfg.zero == 3:
        from torch.distributed.fsdp import fully_shard as torch_fully_shard

        for block in list(run.stage)[1:-1]:
            torch_fully_shard(block)
        torch_fully_shard(run.stage)
    module: nn.Module = Precision(run.stage, cfg.precision)
    if cfg.zero == 1:
        optimizer: torch.optim.Optimizer = TorchZero(run.stage.parameters(), torch.optim.AdamW,
                                                     **adamw(cfg))
    else:
        optimizer = torch.optim.AdamW(run.stage.parameters(), **adamw(cfg))
    if cfg.zero in (0, 1) and cfg.dp > 1:
        module = torch.nn.parallel.DistributedDataParallel(module)
    return module, optimizer


def memory(run: Run) -> dict[str, int]:
    """Bytes this rank holds of parameters, gradients and optimizer state (for torch's FSDP2,
    of the local shards of its DTensors)."""
    if run.cfg.stack == "course":
        return state_bytes(run.stage, run.optimizer)

    def local(t: torch.Tensor | None) -> torch.Tensor | None:
        return t.to_local() if hasattr(t, "to_local") else t

    params = list(run.stage.parameters())
    inner = getattr(run.optimizer, "optim", run.optimizer)  # torch ZeRO's local optimizer
    state = [local(v) for st in inner.state.values() for k, v in st.items()
             if isinstance(v, torch.Tensor) and k != "step"]
    return {"parameters": storage_bytes(local(p) for p in params),
            "gradients": storage_bytes(local(p.grad) for p in params),
            "optimizer state": storage_bytes(state)}


def adamw(cfg: TrainConfig) -> dict[str, Any]:
    return {"lr": cfg.lr, "betas": (0.9, 0.95), "weight_decay": 0.0}


def train(cfg: TrainConfig, dist: Any = None, *,
          after_backward: Callable[[Run], None] | None = None) -> dict[str, Any]:
    """Train for `cfg.steps` steps on this rank; every rank returns the same losses."""
    run = Run(cfg, dist)
    rank = run.dist.get_rank()
    tokens = cfg.batch_size * cfg.block_size
    bar = None
    if cfg.progress and rank == 0:
        from tqdm.auto import tqdm
        bar = tqdm(total=cfg.steps, desc=f"dp={cfg.dp} tp={cfg.tp} pp={cfg.pp}")
    losses, skipped, times = [], [], []
    for step in range(cfg.steps):
        x, y = next(run.data)
        start = time.perf_counter()
        loss, skip = run.step(x, y, after_backward)
        times.append(time.perf_counter() - start)
        losses.append(loss)
        skipped.append(skip)
        if bar is not None:
            bar.set_postfix(loss=f"{loss:.3f}", tok_s=f"{tokens / times[-1]:,.0f}")
            bar.update()
    if bar is not None:
        bar.close()
    steady = times[1:] or times
    return {"rank": rank, "coords": run.layout.coords, "losses": losses, "skipped": skipped,
            "step_s": sum(steady) / len(steady), "tokens_per_s": tokens * len(steady) / sum(steady),
            "memory": run.memory, "scale": run.scaler.scale if run.scaler else None,
            "sample": run.sample(cfg.sample) if cfg.sample else None,
            "config": dataclasses.asdict(cfg)}


def reference_losses(cfg: TrainConfig) -> list[float]:
    """What one process computes: the same model, the same global batches, no parallelism
    (in a process group of one, set up and torn down here)."""
    from course_lib import dist as scratch

    one = dataclasses.replace(cfg, dp=1, tp=1, pp=1, zero=0, micro_batches=1,
                              reduce_dtype="fp32", progress=False)
    scratch.init_process_group(rank=0, world_size=1)
    try:
        return train(one, dist=scratch)["losses"]
    finally:
        scratch.destroy_process_group()


def spawn_rank(rank: int, world_size: int, cfg: TrainConfig) -> dict[str, Any]:
    """`course_lib.spawn(spawn_rank, world, cfg)`: one rank of a run."""
    return train(cfg)


def flags(cfg: TrainConfig) -> list[str]:
    """The command-line flags that reproduce `cfg` (those that differ from the defaults)."""
    out, defaults = [], TrainConfig()
    for f in dataclasses.fields(TrainConfig):
        value = getattr(cfg, f.name)
        if f.name != "progress" and value != getattr(defaults, f.name):
            flag = "--" + f.name.replace("_", "-")
            out += [flag] if f.type == "bool" else [flag, str(value)]
    return out


def torchrun(cfg: TrainConfig, nproc_per_node: int, json_file: str | os.PathLike, *,
             timeout: float = 600.0) -> dict[str, Any]:
    """Run `cfg` under torchrun on this host (`torchrun --nproc-per-node N -m course_lib.train
    ...`), in its own process group, and return rank 0's result."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node",
           str(nproc_per_node), "-m", "course_lib.train", *flags(cfg), "--json", str(json_file)]
    run_session(cmd, timeout, f"torchrun --nproc-per-node {nproc_per_node}",
                env={"OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")})
    with open(json_file) as f:
        return json.load(f)


def parse_args(argv: list[str] | None = None) -> tuple[TrainConfig, argparse.Namespace]:
    p = argparse.ArgumentParser(prog="python -m course_lib.train", description=__doc__.split(
        "\n")[0])
    defaults = TrainConfig()
    for f in dataclasses.fields(TrainConfig):
        flag = "--" + f.name.replace("_", "-")
        if f.name == "progress":
            continue  # rank 0 always shows it when run from the command line
        if f.type == "bool":
            p.add_argument(flag, action="store_true")
        else:
            kind = {"int": int, "float": float, "str": str}[f.type]
            p.add_argument(flag, type=kind, default=getattr(defaults, f.name))
    p.add_argument("--json", metavar="FILE", help="write the loss per step (and the run) here")
    p.add_argument("--backend", default="gloo", help="without torchrun: course_lib.spawn's "
                   "backend (gloo or scratch)")
    args = p.parse_args(argv)
    cfg = TrainConfig(**{f.name: getattr(args, f.name) for f in dataclasses.fields(TrainConfig)
                         if f.name != "progress"}, progress=True)
    return cfg, args


def main(argv: list[str] | None = None) -> int:
    cfg, args = parse_args(argv)
    world = cfg.dp * cfg.tp * cfg.pp
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:  # torchrun (or any env:// launcher)
        import torch.distributed as tdist
        check_config(cfg, int(os.environ["WORLD_SIZE"]))
        tdist.init_process_group("gloo")
        try:
            result = train(cfg, dist=tdist)
        finally:
            tdist.destroy_process_group()
    else:
        check_config(cfg, world)
        from course_lib.spawn import spawn
        result = spawn(spawn_rank, world, cfg, backend=args.backend)[0]
    if args.json and result["rank"] == 0:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    if result["rank"] == 0:
        print(f"final loss {result['losses'][-1]:.4f} after {cfg.steps} steps, "
              f"{result['tokens_per_s']:,.0f} tokens/s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
