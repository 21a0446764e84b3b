"""The capstone's run as numbers, checked before anything is built: `TrainConfig` (the layout,
the model, the batch, the numerics; the command line's flags), `check_config` (a ValueError that
names every number that does not fit the world or the other numbers) and `learning_rate` (the
schedule: constant, or a linear warm-up then a cosine), `run_device` (where a run's tensors
live: `device`, "cpu", "cuda" or "auto"), `make_optimizer` and ZeRO-3's units (`shard_units`).
Importable from `course_lib.run` too.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Iterable

import torch
from torch import nn

from course_lib.gpt import GPTConfig
from course_lib.i18n import _
from course_lib.layout import check_degrees
from course_lib.precision import PRECISIONS


@dataclass(frozen=True)
class TrainConfig:
    """One run: the layout, the model, the batch and the numerics (the CLI's flags)."""
    dp: int = 1
    tp: int = 1
    pp: int = 1
    cp: int = 1                   # context parallelism: each sequence split over cp ranks
    sp: bool = False              # sequence parallelism: the norm regions split over tp
    zero: int = 0                 # 0: DDP over dp; 1: ZeRO-1; 3: ZeRO-3 (fully_shard)
    precision: str = "fp32"       # compute dtype under autocast; master weights stay fp32
    reduce_dtype: str = "fp32"    # "bf16": gradients all-reduced in bf16 (DDP's hook)
    checkpoint_activations: bool = False
    steps: int = 20
    batch_size: int = 16          # the global batch, in sequences
    micro_batches: int = 1        # per data-parallel rank: accumulation or pipeline micro-batches
    lr: float = 1e-3
    lr_schedule: str = "constant"  # "cosine": linear warm-up, then cosine down to lr / 10
    warmup_steps: int = 0
    optimizer: str = "adamw"      # "sgd": steps in proportion to the gradient (what tests need)
    seed: int = 0
    text: str = "shakespeare"
    val_fraction: float = 0.1     # the text's last tenth is held out, never trained on
    eval_every: int = 0           # validation loss before training and every that many steps
    block_size: int = 64
    n_layer: int = 4
    n_head: int = 4
    n_embd: int = 128
    init_scale: float = 2.0 ** 16  # fp16's loss scaler
    growth_interval: int = 200
    checkpoint_dir: str = ""      # lesson 09's checkpoints: resume from the newest whole one
    checkpoint_every: int = 0     # save every that many steps (0: never)
    sample: int = 0               # characters sampled from the trained model (pp = 1)
    sample_every: int = 0         # ... also before training and every that many steps
    stack: str = "course"         # "torch": torch's DDP, ZeRO, FSDP2, DTensor TP, pipelining
    progress: bool = False        # a tqdm bar on rank 0 (the command line's)
    progress_file: str = ""       # rank 0 appends each step's loss here (a notebook's watch)
    device: str = "cpu"           # "cuda" (this rank's current GPU), "cuda:N", or "auto"
    dropout: float = 0.0          # each mask from its rank's stream (course_lib.rng)
    token_weighted: bool = False  # the loss per real token of the step, every rank's counted
    clip_grad_norm: float | None = None  # the whole model's gradient norm, clipped to this
    ep: int = 1                   # expert parallelism: the experts split over ep dp ranks
    n_expert: int = 0             # > 0: MoE blocks (course_lib.moe), that many experts each
    top_k: int = 1
    capacity_factor: float = 0.0  # 0: dropless
    moe_every: int = 1            # every that many-th block is an MoE block
    aux_loss_coeff: float = 0.01  # the load-balancing loss's weight (the reported loss is CE)

    def model_config(self, vocab_size: int) -> GPTConfig:
        return GPTConfig(vocab_size=vocab_size, block_size=self.block_size,
                         n_layer=self.n_layer, n_head=self.n_head, n_embd=self.n_embd,
                         dropout=self.dropout, n_expert=self.n_expert, top_k=self.top_k,
                         capacity_factor=self.capacity_factor, moe_every=self.moe_every)


def check_config(cfg: TrainConfig, world_size: int) -> None:
    """A ValueError naming the numbers that do not fit, before anything is allocated."""
    check_degrees(cfg.dp, cfg.tp, cfg.pp, world_size, cfg.cp)
    problems = []
    if cfg.n_embd % cfg.n_head:
        problems.append(_("n_embd={n_embd} is not divisible by n_head={n_head}",
                          n_embd=cfg.n_embd, n_head=cfg.n_head))
    if cfg.n_head % cfg.tp:
        problems.append(_("n_head={n_head} is not divisible by tp={tp}", n_head=cfg.n_head,
                          tp=cfg.tp))
    if cfg.n_layer % cfg.pp:
        problems.append(_("n_layer={n_layer} is not divisible by pp={pp}", n_layer=cfg.n_layer,
                          pp=cfg.pp))
    if cfg.batch_size % (cfg.dp * cfg.micro_batches):
        problems.append(_("batch_size={batch_size} is not divisible by dp={dp} x "
                          "micro_batches={micro_batches}", batch_size=cfg.batch_size, dp=cfg.dp,
                          micro_batches=cfg.micro_batches))
    if cfg.zero not in (0, 1, 3):
        problems.append(_("zero={zero}: choose 0 (DDP), 1 or 3", zero=cfg.zero))
    if cfg.zero and cfg.pp > 1:
        problems.append(_("zero={zero} with pp={pp}: ZeRO runs on layouts without a pipeline "
                          "here", zero=cfg.zero, pp=cfg.pp))
    for name in ("precision", "reduce_dtype"):
        if getattr(cfg, name) not in PRECISIONS:
            problems.append(_("{name}={value}: choose one of {choices}", name=name,
                              value=repr(getattr(cfg, name)), choices=list(PRECISIONS)))
    if cfg.reduce_dtype != "fp32" and (cfg.zero or cfg.pp > 1):
        problems.append(_("reduce_dtype={reduce_dtype} is DDP's comm hook: it needs zero=0 and "
                          "pp=1", reduce_dtype=repr(cfg.reduce_dtype)))
    if cfg.optimizer not in ("adamw", "sgd"):
        problems.append(_("optimizer={optimizer}: choose 'adamw' or 'sgd'",
                          optimizer=repr(cfg.optimizer)))
    if cfg.lr_schedule not in ("constant", "cosine"):
        problems.append(_("lr_schedule={lr_schedule}: choose 'constant' or 'cosine'",
                          lr_schedule=repr(cfg.lr_schedule)))
    if not 0.0 <= cfg.val_fraction < 1.0:
        problems.append(_("val_fraction={val_fraction}: choose a fraction in [0, 1)",
                          val_fraction=cfg.val_fraction))
    if cfg.stack not in ("course", "torch"):
        problems.append(_("stack={stack}: choose 'course' or 'torch'", stack=repr(cfg.stack)))
    if cfg.stack == "torch" and (cfg.reduce_dtype != "fp32" or cfg.tp > 1 and cfg.pp > 1):
        problems.append(_("stack='torch' runs tp > 1 or pp > 1, not both (got tp={tp}, "
                          "pp={pp}), and reduces in fp32", tp=cfg.tp, pp=cfg.pp))
    if cfg.stack == "torch" and cfg.tp > 1 and cfg.zero != (3 if cfg.dp > 1 else 0):
        problems.append(_("stack='torch' with tp={tp} composes DTensor's TP with FSDP2 over "
                          "dp={dp}: it needs zero={needs} (got zero={zero})", tp=cfg.tp,
                          dp=cfg.dp, needs=3 if cfg.dp > 1 else 0, zero=cfg.zero))
    if cfg.checkpoint_every and not cfg.checkpoint_dir:
        problems.append(_("checkpoint_every={checkpoint_every} needs a checkpoint_dir",
                          checkpoint_every=cfg.checkpoint_every))
    if cfg.checkpoint_dir and cfg.stack == "torch":
        problems.append(_("checkpoint_dir: checkpoints of torch's wrappers are DCP's job here"))
    if (cfg.sample or cfg.eval_every) and cfg.pp > 1:
        problems.append(_("sample and eval_every need the whole model on a rank (pp=1)"))
    if cfg.eval_every and not cfg.val_fraction:
        problems.append(_("eval_every={eval_every} needs a val_fraction",
                          eval_every=cfg.eval_every))
    if not (cfg.device in ("auto", "cpu", "cuda") or cfg.device.startswith("cuda:")):
        problems.append(_("device={device}: choose 'auto', 'cpu', 'cuda' or 'cuda:N'",
                          device=repr(cfg.device)))
    elif cfg.device.startswith("cuda") and not torch.cuda.is_available():
        problems.append(_("device={device}: this torch sees no CUDA device",
                          device=repr(cfg.device)))
    elif (cfg.precision == "bf16" and run_device(cfg.device).type == "cuda"
          and not torch.cuda.is_bf16_supported()):
        problems.append(_("precision='bf16' on a GPU without bf16 (before Ampere): use fp16"))
    if not 0.0 <= cfg.dropout < 1.0:
        problems.append(_("dropout={dropout}: choose a probability in [0, 1)",
                          dropout=cfg.dropout))
    if cfg.stack == "torch" and (cfg.dropout or cfg.clip_grad_norm is not None):
        problems.append(_("stack='torch': dropout and clip_grad_norm are the course stack's"))
    if cfg.clip_grad_norm is not None and cfg.clip_grad_norm <= 0:
        problems.append(_("clip_grad_norm={clip_grad_norm}: choose a positive norm",
                          clip_grad_norm=cfg.clip_grad_norm))
    problems += _long_sequence_problems(cfg)
    if cfg.dp % cfg.ep or cfg.ep > 1 and not cfg.n_expert or cfg.n_expert % cfg.ep:
        problems.append(_("ep={ep}: it must divide dp={dp} and n_expert={n_expert} > 0",
                          ep=cfg.ep, dp=cfg.dp, n_expert=cfg.n_expert))
    if cfg.n_expert and (cfg.top_k not in (1, 2) or cfg.top_k > cfg.n_expert):
        problems.append(_("top_k={top_k}: 1 or 2, at most n_expert={n_expert}", top_k=cfg.top_k,
                          n_expert=cfg.n_expert))
    if cfg.n_expert and (cfg.tp, cfg.pp, cfg.cp, cfg.zero, cfg.stack, cfg.micro_batches) != (
            1, 1, 1, 0, "course", 1):
        problems.append(_("n_expert > 0 runs with tp=1, pp=1, cp=1, zero=0, micro_batches=1 and "
                          "the course's stack here"))
    if problems:
        raise ValueError(_("TrainConfig: {problems}", problems="; ".join(problems)))


def _long_sequence_problems(cfg: TrainConfig) -> list[str]:
    """What context parallelism (cp > 1) and sequence parallelism (sp) do not run with here."""
    problems = []
    if cfg.sp and cfg.tp == 1:
        problems.append(_("sp=True splits the tensor-parallel regions' norms: it needs tp > 1"))
    if cfg.cp > 1 or cfg.sp:
        what = f"cp={cfg.cp}" if cfg.cp > 1 else "sp=True"
        if cfg.pp > 1:
            problems.append(_("{what} with pp={pp}: a pipeline stage would pass a part of each "
                              "sequence; run it with pp=1", what=what, pp=cfg.pp))
        if cfg.stack != "course":
            problems.append(_("{what} runs on the course's stack only (got stack={stack})",
                              what=what, stack=repr(cfg.stack)))
    if cfg.cp > 1 and (cfg.sample or cfg.sample_every):
        problems.append(_("cp={cp}: sampling needs every position of a prefix on a rank (cp=1)",
                          cp=cfg.cp))
    if cfg.sp and cfg.zero:
        problems.append(_("sp=True with zero={zero}: the norms' gradients are summed over tp "
                          "after backward, where ZeRO has already reduced them; use zero=0",
                          zero=cfg.zero))
    return problems


def run_device(device: str) -> torch.device:
    """The device a run's model, batches and losses live on: "cpu", "cuda" (this process's
    current GPU, which the launcher set from LOCAL_RANK), "cuda:N", or "auto" (the current GPU
    when torch sees one, else the CPU)."""
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device(device)


def learning_rate(cfg: TrainConfig, step: int) -> float:
    """The learning rate of step `step`: constant, or a linear warm-up over `warmup_steps` and
    a cosine down to a tenth of `lr` at the last step (nanoGPT's schedule)."""
    if cfg.lr_schedule == "constant":
        return cfg.lr
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    done = (step - cfg.warmup_steps) / max(1, cfg.steps - cfg.warmup_steps)
    return cfg.lr * (0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * min(1.0, done))))


def shard_units(stage: nn.Module, fully_shard_fn: Callable[[nn.Module], Any]) -> None:
    """ZeRO-3's units, ours or FSDP2's: one per block, then the root, which holds the
    embedding and its tied head."""
    for block in list(stage)[1:-1]:
        fully_shard_fn(block)
    fully_shard_fn(stage)


def make_optimizer(cfg: TrainConfig, params: Iterable[nn.Parameter],
                   zero1: Callable[..., torch.optim.Optimizer]) -> torch.optim.Optimizer:
    """The run's optimizer over `params`: AdamW, or plain SGD, whose step is in proportion to
    the gradient (AdamW's hardly changes when a gradient is summed instead of averaged); with
    ZeRO-1, sharded by `zero1(params, optimizer_class, **kwargs)` (ours or torch's)."""
    if cfg.optimizer == "sgd":
        cls, kwargs = torch.optim.SGD, {"lr": cfg.lr}
    else:
        cls, kwargs = torch.optim.AdamW, {"lr": cfg.lr, "betas": (0.9, 0.95), "weight_decay": 0.0}
    return zero1(params, cls, **kwargs) if cfg.zero == 1 else cls(params, **kwargs)
