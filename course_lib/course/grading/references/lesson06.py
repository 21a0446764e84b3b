"""Lesson 06's expected values and explanations (judge side: see this package's docstring).

The expected values come from plain PyTorch on one process (slicing, `nn.Linear`,
`nn.MultiheadAttention`), never from `course_lib.tensor_parallel`, the component being built.
"""

from __future__ import annotations

import functools
import math

import torch
import torch.nn.functional as F

from course_lib.course.grading.exercises import lesson06 as ex
from course_lib.i18n import _


def _keeps_rng(fn):
    """Seeding to rebuild a case's layers must leave the caller's random state alone (the
    judge runs in the learner's kernel for a check cell)."""
    @functools.wraps(fn)
    def wrapped(*args, **kwargs):
        with torch.random.fork_rng(devices=[]):
            return fn(*args, **kwargs)
    return wrapped


def _slice(tensor: torch.Tensor, dim: int, rank: int, k: int, parts: int = 1) -> torch.Tensor:
    """Rank's contiguous 1/k of each of the `parts` equal blocks along `dim`, joined."""
    return torch.cat([block.chunk(k, dim=dim)[rank] for block in tensor.chunk(parts, dim=dim)],
                     dim=dim)


def _close(a, b) -> bool:
    return (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.shape == b.shape
            and torch.allclose(a.double(), b.double(), rtol=1e-9, atol=1e-10))


def _passes(text: str) -> tuple[str, str]:
    """'forward: X; backward: Y' -> (X, Y); anything else -> ('', '')."""
    try:
        forward, backward = text.split("; ")
        return forward.split(": ", 1)[1], backward.split(": ", 1)[1]
    except (AttributeError, ValueError, IndexError):
        return "", ""


# --- lesson06.shard ----------------------------------------------------------------------------

def shard(tensor, dim: int, rank: int, world_size: int, parts: int = 1):
    return _slice(tensor, dim, rank, world_size, parts).clone()


def explain_shard(case, rank, expected, got) -> str | None:
    tensor, dim, me, k = case.args
    parts = case.kwargs.get("parts", 1)
    if not isinstance(got, torch.Tensor) or got.shape != expected.shape:
        return None
    axis = _("elements") if tensor.dim() == 1 else _("rows") if dim == 0 else _("columns")
    for other in range(k):
        if other != me and _close(got, _slice(tensor, dim, other, k, parts)):
            return _("this is rank {other}'s slice; rank {rank} of {k} owns the slice number "
                     "{rank}, counting from 0", other=other, rank=me, k=k)
    if parts > 1 and _close(got, _slice(tensor, dim, me, k)):
        return _("a slice of the whole tensor, as if it were one block: with parts={parts}, "
                 "rank {rank} owns its slice of each of the {parts} packed blocks",
                 parts=parts, rank=me)
    if _close(got, tensor.index_select(dim, torch.arange(me, tensor.shape[dim], k))):
        return _("{axis}: one of every {k}, interleaved; a rank's slice is contiguous",
                 k=k, axis=axis)
    size = expected.shape[dim] // parts
    right = me * size
    for start in range(tensor.shape[dim] - size + 1):
        if parts == 1 and start != right and _close(got, tensor.narrow(dim, start, size)):
            return _("a contiguous run of {axis}, but not rank {rank}'s: it starts at index "
                     "{start}, and rank {rank}'s slice starts at index {right}", axis=axis,
                     rank=me, start=start, right=right)
    return None


# --- lesson06.copy_to_parallel (f) -------------------------------------------------------------

def copy_to_parallel(rank: int, world_size: int, k: int, seed: int):
    if rank >= k:
        return None
    return {"comm": ex.comm({}, {"all_reduce": 1}), "out": ex.copy_input(seed),
            "dx": sum(ex.copy_upstream(seed, r) for r in range(k))}


def explain_copy_to_parallel(case, rank, expected, got) -> str | None:
    if expected is None or not isinstance(got, dict):
        return None
    k, seed = case.args[2], case.args[3]
    forward, backward = _passes(got.get("comm"))
    if forward and forward != "none":
        return _("the forward pass ran {calls}: f's input is already whole on every rank, so "
                 "its forward is the identity", calls=forward)
    own = ex.copy_upstream(seed, rank)
    if backward == "none" or _close(got.get("dx"), own):
        return _("rank {rank}'s dL/dx is only its own shard's term: the backward pass must sum "
                 "it over the {k} ranks", rank=rank, k=k)
    if backward and backward != "all_reduce":
        return _("the backward pass ran {calls}; the sum over the ranks takes one all_reduce",
                 calls=backward)
    if _close(got.get("dx"), k * expected["dx"]):
        return _("dL/dx is {k} times the sum over the ranks: it was summed twice", k=k)
    if not _close(got.get("out"), expected["out"]):
        return _("the output is not the input as it came in: f's forward is the identity")
    return None


# --- lesson06.reduce_from_parallel (g) ---------------------------------------------------------

def reduce_from_parallel(rank: int, world_size: int, k: int, seed: int):
    if rank >= k:
        return None
    return {"comm": ex.comm({"all_reduce": 1}, {}),
            "out": sum(ex.partial_result(seed, r) for r in range(k)),
            "d partial": ex.reduce_upstream(seed), "input kept": True}


def explain_reduce_from_parallel(case, rank, expected, got) -> str | None:
    if expected is None or not isinstance(got, dict):
        return None
    k, seed = case.args[2], case.args[3]
    forward, backward = _passes(got.get("comm"))
    if forward == "none" or _close(got.get("out"), ex.partial_result(seed, rank)):
        return _("the output is rank {rank}'s own partial result: the forward pass must sum "
                 "the partial results of the {k} ranks", rank=rank, k=k)
    if backward and backward != "none":
        return _("the backward pass ran {calls}: dL/dz is already the same on every rank and "
                 "is each partial result's gradient; summing it over the ranks multiplies it "
                 "by {k}", calls=backward, k=k)
    if got.get("input kept") is False:
        return _("the caller's partial result was overwritten by the sum: g must leave its "
                 "input as it was")
    if forward and forward != "all_reduce":
        return _("the forward pass ran {calls}; summing over the ranks takes one all_reduce",
                 calls=forward)
    if _close(got.get("out"), k * expected["out"]):
        return _("the output is {k} times the sum: it was summed twice", k=k)
    return None


# --- lesson06.gather_from_parallel -------------------------------------------------------------

def gather_from_parallel(rank: int, world_size: int, k: int, seed: int):
    if rank >= k:
        return None
    return {"comm": ex.comm({"all_gather": 1}, {}), "out": ex.gathered(seed, k),
            "d partial": ex.gather_upstream(seed, k)[:, 2 * rank:2 * rank + 2]}


def explain_gather_from_parallel(case, rank, expected, got) -> str | None:
    if expected is None or not isinstance(got, dict):
        return None
    k, seed = case.args[2], case.args[3]
    forward, backward = _passes(got.get("comm"))
    if backward and backward != "none":
        return _("the backward pass ran {calls}: every rank computed the same loss from the "
                 "whole output, so each already holds its own slice's gradient", calls=backward)
    if forward and forward != "all_gather":
        return _("the forward pass ran {calls}: putting the {k} slices side by side is one "
                 "all_gather (an all_reduce of padded copies moves about {k} times the data)",
                 calls=forward, k=k)
    grad = got.get("d partial")
    for other in range(k):
        if other != rank and _close(grad, ex.gather_upstream(seed, k)[:, 2 * other:2 * other + 2]):
            return _("rank {rank}'s slice got the gradient of rank {other}'s slice",
                     rank=rank, other=other)
    out = got.get("out")
    if isinstance(out, torch.Tensor) and out.shape != expected["out"].shape:
        return _("the output has shape {got}; the {k} slices side by side along the last "
                 "dimension make {expected}", got=tuple(out.shape), k=k,
                 expected=tuple(expected["out"].shape))
    if not _close(out, expected["out"]):
        return _("the output holds the slices in another order than the ranks'")
    return None


# --- lesson06.column_parallel_forward ----------------------------------------------------------

def _column(k: int, seed: int) -> tuple:
    """(full layer, x, output, gradients) of the unsplit layer on one process."""
    n_in, n_out = ex.dims(k)
    full = ex.full_linear(seed, n_in, n_out)
    x = ex.layer_input(seed, n_in).requires_grad_()
    y = full(x)
    (y * ex.layer_upstream(seed, n_out)).sum().backward()
    return full, x, y.detach()


@_keeps_rng
def column_parallel_forward(rank: int, world_size: int, k: int, seed: int, gather: bool):
    if rank >= k:
        return None
    full, x, y = _column(k, seed)
    mine = lambda t, dim=0: t.chunk(k, dim=dim)[rank]  # noqa: E731
    return {"comm": ex.comm({"all_gather": 1} if gather else {}, {"all_reduce": 1}),
            "out": y if gather else mine(y, -1), "dx": x.grad,
            "dW": mine(full.weight.grad), "db": mine(full.bias.grad)}


@_keeps_rng
def explain_column_parallel_forward(case, rank, expected, got) -> str | None:
    if expected is None or not isinstance(got, dict):
        return None
    k, seed, gather = case.args[2:5]
    forward, backward = _passes(got.get("comm"))
    out = got.get("out")
    width = expected["out"].shape[-1]
    if gather and isinstance(out, torch.Tensor) and out.shape[-1] == width // k:
        return _("the output is this rank's slice of the features; with gather_output every "
                 "rank needs all {n} of them", n=width)
    if not gather and forward != "none":
        return _("the forward pass ran {calls}: without gather_output the output stays split "
                 "and the forward needs no communication", calls=forward)
    if backward == "none":
        return _("rank {rank}'s dL/dx is only its own shard's term: the backward pass must sum "
                 "it over the {k} ranks", rank=rank, k=k)
    if backward != "all_reduce":
        return _("the backward pass ran {calls}; dL/dx takes one all_reduce", calls=backward)
    if _close(got.get("dx"), k * expected["dx"]):
        return _("dL/dx is {k} times the unsplit layer's: it was summed twice", k=k)
    return None


# --- lesson06.row_parallel_forward -------------------------------------------------------------

@_keeps_rng
def row_parallel_forward(rank: int, world_size: int, k: int, seed: int, parallel_input: bool):
    if rank >= k:
        return None
    n_out, n_in = ex.dims(k)
    full = ex.full_linear(seed, n_in, n_out)
    h = ex.layer_input(seed, n_in).requires_grad_()
    y = full(h)
    (y * ex.layer_upstream(seed, n_out)).sum().backward()
    mine = lambda t: t.chunk(k, dim=-1)[rank]  # noqa: E731
    return {"comm": ex.comm({"all_reduce": 1}, {} if parallel_input else {"all_reduce": 1}),
            "out": y.detach(), "dx": mine(h.grad) if parallel_input else h.grad,
            "dW": mine(full.weight.grad), "db": full.bias.grad}


@_keeps_rng
def explain_row_parallel_forward(case, rank, expected, got) -> str | None:
    if expected is None or not isinstance(got, dict):
        return None
    k, seed, parallel_input = case.args[2:5]
    n_out, n_in = ex.dims(k)
    bias = ex.full_linear(seed, n_in, n_out).bias.detach()
    forward, backward = _passes(got.get("comm"))
    if _close(got.get("out"), expected["out"] + (k - 1) * bias):
        return _("the output holds the bias {k} times, once from each rank: it belongs in the "
                 "sum once", k=k)
    if forward == "none":
        return _("the forward pass sent nothing: the output is rank {rank}'s partial result, "
                 "not the sum over the {k} ranks", rank=rank, k=k)
    dx = got.get("dx")
    if not parallel_input and isinstance(dx, torch.Tensor) and dx.shape == expected["dx"].shape:
        want = expected["dx"].chunk(k, dim=-1)
        have = dx.chunk(k, dim=-1)
        if _close(have[rank], want[rank]) and all(
                not have[r].abs().max() for r in range(k) if r != rank):
            return _("dL/dx is right only in rank {rank}'s chunk of the input and zero in the "
                     "others: every rank's chunk comes from the same x, so the gradient must "
                     "be summed over the {k} ranks", rank=rank, k=k)
    if backward != _passes(expected["comm"])[1]:
        return _("the backward pass ran {calls}, the unsplit layer's gradients take {want}",
                 calls=backward, want=_passes(expected["comm"])[1])
    return None


# --- lesson06.attention_forward ----------------------------------------------------------------

def _attention(seed: int, causal: bool) -> tuple:
    mha = ex.attention_module(seed)
    x = ex.attention_input(seed).requires_grad_()
    mask = torch.triu(torch.ones(ex.SEQ, ex.SEQ, dtype=torch.bool), 1) if causal else None
    y, _w = mha(x, x, x, attn_mask=mask, need_weights=False)
    (y * ex.attention_upstream(seed)).sum().backward()
    return y.detach(), x.grad


@torch.no_grad()
def _split_attention(seed: int, k: int, causal: bool, heads_first: bool = False,
                     back_behind_seq: bool = True) -> torch.Tensor:
    """The output of attention split by heads over k ranks and summed, on one process, with
    one of two mistakes if asked: the packed projection read as (heads, 3) instead of (3,
    heads), or the heads joined without moving them back behind the sequence."""
    with torch.random.fork_rng(devices=[]):
        mha = ex.attention_module(seed)
    x = ex.attention_input(seed)
    b, t, e = x.shape
    heads, hd = ex.HEADS // k, e // ex.HEADS
    out = mha.out_proj.bias.detach().clone()
    for r in range(k):
        qkv = F.linear(x, _slice(mha.in_proj_weight, 0, r, k, 3),
                       _slice(mha.in_proj_bias, 0, r, k, 3))
        if heads_first:
            q, kk, v = qkv.view(b, t, heads, 3, hd).unbind(dim=3)
        else:
            q, kk, v = qkv.view(b, t, 3, heads, hd).unbind(dim=2)
        y = F.scaled_dot_product_attention(q.transpose(1, 2), kk.transpose(1, 2),
                                           v.transpose(1, 2), is_causal=causal)
        y = y.transpose(1, 2) if back_behind_seq else y
        out = out + F.linear(y.reshape(b, t, heads * hd), _slice(mha.out_proj.weight, 1, r, k))
    return out


@_keeps_rng
def attention_forward(rank: int, world_size: int, k: int, seed: int, causal: bool):
    if rank >= k:
        return None
    y, dx = _attention(seed, causal)
    return {"comm": ex.comm({"all_reduce": 1}, {"all_reduce": 1}), "out": y, "dx": dx}


@_keeps_rng
def explain_attention_forward(case, rank, expected, got) -> str | None:
    if expected is None or not isinstance(got, dict):
        return None
    seed, causal = case.args[3], case.args[4]
    if got.get("comm") != expected["comm"]:
        forward, backward = _passes(got.get("comm"))
        return _("the passes ran {forward} forward and {backward} backward; the output "
                 "projection's all_reduce is the block's only communication in each",
                 forward=forward, backward=backward)
    out = got.get("out")
    k = case.args[2]
    if _close(out, _split_attention(seed, k, causal, heads_first=True)):
        return _("q, k and v were taken from the wrong places: the packed projection's last "
                 "dimension holds all of this rank's q heads, then all its k heads, then all "
                 "its v heads")
    if _close(out, _split_attention(seed, k, causal, back_behind_seq=False)):
        return _("sequence positions and heads are mixed: the heads must come back behind the "
                 "sequence before they are joined into one dimension")
    if causal and _close(out, _attention(seed, False)[0]):
        return _("the output is that of attention without the causal mask: this case asks "
                 "for causal attention (attn.causal)")
    if not causal and _close(out, _attention(seed, True)[0]):
        return _("the output is that of causal attention; this case is not causal "
                 "(attn.causal)")
    return None


# --- lesson06.initial_slice --------------------------------------------------------------------

@_keeps_rng
def initial_slice(n_in: int, n_out: int, dim: int, parts: int, rank: int, k: int, bias: bool,
                  seed: int) -> dict:
    torch.manual_seed(seed)
    full = torch.nn.Linear(n_in, n_out, bias=bias)
    b = full.bias
    if b is not None and dim == 0:
        b = _slice(b, 0, rank, k, parts)
    return {"weight": _slice(full.weight, dim, rank, k, parts).detach(),
            "bias": None if b is None else b.detach()}


@_keeps_rng
def explain_initial_slice(case, rank, expected, got) -> str | None:
    n_in, n_out, dim, parts, me, k, bias, seed = case.args
    if not isinstance(got, dict) or not isinstance(got.get("weight"), torch.Tensor):
        return None
    weight = got["weight"]
    if weight.shape != expected["weight"].shape:
        return None
    bound = 1 / math.sqrt(n_in)
    torch.manual_seed(seed)
    first = torch.empty(weight.shape).uniform_(-bound, bound)
    if me and _close(weight, first):
        return _("these are the first numbers nn.Linear draws, which every rank would hold: "
                 "rank {rank}'s slice comes from further along the same stream", rank=me)
    torch.manual_seed(seed)
    full = torch.nn.Linear(n_in, n_out, bias=bias)
    if parts > 1 and _close(weight, _slice(full.weight.detach(), dim, me, k)):
        return _("contiguous rows of the packed weight, as if it were one block: with "
                 "parts={parts}, rank {rank} owns rows in each of the {parts} blocks",
                 parts=parts, rank=me)
    if not _close(weight, expected["weight"]):
        return _("not rank {rank}'s slice of nn.Linear's weight: the draws must follow "
                 "nn.Linear's order (the weight row after row, then the bias) from the random "
                 "state as it came in", rank=me)
    if expected["bias"] is None:
        return _("this layer has no bias: return None for it") if got.get("bias") is not None \
            else None
    b = got.get("bias")
    if isinstance(b, torch.Tensor) and b.shape == expected["bias"].shape:
        return _("the weight is right but the bias is not nn.Linear's: it is drawn after the "
                 "whole weight, in the same bound")
    return None
