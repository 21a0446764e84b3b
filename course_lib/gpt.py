"""A small GPT in nanoGPT's shape, built so the capstone's layouts can cut it up (lesson 11a
sketches it; no exercise changes it).

Token and position embeddings, pre-norm blocks of causal self-attention and MLP, a final layer
norm and an output head tied to the token embedding. The model is an `nn.Sequential`
(embedding, blocks..., head) so a pipeline stage is a slice of it, and the attention and MLP
keep lesson 06's attribute names (`qkv`, `out_proj`, `fc1`, `fc2`) and forward function, so
tensor parallelism swaps them for their sharded versions without changing the arithmetic.
`GPTConfig.dropout` (off by default) drops the MLP's hidden units, the heads' outputs and both
residual branches, each mask drawn through the RNG tracker (`course_lib.rng`), as lesson 06's
layers draw theirs: seed it with `seed_streams` before training with dropout on.
`GPTConfig.n_expert` > 0 makes every `moe_every`-th block's MLP a mixture of experts
(`course_lib.moe.MoE`, lesson 13); `aux_loss` sums their load-balancing losses.
Long sequences (lesson 12): `parallelize_sequence` makes the model hold this rank's part of each
sequence (context parallelism: zigzag parts, attention by ring attention over the cp group;
sequence parallelism: the norm regions split over the tp group, with `parallelize_blocks(...,
sequence_parallel=True)`); the loss then reads the targets through `SequenceSplit.local`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from importlib import resources
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from course_lib import sequence_parallel as sp_layers
from course_lib.context_parallel import pad_sequence, ring_attention, zigzag_split
from course_lib.i18n import _
from course_lib.moe import MoE
from course_lib.tensor_parallel import (TensorParallelAttention, TensorParallelMLP,
                                        attention_forward)
from course_lib.tp_layers import TrackedDropout


@dataclass(frozen=True)
class GPTConfig:
    """The model's shape (nanoGPT's names)."""
    vocab_size: int = 62
    block_size: int = 64
    n_layer: int = 4
    n_head: int = 4
    n_embd: int = 128
    dropout: float = 0.0  # through the RNG tracker; 0: no random draw at all
    n_expert: int = 0  # > 0: every moe_every-th block's MLP is an MoE of that many experts
    top_k: int = 1
    capacity_factor: float = 0.0  # 0: dropless
    moe_every: int = 1


def load_text(name: str = "shakespeare") -> str:
    """A text shipped with the package (`course_lib/texts/`), never downloaded."""
    return resources.files("course_lib").joinpath("texts", f"{name}.txt").read_text("utf-8")


class CharTokenizer:
    """Characters to ids and back; the vocabulary is the text's characters, sorted."""

    def __init__(self, text: str):
        self.chars = sorted(set(text))
        self.index = {c: i for i, c in enumerate(self.chars)}

    @property
    def vocab_size(self) -> int:
        return len(self.chars)

    def encode(self, text: str) -> torch.Tensor:
        unknown = sorted(set(text) - set(self.index))
        if unknown:
            raise ValueError(_("characters not in the vocabulary: {chars}",
                               chars=repr("".join(unknown))))
        return torch.tensor([self.index[c] for c in text], dtype=torch.int64)

    def decode(self, ids: torch.Tensor) -> str:
        return "".join(self.chars[i] for i in ids.tolist())

__all__ = ["GPTConfig", "load_text", "CharTokenizer", "SelfAttention", "MLP", "Block", "Embedding",
    "Head", "GPT", "aux_loss", "set_activation_checkpointing", "parallelize_blocks",
    "IGNORE_INDEX", "SequenceSplit", "parallelize_sequence"]

IGNORE_INDEX = -100  # F.cross_entropy's: the targets of padded positions


class SelfAttention(TrackedDropout, nn.Module):
    """Causal multi-head self-attention with a packed q, k, v projection; the forward is
    lesson 06's `attention_forward`, with every head local. Dropout as `TrackedDropout`.
    `core_attention(q, k, v)`, when set, replaces the attention itself (ring attention)."""

    core_attention = None

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        if cfg.n_embd % cfg.n_head:
            raise ValueError(_("n_embd ({n_embd}) is not divisible by n_head ({n_head})",
                               n_embd=cfg.n_embd, n_head=cfg.n_head))
        self.embed_dim, self.num_heads = cfg.n_embd, cfg.n_head
        self.local_heads, self.head_dim, self.causal = cfg.n_head, cfg.n_embd // cfg.n_head, True
        self.qkv = nn.Linear(cfg.n_embd, 3 * cfg.n_embd)
        self.out_proj = nn.Linear(cfg.n_embd, cfg.n_embd)
        self.dropout = cfg.dropout
        self._install_dropout(self.out_proj)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.core_attention is not None:
            return sp_layers.attention_forward(self, x)
        return attention_forward(self, x)


class MLP(TrackedDropout, nn.Module):
    """fc2(gelu(fc1(x))), four times wider inside. Dropout as `TrackedDropout`."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.fc1 = nn.Linear(cfg.n_embd, 4 * cfg.n_embd)
        self.fc2 = nn.Linear(4 * cfg.n_embd, cfg.n_embd)
        self.dropout = cfg.dropout
        self._install_dropout(self.fc2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x)))


class Block(nn.Module):
    """x + attn(ln_1(x)), then + mlp(ln_2(x)). With `checkpoint_activations` the block keeps
    only its input for backward and recomputes the rest there."""

    def __init__(self, cfg: GPTConfig, index: int = 0):
        super().__init__()
        self.ln_1, self.attn = nn.LayerNorm(cfg.n_embd), SelfAttention(cfg)
        moe = cfg.n_expert and (index + 1) % cfg.moe_every == 0
        self.ln_2, self.mlp = nn.LayerNorm(cfg.n_embd), (
            MoE(cfg.n_embd, 4 * cfg.n_embd, cfg.n_expert, cfg.top_k, cfg.capacity_factor or None)
            if moe else MLP(cfg))
        self.checkpoint_activations = False

    def _forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.checkpoint_activations and torch.is_grad_enabled():
            return checkpoint(self._forward, x, use_reentrant=False)
        return self._forward(x)


class SequenceSplit:
    """How this rank holds each sequence of t tokens: padded to `length(t)` (a multiple of 2 cp
    with context parallelism, times tp with sequence parallelism), then this cp rank's zigzag
    part (`local`); with `sp`, the embedding's output split over the tp group and the final
    norm's output gathered back. `seq_len`: the true length of the sequences in flight (set by
    the embedding at each forward; padded positions are masked)."""

    def __init__(self, *, dist: Any = None, cp_group: Any = None, tp_group: Any = None,
                 cp: int = 1, cp_rank: int = 0, tp: int = 1, sp: bool = False):
        self.dist, self.cp_group, self.tp_group = dist, cp_group, tp_group
        self.cp, self.cp_rank, self.tp, self.sp = cp, cp_rank, tp, sp and tp > 1
        self.seq_len = 0

    def length(self, t: int) -> int:
        multiple = (2 * self.cp if self.cp > 1 else 1) * (self.tp if self.sp else 1)
        return -(-t // multiple) * multiple

    def local(self, x: torch.Tensor, value: float = 0) -> torch.Tensor:
        """This rank's part of `x` (batch, t, ...) along the sequence, padded with `value`."""
        x = pad_sequence(x, self.length(x.shape[1]), 1, value)
        return zigzag_split(x, self.cp, self.cp_rank, dim=1) if self.cp > 1 else x

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Causal attention of this rank's queries over the whole sequence (ring attention)."""
        return ring_attention(q, k, v, causal=True, seq_len=self.seq_len, layout="zigzag",
                              dist=self.dist, group=self.cp_group)


class Embedding(nn.Module):
    """Token plus position embeddings of a (batch, seq) tensor of ids (`positions`: the ids'
    positions, 0..seq-1 by default). With a `split` (`parallelize_sequence`), this rank's part
    of the sequence."""

    split: SequenceSplit | None = None

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.block_size = cfg.block_size
        self.wte = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.wpe = nn.Embedding(cfg.block_size, cfg.n_embd)

    def forward(self, idx: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        t = idx.shape[1]
        if t > self.block_size:
            raise ValueError(_("sequence of {t} tokens is longer than block_size {block_size}",
                               t=t, block_size=self.block_size))
        if positions is None:
            positions = torch.arange(t, device=idx.device)
        if self.split is None:
            return self.wte(idx) + self.wpe(positions)
        split = self.split
        split.seq_len = t
        ids, pos = split.local(idx), split.local(positions.expand_as(idx))
        x = self.wte(ids) + self.wpe(pos)
        return sp_layers.scatter_to_sequence_parallel(x, split.dist, split.tp_group) \
            if split.sp else x


class Head(nn.Module):
    """Final layer norm and the output projection, whose weight is the token embedding's. With
    sequence parallelism (`split.sp`), the norm's output is gathered from the tp group first."""

    split: SequenceSplit | None = None

    def __init__(self, cfg: GPTConfig, weight: nn.Parameter):
        super().__init__()
        self.ln_f = nn.LayerNorm(cfg.n_embd)
        self.weight = weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x, split = self.ln_f(x), self.split
        if split is not None and split.sp:  # the head is whole: its gradient is not summed
            x = sp_layers.gather_from_sequence_parallel(x, split.dist, split.tp_group,
                                                        tensor_parallel_output_grad=False)
            if split.cp == 1:
                x = x[:, :split.seq_len]  # the padding to a multiple of tp
        return F.linear(x, self.weight)


class GPT(nn.Sequential):
    """Embedding, `n_layer` blocks, head: logits (batch, seq, vocab) from ids (batch, seq)."""

    def __init__(self, cfg: GPTConfig):
        embedding = Embedding(cfg)
        super().__init__(embedding, *(Block(cfg, i) for i in range(cfg.n_layer)),
                         Head(cfg, embedding.wte.weight))
        self.config = cfg
        self.apply(_init_weights)
        for name, p in self.named_parameters():  # GPT-2's scaled init of the residual projections
            if name.endswith(("out_proj.weight", "fc2.weight")):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * cfg.n_layer))

    @torch.no_grad()
    def generate(self, idx: torch.Tensor, max_new_tokens: int, *, temperature: float = 1.0,
                 generator: torch.Generator | None = None) -> torch.Tensor:
        """Sample `max_new_tokens` more ids after `idx` (batch, seq), one at a time."""
        for _step in range(max_new_tokens):
            logits = self(idx[:, -self.config.block_size:])[:, -1, :] / temperature
            probs = F.softmax(logits, dim=-1)  # sampled on the host, by the CPU generator
            nxt = torch.multinomial(probs.float().cpu(), 1, generator=generator).to(idx.device)
            idx = torch.cat([idx, nxt], dim=1)
        return idx


def _init_weights(module: nn.Module) -> None:
    if isinstance(module, (nn.Linear, nn.Embedding)):
        nn.init.normal_(module.weight, mean=0.0, std=0.02)
    if isinstance(module, nn.Linear) and module.bias is not None:
        nn.init.zeros_(module.bias)


def aux_loss(model: nn.Module) -> torch.Tensor | float:
    """The sum of every MoE layer's load-balancing loss from its last forward (0 if none)."""
    return sum(m.aux_loss for m in model.modules() if isinstance(m, MoE))


def set_activation_checkpointing(model: nn.Module, on: bool = True) -> None:
    """Checkpoint every block of `model` (or stop)."""
    for m in model.modules():
        if isinstance(m, Block):
            m.checkpoint_activations = on


def parallelize_blocks(model: nn.Module, *, dist: Any = None, group: Any = None,
                       sequence_parallel: bool = False) -> None:
    """Swap each block's attention and MLP for lesson 06's tensor-parallel versions holding this
    rank's heads and hidden units of the same weights (and their dropout); embeddings, norms and
    head stay whole. With `sequence_parallel` (or an attention core already set), lesson 12a's
    subclasses of them (the SP mode, the pluggable core), and with SP the norms marked as SP
    parameters."""
    for m in model.modules():
        if not isinstance(m, Block) or isinstance(m.mlp, MoE):  # no TP inside experts
            continue
        attn, core = m.attn, m.attn.core_attention
        long = sequence_parallel or core is not None
        attention_cls = sp_layers.TensorParallelAttention if long else TensorParallelAttention
        mlp_cls = sp_layers.TensorParallelMLP if long else TensorParallelMLP
        with torch.random.fork_rng(devices=[]):  # their own inits are overwritten here
            tp = attention_cls(attn.embed_dim, attn.num_heads, causal=True, dist=dist,
                               group=group, dropout=attn.dropout, tracker=attn.tracker)
            m.mlp = mlp_cls.from_linears(m.mlp.fc1, m.mlp.fc2, dist=dist, group=group,
                                         dropout=m.mlp.dropout, tracker=m.mlp.tracker)
        tp.qkv = tp.column.from_linear(attn.qkv, dist=dist, group=group, parts=3)
        tp.out_proj = tp.row.from_linear(attn.out_proj, dist=dist, group=group)
        tp._install_dropout(tp.out_proj)
        if core is not None:
            tp.core_attention = core
        m.attn = tp
    if sequence_parallel:
        sp_layers.set_sequence_parallel(model, True)  # the layers, ln_1, ln_2 and ln_f


def parallelize_sequence(model: GPT, *, dist: Any = None, cp_group: Any = None,
                         tp_group: Any = None, sp: bool = False) -> SequenceSplit:
    """Make `model` hold this rank's part of each sequence: the zigzag part of the cp group
    (`cp_group`, None: cp = 1), attention by ring attention over it; with `sp`, the embedding's
    output split over the tp group and the head's input gathered (then `parallelize_blocks(...,
    sequence_parallel=True)`). Call before `parallelize_blocks`. The split is returned (the
    loss reads its targets through `split.local(targets, IGNORE_INDEX)`)."""
    cp = dist.get_world_size(cp_group) if cp_group is not None else 1
    split = SequenceSplit(dist=dist, cp_group=cp_group, tp_group=tp_group, cp=cp,
                          cp_rank=dist.get_rank(cp_group) if cp > 1 else 0,
                          tp=dist.get_world_size(tp_group) if sp else 1, sp=sp)
    model[0].split = model[-1].split = split
    for m in model.modules():
        if cp > 1 and isinstance(m, SelfAttention):
            m.core_attention = split.attend
    return split
