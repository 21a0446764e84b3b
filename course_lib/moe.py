"""A mixture-of-experts layer with expert parallelism: a top-k router, expert capacity with a
drop policy, the load-balancing loss, and tokens sent to their experts through all_to_all.
Hand-written around lesson 13's exercises: `permute`, `unpermute` and `keep_top_scores` are the
lesson's, exported into `course_lib.moe_dispatch` and re-exported here (`moe_forward` also takes
a learner's pieces as arguments).

The pieces, in the order a lesson builds them (Megatron-Core's and torchtitan's names in
brackets where they differ):

- `route`: softmax over the experts, then the top k (Switch, Mixtral: the router's softmax
  sees every expert). The gate weights are the chosen probabilities themselves for k = 1
  (Switch: renormalizing one weight would make it 1 and give the router no gradient from
  the task) and renormalized over the k chosen for k > 1 (Mixtral, GShard); `normalize`
  overrides. Routing runs in float32 at least, whatever the compute dtype.
- `expert_capacity`: ceil(capacity_factor * tokens * k / experts) slots per expert and group
  of tokens; None: no limit (dropless).
- `keep_top_scores`: the drop policy. An expert over capacity keeps the choices with the
  highest router probability (the softmax's, before any renormalization) and drops the rest;
  equal probabilities: the earlier token first (V-MoE's batch-prioritized routing,
  Megatron-Core's drop_policy="probs"). A dropped choice contributes nothing: its weight is
  0 and is not given to the token's other choice; the residual connection around the layer
  carries the token on.
- `load_balancing_loss`: Switch Transformer's, E * sum_e f_e P_e, f_e the fraction of the
  T * k choices that picked expert e before drops (no gradient), P_e the mean probability of
  e. It is 1 when both are uniform; the caller adds coeff * it to the loss (0.01 in Switch).
- `permute` / `unpermute` (Megatron-Core's permute/unpermute): the kept choices' tokens grouped
  by expert, and back to token order, weighted and summed over a token's k choices.
- `AllToAllRows`: all_to_all_single as an autograd op; its backward sends the gradients back
  the way the rows came (the splits swapped).
- `MoE`: the router and the experts (small MLPs); `expert_parallel(moe, dist, group)` keeps
  this rank's contiguous share of the experts, E / p of them, and routes tokens to the others
  over `group` (the layout's ep axis): counts first (who sends how many rows to whom), then
  the rows, the experts, and the rows back (Megatron-Core's AlltoAll token dispatcher).
- `dense_reference`: one process computing every expert on every token of the whole batch,
  weighted by the same gates (routed in the same groups as the ranks hold them: capacity and
  the loss are per group of tokens, so the reference makes the drops the ranks make).

Capacity and the auxiliary loss are per group of tokens: each rank's own tokens under expert
parallelism (as in Megatron-Core); `MoE.groups` splits one process's batch the same way.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from course_lib.backend import default_dist
from course_lib.i18n import _
from course_lib.moe_dispatch import keep_top_scores, permute, unpermute  # lesson 13's exercises

__all__ = ["Routing", "route", "expert_capacity", "keep_top_scores", "load_balancing_loss",
           "permute", "unpermute", "tokens_per_expert", "Expert", "MoE", "expert_parallel",
           "moe_forward", "AllToAllRows", "dense_reference",
           "expert_parameters", "moe_bytes", "moe_bytes_balanced"]


# --- routing -----------------------------------------------------------------------------------

@dataclass
class Routing:
    """Where a group of T tokens goes: k choices each, their gate weights and which are kept."""
    probs: torch.Tensor         # (T, E) the router's softmax
    expert_index: torch.Tensor  # (T, k) the experts chosen, best first
    scores: torch.Tensor        # (T, k) their probabilities (what the drop policy ranks by)
    weights: torch.Tensor       # (T, k) gate weights, 0 where dropped
    kept: torch.Tensor          # (T, k) bool
    aux_loss: torch.Tensor      # () the load-balancing loss of this group

    @staticmethod
    def cat(parts: Sequence["Routing"]) -> "Routing":
        """Several groups' routing as one (token order kept; the loss is their mean)."""
        if len(parts) == 1:
            return parts[0]
        fields = [torch.cat([getattr(r, f) for r in parts]) for f in
                  ("probs", "expert_index", "scores", "weights", "kept")]
        return Routing(*fields, torch.stack([r.aux_loss for r in parts]).mean())


def expert_capacity(num_tokens: int, num_experts: int, k: int,
                    capacity_factor: float | None) -> int:
    """Slots per expert for `num_tokens` tokens: ceil(factor * tokens * k / experts); no limit
    (every token) when capacity_factor is None."""
    if capacity_factor is None:
        return num_tokens
    return math.ceil(capacity_factor * num_tokens * k / num_experts)


def load_balancing_loss(probs: torch.Tensor, expert_index: torch.Tensor) -> torch.Tensor:
    """Switch Transformer's auxiliary loss E * sum_e f_e P_e (1 when balanced)."""
    num_tokens, k = expert_index.shape
    num_experts = probs.shape[-1]
    if num_tokens == 0:
        return probs.sum()  # 0, and still part of the graph
    chosen = torch.bincount(expert_index.reshape(-1), minlength=num_experts)
    fraction = chosen.to(probs.dtype) / (num_tokens * k)
    return num_experts * (fraction * probs.mean(0)).sum()


def route(moe: "MoE", tokens: torch.Tensor,
          keep: Callable[..., torch.Tensor] = keep_top_scores) -> Routing:
    """Route one group of tokens (T, d): top-k of the softmax, capacity, drops (the policy
    `keep` runs only where an expert could be over capacity), the loss."""
    logits = moe.router(tokens)
    probs = F.softmax(logits.to(torch.promote_types(logits.dtype, torch.float32)), dim=-1)
    scores, expert_index = probs.topk(moe.top_k, dim=-1)
    weights = scores / scores.sum(-1, keepdim=True) if moe.normalize else scores
    capacity = expert_capacity(len(tokens), moe.num_experts, moe.top_k, moe.capacity_factor)
    if capacity >= len(tokens):  # an expert gets at most one choice per token: nothing to drop
        kept = torch.ones_like(expert_index, dtype=torch.bool)
    else:
        kept = keep(expert_index, scores.detach(), moe.num_experts, capacity)
    return Routing(probs, expert_index, scores, weights * kept, kept,
                   load_balancing_loss(probs, expert_index))


# --- dispatch and combine ------------------------------------------------------------------------

def tokens_per_expert(expert_index: torch.Tensor, kept: torch.Tensor,
                      num_experts: int) -> torch.Tensor:
    """(E,) int64: how many kept choices each expert gets."""
    return torch.bincount(expert_index[kept], minlength=num_experts)


# --- all_to_all as an autograd op ---------------------------------------------------------------

def _exchange_rows(rows: torch.Tensor, output_splits: list[int], input_splits: list[int],
                   dist: Any, group: Any) -> torch.Tensor:
    out = rows.new_empty((sum(output_splits), *rows.shape[1:]))
    dist.all_to_all_single(out, rows.contiguous(), output_splits, input_splits, group=group)
    return out


class AllToAllRows(torch.autograd.Function):
    """all_to_all_single of rows (dim 0) whose backward sends the gradients back the same way."""

    @staticmethod
    def forward(ctx, rows: torch.Tensor, output_splits: list[int], input_splits: list[int],
                dist: Any, group: Any) -> torch.Tensor:
        ctx.splits, ctx.dist, ctx.group = (output_splits, input_splits), dist, group
        return _exchange_rows(rows, output_splits, input_splits, dist, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        output_splits, input_splits = ctx.splits
        return (_exchange_rows(grad, input_splits, output_splits, ctx.dist, ctx.group),
                None, None, None, None)


# --- the layer ---------------------------------------------------------------------------------

class Expert(nn.Module):
    """One expert: fc2(gelu(fc1(x))), as the GPT's MLP."""

    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(dim, hidden), nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x)))


class MoE(nn.Module):
    """Router and experts; after `expert_parallel`, only this rank's share of the experts."""

    def __init__(self, dim: int, hidden: int, num_experts: int, top_k: int = 1,
                 capacity_factor: float | None = None, normalize: bool | None = None, *,
                 groups: int = 1):
        super().__init__()
        if top_k not in (1, 2) or top_k > num_experts:
            raise ValueError(_("top_k must be 1 or 2 (and at most num_experts={num_experts}), "
                               "got {top_k}", num_experts=num_experts, top_k=top_k))
        if capacity_factor is not None and capacity_factor <= 0:
            raise ValueError(_("capacity_factor must be positive or None, got "
                               "{capacity_factor}", capacity_factor=capacity_factor))
        self.num_experts, self.top_k, self.capacity_factor = num_experts, top_k, capacity_factor
        self.normalize = top_k > 1 if normalize is None else normalize
        self.groups = groups  # token groups of one process's batch (routed apart, as ranks are)
        self.router = nn.Linear(dim, num_experts, bias=False)
        self.experts = nn.ModuleList(Expert(dim, hidden) for _ in range(num_experts))
        self.dist: Any = None
        self.group: Any = None
        self.ep_size, self.ep_rank = 1, 0
        self.aux_loss: torch.Tensor | None = None  # the last forward's (mean over its groups)
        self.tokens_per_expert: torch.Tensor | None = None  # the last forward's, kept choices

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return moe_forward(self, x)

    def extra_repr(self) -> str:
        return (f"experts={self.num_experts}, top_k={self.top_k}, capacity_factor="
                f"{self.capacity_factor}, ep={self.ep_rank}/{self.ep_size}")


def expert_parallel(moe: MoE, *, dist: Any = None, group: Any = None) -> None:
    """Keep this rank's experts (ep rank r of p: experts r E/p .. (r+1) E/p - 1) and reach the
    others through all_to_all over `group`; every rank must hold the same whole layer first."""
    dist = default_dist(dist)
    p, r = dist.get_world_size(group), dist.get_rank(group)
    if moe.num_experts % p:
        raise ValueError(_("expert_parallel: {experts} experts do not split over {p} ranks",
                           experts=moe.num_experts, p=p))
    if moe.groups != 1:
        raise ValueError(_("expert_parallel: each rank's tokens are one group (groups=1)"))
    per = moe.num_experts // p
    moe.experts = nn.ModuleList(list(moe.experts)[r * per:(r + 1) * per])
    moe.dist, moe.group, moe.ep_size, moe.ep_rank = dist, group, p, r


def _run_local_experts(experts: nn.ModuleList, rows: torch.Tensor,
                       counts: torch.Tensor) -> torch.Tensor:
    """Rows arrive as blocks (source s, expert e), sized counts[s, e]: each expert runs once on
    its blocks from every source; the result goes back in the same block order."""
    sizes = counts.reshape(-1).tolist()
    blocks = list(rows.split(sizes))
    sources, per = counts.shape
    for e, expert in enumerate(experts):
        mine = [s * per + e for s in range(sources)]
        out = expert(torch.cat([blocks[i] for i in mine]))
        for i, part in zip(mine, out.split([sizes[i] for i in mine])):
            blocks[i] = part
    return torch.cat(blocks) if blocks else rows


def _run_experts(moe: MoE, rows: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """Each row through its expert, wherever the expert lives; rows come back in order."""
    if moe.ep_size == 1:
        return _run_local_experts(moe.experts, rows, counts.view(1, -1))
    p, per = moe.ep_size, len(moe.experts)
    with torch.no_grad():  # how many rows each source sends to each of our experts
        received = torch.empty_like(counts)
        moe.dist.all_to_all_single(received, counts, group=moe.group)
    received = received.view(p, per)
    send = counts.view(p, per).sum(1).tolist()
    recv = received.sum(1).tolist()
    mine = AllToAllRows.apply(rows, recv, send, moe.dist, moe.group)
    done = _run_local_experts(moe.experts, mine, received)
    return AllToAllRows.apply(done, send, recv, moe.dist, moe.group)


def moe_forward(moe: MoE, x: torch.Tensor, *,
                keep: Callable[..., torch.Tensor] = keep_top_scores,
                permute: Callable[..., tuple[torch.Tensor, torch.Tensor]] = permute,
                unpermute: Callable[..., torch.Tensor] = unpermute) -> torch.Tensor:
    """The layer's forward, its pieces given (the exercises' checks pass the learner's):
    route each group, permute, experts (across the ep group), unpermute."""
    tokens = x.reshape(-1, x.shape[-1])
    if len(tokens) % moe.groups:
        raise ValueError(_("{n} tokens do not split into {groups} groups", n=len(tokens),
                           groups=moe.groups))
    routing = Routing.cat([route(moe, g, keep) for g in tokens.tensor_split(moe.groups)])
    rows, order = permute(tokens, routing.expert_index, routing.kept)
    counts = tokens_per_expert(routing.expert_index, routing.kept, moe.num_experts)
    out = unpermute(_run_experts(moe, rows, counts), order, routing.weights, len(tokens))
    moe.aux_loss, moe.tokens_per_expert = routing.aux_loss, counts
    return out.view(x.shape)


# --- the single-process reference ---------------------------------------------------------------

def dense_reference(moe: MoE, x: torch.Tensor, groups: int = 1) -> tuple[torch.Tensor,
                                                                            torch.Tensor]:
    """(output, aux loss) of one process that runs every expert on every token of the batch and
    weights each by its gate (0 unless chosen and kept), routed in `groups` equal groups of
    tokens, as that many ranks would route them; `moe` must hold every expert."""
    if len(moe.experts) != moe.num_experts:
        raise ValueError(_("dense_reference needs the whole layer (every expert)"))
    tokens = x.reshape(-1, x.shape[-1])
    routes = [route(moe, g) for g in tokens.tensor_split(groups)]
    gate = torch.cat([torch.zeros_like(r.probs).scatter(1, r.expert_index, r.weights)
                      for r in routes]).to(tokens.dtype)
    out = sum(gate[:, e:e + 1] * expert(tokens) for e, expert in enumerate(moe.experts))
    return out.view(x.shape), torch.stack([r.aux_loss for r in routes]).mean()


def expert_parameters(model: nn.Module) -> list[nn.Parameter]:
    """The parameters of every MoE layer's experts: sharded over ep, so reduced over the
    expert-data-parallel ranks only, never over ep."""
    return [p for m in model.modules() if isinstance(m, MoE) for p in m.experts.parameters()]


# --- the communication model --------------------------------------------------------------------

def moe_bytes(counts: torch.Tensor, rank: int, dim: int, itemsize: int,
              backward: bool = True) -> int:
    """Bytes `rank` sends in one MoE layer's step under expert parallelism over p ranks,
    counts[i, e] (p x E) being the kept choices rank i sends to expert e: the counts exchange
    ((p - 1) E / p int64s), its rows out to remote experts, the results of remote sources'
    rows back to them; the backward sends the same rows' gradients again."""
    p, num_experts = counts.shape
    rows = counts.view(p, p, num_experts // p).sum(-1)  # rows[i, j]: rank i to rank j
    out = int(rows[rank].sum() - rows[rank, rank])
    back = int(rows[:, rank].sum() - rows[rank, rank])
    passes = 2 if backward else 1
    return (p - 1) * (num_experts // p) * 8 + passes * (out + back) * dim * itemsize


def moe_bytes_balanced(num_tokens: int, k: int, world_size: int, num_experts: int, dim: int,
                       itemsize: int) -> float:
    """`moe_bytes` when every rank sends every expert the same share of its T k choices and
    nothing is dropped: (p - 1) E / p * 8 + 4 T k (p - 1) / p * d * itemsize."""
    p = world_size
    return (p - 1) * num_experts / p * 8 + 4 * num_tokens * k * (p - 1) / p * dim * itemsize
