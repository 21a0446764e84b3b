"""The capstone's run on one rank, all but its step: the configuration, the data, this rank's
part of the model and its wrappers (lesson 11b sketches it; no exercise changes it).

`RunBase(cfg, dist)` builds, on every rank of a process group, what one rank holds: the layout
(`course_lib.layout.ParallelLayout`), the whole GPT from one seed, cut to this rank's part
(its part of each sequence with cp > 1 or sp, tensor parallelism applied, then `stage_layers`),
the data-parallel wrapper (lesson 04's DDP or lesson 08's ZeRO-1 / ZeRO-3 over the dp x cp
ranks, `course_lib.run_wrap`, or PyTorch's own with `stack="torch"`), the optimizer, the loss
scaler and, with pp > 1, lesson 07's 1F1B schedule. `forward_backward(x, y)` leaves this step's
gradients in `.grad`; what happens next (the reductions each axis needs, the scaler, the
optimizer's step) is the lesson's exercise, `course_lib.train.train_step`, which `Run` adds.

The model is drawn on the CPU (the same numbers on any device) and moved to `cfg.device`
(`run_device`) before any wrapper; each step's batch follows it there.

What a step reads here: `stage`, `layout`, `dist`, `device`, `optimizer`, `scaler`,
`tied_weight` and `tied_group` (pp > 1: this rank's copy of the tied embedding and the group
of its two copies), `dp_reduced_in_backward` (a wrapper already averaged the gradients over dp,
and cp) and `stepped_tensors()` (what the optimizer updates).

With cp > 1 every rank of a dp coordinate reads the same batch; the model keeps this rank's
zigzag part of each sequence (`course_lib.gpt.parallelize_sequence`) and the loss its targets,
so each rank's loss is its tokens' share and the gradients are averaged over "dp_cp". With
sp, the norms' gradients are summed over tp after backward (lesson 12a).

The run's numbers (`TrainConfig`, `check_config`, `learning_rate`) are in `course_lib.run_config`
and its data (`TextWindows`, `split_text`, `batches`) in `course_lib.run_data`; both are
importable from here too.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn

from course_lib import clip, moe
from course_lib.backend import comm_device, default_dist
from course_lib.gpt import (IGNORE_INDEX, CharTokenizer, GPT, aux_loss, load_text,
                            parallelize_blocks, parallelize_sequence, set_activation_checkpointing)
from course_lib.i18n import _
from course_lib.layout import ParallelLayout, stage_layers
from course_lib.precision import DynamicLossScaler, precision_forward
from course_lib.recovery import CheckpointManager, checkpoints, get_state_dict, set_state_dict
from course_lib.rng import seed_streams
from course_lib.run_config import (TrainConfig, check_config, learning_rate, make_optimizer,
                                   run_device, shard_units)
from course_lib.run_data import TextWindows, batches, split_text
from course_lib.run_wrap import (parallelize_blocks_torch, pipeline_schedule, reduce_moe_grads,
                                 wrap, wrap_torch)
from course_lib.sequence_parallel import allreduce_sequence_parallel_grads
from course_lib.zero import ZeroRedundancyOptimizer, state_bytes

__all__ = ["TrainConfig", "check_config", "learning_rate", "run_device", "TextWindows",
           "split_text", "batches", "tied_groups", "clip_grads", "RunBase", "wrap",
           "pipeline_schedule", "parallelize_blocks_torch", "wrap_torch", "shard_units",
           "make_optimizer", "reduce_moe_grads", "describe"]


def tied_groups(layout: ParallelLayout) -> Any:
    """For pp > 1, the group of the first and last stage that share the tied embedding
    (every rank creates every such group, in the same order); None otherwise."""
    if layout.pp == 1:
        return None
    mine = None
    for dp_rank in range(layout.dp):
        for cp_rank in range(layout.cp):
            for tp_rank in range(layout.tp):
                ranks = [layout.rank_of(pp=p, dp=dp_rank, cp=cp_rank, tp=tp_rank)
                         for p in (0, layout.pp - 1)]
                group = layout.dist.new_group(ranks)
                if layout.rank in ranks:
                    mine = group
    return mine


def clip_grads(run: Any) -> None:
    """Before each step (`cfg.clip_grad_norm`), once the gradients are reduced: the whole
    model's gradient norm, each element counted once (summed over tp and pp; the TP replicas'
    and the tied head's copies skipped; with ZeRO, each rank's real elements of its gradient
    shards, summed over the dp x cp ranks that share them, the replicated parameters' elements
    counted on tp rank 0 only), and every rank's gradients scaled by the same factor
    (`course_lib.clip`)."""
    lay = run.layout
    groups = [lay.group(axis) for axis in ("tp", "pp") if getattr(lay, axis) > 1]
    if run.cfg.zero:  # pp = 1 (check_config)
        held = run.optimizer if run.cfg.zero == 1 else run.stage
        clip.clip_grads_(clip.shard_grads(held, tp_rank=lay.coords["tp"], model=run.stage),
                         run.cfg.clip_grad_norm, groups=[*groups, lay.group("dp_cp")],
                         dist=run.dist)
        return
    copies = (clip.tp_duplicates(run.stage, dist=run.dist, group=lay.group("tp"))
              if lay.tp > 1 else [])
    if run.tied_weight is not None and run.is_last and not run.is_first:
        copies.append(run.tied_weight)
    clip.clip_grad_norm_(run.stepped_tensors(), run.cfg.clip_grad_norm, duplicates=copies,
                         groups=groups, dist=run.dist)


# --- one rank's part of the run ------------------------------------------------------------------

class RunBase:
    """Everything one rank holds for a run: its layout, its part of the model, the optimizer.
    A subclass adds `step(x, y) -> (loss, skipped)` (lesson 11b's `train_step`)."""

    def __init__(self, cfg: TrainConfig, dist: Any = None):
        self.cfg, self.dist = cfg, default_dist(dist)
        check_config(cfg, self.dist.get_world_size())
        self.device = run_device(cfg.device)
        self.layout = ParallelLayout(cfg.dp, cfg.tp, cfg.pp, cfg.cp, sp=cfg.sp, ep=cfg.ep,
                                     dist=self.dist)
        self.tied_group = tied_groups(self.layout)
        c = self.layout.coords
        seed_streams(cfg.seed, tp_rank=c["tp"], dp_rank=c["dp"] * cfg.cp + c["cp"],  # dropout's:
                     pp_rank=c["pp"])  # a cp rank holds other positions, as a dp rank does
        text = load_text(cfg.text)
        self.tokenizer = CharTokenizer(text)
        train_ids, self.val_ids = split_text(self.tokenizer.encode(text), cfg.val_fraction)
        dataset = TextWindows(train_ids, cfg.block_size)
        self.data = batches(dataset, cfg.batch_size // cfg.dp, cfg.dp, c["dp"], cfg.seed)
        torch.manual_seed(cfg.seed)  # every rank builds the same whole model, then keeps its part
        self.model = GPT(cfg.model_config(self.tokenizer.vocab_size))
        self.model.to(self.device)  # drawn on the CPU (the same on every device), then moved
        set_activation_checkpointing(self.model, cfg.checkpoint_activations)
        for m in self.model.modules():  # this rank's experts, the others through all_to_all
            if isinstance(m, moe.MoE) and cfg.ep > 1:
                moe.expert_parallel(m, dist=self.dist, group=self.layout.group("ep"))
        cp_group = self.layout.group("cp") if cfg.cp > 1 else None
        self.split = parallelize_sequence(  # this rank's part of each sequence (cp > 1 or sp)
            self.model, dist=self.dist, sp=cfg.sp, tp_group=self.layout.group("tp"),
            cp_group=cp_group) if cfg.cp > 1 or cfg.sp else None
        if cfg.tp > 1 and cfg.stack == "course":  # torch's TP: wrap_torch
            parallelize_blocks(self.model, dist=self.dist, group=self.layout.group("tp"),
                               sequence_parallel=cfg.sp)
        self.stage = stage_layers(self.model, cfg.pp, c["pp"])
        self.is_first, self.is_last = c["pp"] == 0, c["pp"] == cfg.pp - 1
        self.dp_reduced_in_backward = False  # set by the wrapper that averages over dp
        self.module, self.optimizer = (wrap_torch if cfg.stack == "torch" else wrap)(self)
        self.scaler = (DynamicLossScaler(cfg.init_scale, cfg.growth_interval)
                       if cfg.precision == "fp16" else None)
        self.vocab_size = self.tokenizer.vocab_size
        if cfg.pp > 1:  # built once: a schedule resets its own state at every step
            self.schedule = pipeline_schedule(self)
        self.steps_done, self.memory = 0, {}
        self.after_backward: Callable[["RunBase"], None] | None = None
        self.optimizer.register_step_post_hook(self._measure_memory)
        if cfg.clip_grad_norm is not None:
            self.optimizer.register_step_pre_hook(lambda *_: clip_grads(self))

    def _measure_memory(self, *_: Any) -> None:
        """After the first optimizer step, before its gradients are freed: the steady state's
        bytes (parameters, gradients and Adam's moments all exist)."""
        if not self.memory:
            self.memory = state_bytes(self.stage, self.optimizer)

    @property
    def tied_weight(self) -> nn.Parameter | None:
        """With pp > 1, this rank's copy of the tied embedding (the first stage's token
        embedding, the last stage's head); None on other ranks and with pp = 1 (one parameter,
        used twice: autograd already adds its two gradients)."""
        if self.cfg.pp == 1 or not (self.is_first or self.is_last):
            return None
        return self.stage[0].wte.weight if self.is_first else self.stage[-1].weight

    def state(self, init: bool = False) -> dict[str, Any]:
        """What a checkpoint holds of this rank (lesson 09): its part of the model and the
        optimizer, keyed by its stage and tp rank (dp replicas write theirs once), the step and
        the loss scale. Views: loading into it restores the run in place."""
        model, optim = get_state_dict(self.stage, self.optimizer, init_state=init)
        where = f"pp{self.layout.coords['pp']}.tp{self.layout.coords['tp']}"
        scaler = [self.scaler.scale, self.scaler.growth_tracker] if self.scaler else None
        return {"model": {where: model}, "optim": {where: optim}, "step": self.steps_done,
                "scaler": scaler}

    def resume(self, manager: CheckpointManager) -> int:
        """Load the newest whole checkpoint, if any, and skip the batches it had trained on;
        the step to go on from."""
        if not checkpoints(manager.root):
            return 0  # a fresh start (before any optimizer state is made up to load into)
        state = self.state(init=True)
        if manager.load_latest(state) is None:
            raise RuntimeError(_("{root}: no checkpoint there passed its checks: {reasons}",
                                 root=manager.root, reasons="; ".join(manager.skipped)))
        where = next(iter(state["model"]))
        set_state_dict(self.stage, self.optimizer, state["model"][where], state["optim"][where])
        if self.scaler:
            self.scaler.scale, self.scaler.growth_tracker = state["scaler"]
        self.steps_done = state["step"]
        for _step in range(self.steps_done):  # the sampler's order is a function of seed and epoch
            next(self.data)
        return self.steps_done

    def sample(self, n: int) -> str:
        """`n` characters sampled after a newline, the same on every rank (TP ranks compute
        together, each drawing from the same seeded generator)."""
        start = torch.tensor([[self.tokenizer.index["\n"]]], device=self.device)
        cpu = torch.Generator("cpu").manual_seed(self.cfg.seed)  # generate samples on the host
        was, _ = self.model.training, self.model.eval()  # no dropout
        ids = self.model.generate(start, n, generator=cpu)
        self.model.train(was)
        return self.tokenizer.decode(ids[0, 1:])

    @torch.no_grad()
    def evaluate(self, batch: int = 32) -> float:
        """The mean loss per character over the held-out windows, the same on every rank
        (pp = 1): each dp rank takes an equal share of them (each cp rank its part of their
        positions), one all-reduce sums."""
        windows = TextWindows(self.val_ids, self.cfg.block_size)
        dp, mine = self.cfg.dp, self.layout.coords["dp"]
        per_rank = len(windows) // dp  # equal shares: ZeRO-3 gathers in lockstep
        ids = range(mine * per_rank, (mine + 1) * per_rank)
        total = torch.zeros(2, dtype=torch.float64, device=self.device)
        was, _ = self.stage.training, self.stage.eval()  # no dropout
        for i in range(0, per_rank, batch):
            xs, ys = zip(*(windows[j] for j in ids[i:i + batch]))
            x, y = torch.stack(xs).to(self.device), torch.stack(ys).to(self.device)
            logits = precision_forward(self.stage, (x,), self.cfg.precision)
            y = self.local_targets(y)
            total[0] += F.cross_entropy(logits.reshape(-1, self.vocab_size),
                                        y.reshape(-1), reduction="sum").double()
            total[1] += (y != IGNORE_INDEX).sum()
        self.stage.train(was)
        total = total.to(comm_device(self.dist, self.layout.group("dp_cp")))
        if dp * self.cfg.cp > 1:
            self.dist.all_reduce(total, group=self.layout.group("dp_cp"))
        return (total[0] / total[1]).item()

    def local_targets(self, target: torch.Tensor) -> torch.Tensor:
        """This rank's part of whole sequences' targets: with cp > 1, its zigzag part."""
        if self.split is None or self.cfg.cp == 1:
            return target
        return self.split.local(target, IGNORE_INDEX)

    def loss_fn(self, logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        """The mean cross-entropy of a micro-batch, times the loss scale with fp16. With
        `token_weighted`, its summed loss over the step's real tokens of every dp rank (targets
        -100 are padding), times k x dp: what the means over micro-batches and ranks undo.
        With cp > 1, this rank's part of either (its tokens' summed loss over the micro-batch's
        or the step's tokens), times cp: what the mean over the cp ranks undoes."""
        cp, whole = self.cfg.cp, target
        target = self.local_targets(target).reshape(-1)
        logits = logits.reshape(-1, self.vocab_size)
        if self.cfg.token_weighted:
            loss = F.cross_entropy(logits, target, reduction="sum") * (
                self.cfg.micro_batches * self.cfg.dp * cp / self.step_tokens)
        elif cp > 1:
            real = max(int((whole != IGNORE_INDEX).sum()), 1)
            loss = F.cross_entropy(logits, target, reduction="sum") * (cp / real)
        else:
            loss = F.cross_entropy(logits, target)
        return loss * self.scaler.scale if self.scaler else loss

    def stepped_tensors(self) -> list[torch.Tensor]:
        """What the optimizer updates (and whose .grad the scaler unscales): the parameters,
        or ZeRO-1's shards."""
        if isinstance(self.optimizer, ZeroRedundancyOptimizer):
            return [b.shard for b in self.optimizer.buckets]
        return [p for g in self.optimizer.param_groups for p in g["params"]]

    def forward_backward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor | None:
        """This rank's gradients of its share of the step's batch in .grad (scaled with fp16;
        reduced over dp already if `dp_reduced_in_backward`; with sp, the norms' summed over
        tp); the local mean loss on the last stage (scaled with fp16; with cp > 1 this rank's
        share of it, the cp ranks' shares summing to it), None on the others."""
        k = self.cfg.micro_batches
        if self.cfg.token_weighted:  # the step's real tokens, every dp rank's, before any loss
            count = (y != -100).sum().to(comm_device(self.dist, self.layout.group("dp")))
            if self.cfg.dp > 1:
                self.dist.all_reduce(count, group=self.layout.group("dp"))
            self.step_tokens = max(int(count.item()), 1)
        x, y = x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True)
        if self.cfg.pp > 1:
            losses: list[torch.Tensor] = []
            if self.is_first:
                self.schedule.step(x)
            elif self.is_last:
                self.schedule.step(target=y, losses=losses)
            else:
                self.schedule.step()
            local = torch.stack(losses).mean().detach() if self.is_last else None
        else:
            local = torch.zeros((), device=self.device)
            for i, (xb, yb) in enumerate(zip(x.chunk(k), y.chunk(k))):
                skip = i < k - 1 and hasattr(self.module, "no_sync")
                with self.module.no_sync() if skip else contextlib.nullcontext():
                    loss = self.loss_fn(self.module(xb), yb)
                    total = loss + self.cfg.aux_loss_coeff * aux_loss(self.module)
                    (total / k).backward()
                local += loss.detach() / (k * self.cfg.cp)
            if self.cfg.n_expert and self.cfg.dp > 1:
                reduce_moe_grads(self)
            if self.layout.sp:  # the norms and row biases saw this rank's tokens only
                allreduce_sequence_parallel_grads(self.stage, self.dist, self.layout.group("tp"))
        if self.after_backward is not None:
            self.after_backward(self)
        return local

    def describe(self) -> dict[str, Any]:
        """What this rank holds, for the layout's picture (`describe`)."""
        return describe(self)


def describe(run: RunBase) -> dict[str, Any]:
    """What `run`'s rank holds, for the layout's picture: its coordinates and groups, its
    layers, its parameters (split by tp or whole) and its optimizer state."""
    sharded = {id(p) for m in run.stage.modules() if type(m).__name__ in (
        "ColumnParallelLinear", "RowParallelLinear") for n, p in m.named_parameters()
        if not (n == "bias" and type(m).__name__ == "RowParallelLinear")}
    params = list(run.stage.parameters())
    layers = []
    for m in run.stage:
        name = type(m).__name__
        if name == "Block":
            index = next(i for i, b in enumerate(run.model) if b is m) - 1
            name = f"block {index}"
        layers.append(name.lower() if name != "Head" else "head (tied)")
    zero_share = {0: 1, 1: run.cfg.dp * run.cfg.cp, 3: run.cfg.dp * run.cfg.cp}[
        run.cfg.zero]
    return {"rank": run.layout.rank, "coords": dict(run.layout.coords),
            "groups": {axis: run.layout.ranks(axis) for axis in ("tp", "dp", "pp")},
            "layers": layers,
            "sharded": sum(p.numel() for p in params if id(p) in sharded),
            "whole": sum(p.numel() for p in params if id(p) not in sharded),
            "tied": run.tied_weight is not None,
            "adam state": 8 * sum(p.numel() for p in params) // zero_share,
            "config": {k: getattr(run.cfg, k) for k in (
                "dp", "tp", "pp", "zero", "micro_batches", "batch_size", "block_size",
                "n_embd", "n_layer")}, "vocab_size": run.vocab_size}
