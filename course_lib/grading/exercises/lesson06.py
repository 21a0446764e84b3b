"""Lesson 06 (tensor parallel): the right shard of a weight; f, g and the all-gather, forward and
backward; the column- and row-parallel layers' forward passes. The distributed checks run on 2,
3 and 4 ranks and count the collectives of each pass: where the communication goes is the
lesson's point (an all_reduce in the wrong pass often gives wrong gradients only upstream)."""

from __future__ import annotations

import torch
from torch import nn

from course_lib.grading import RANK, WORLD_SIZE, Exercise, case, register
from course_lib.grading.sub_worlds import on_first_ranks, register_on_sub_worlds


def _matrix(rows: int, cols: int):
    return torch.arange(rows * cols, dtype=torch.float32).reshape(rows, cols)


def _shard_reference(tensor, dim: int, rank: int, world_size: int, parts: int = 1):
    from course_lib.tensor_parallel import shard

    return shard(tensor, dim, rank, world_size, parts)


register(Exercise(
    name="lesson06.shard",
    notebook="06_tensor_parallel",
    params=("tensor", "dim", "rank", "world_size", "parts"),
    cases=[
        case(_matrix(4, 6), 0, 0, 2, label="rows, rank 0 of 2"),
        case(_matrix(4, 6), 0, 1, 2, label="rows, rank 1 of 2"),
        case(_matrix(4, 6), 1, 2, 3, label="columns, rank 2 of 3"),
        case(_matrix(6, 2)[:, 0].clone(), 0, 1, 3, label="a bias, rank 1 of 3"),
        case(_matrix(12, 2), 0, 1, 2, parts=3, label="packed q, k, v (parts=3), rank 1 of 2"),
    ],
    reference=_shard_reference,
    points=2,
    hints=("Rank r of p owns the r-th of p equal contiguous slices along `dim`: "
          "tensor.narrow(dim, r * size, size). With parts > 1, take that slice of each of the "
          "`parts` blocks (tensor.chunk(parts, dim)) and concatenate them.",),
))




def _randn(seed: int, *shape: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def _passes(dist, forward, loss) -> dict:
    """Run `forward()`, then `loss(output).backward()`; the output and each pass's collectives."""
    dist.reset()
    y = forward()
    calls = {"forward collectives": dict(dist.calls)}
    dist.reset()
    loss(y).backward()
    calls["backward collectives"] = dict(dist.calls)
    return {"output": y.detach(), **calls}


def _on_sub_worlds(body):
    def harness(fn, rank: int, world_size: int, k: int, *args):
        return on_first_ranks(k, body, fn, *args)
    return harness


def _register_06(name: str, cases: list, reference, harness, hint: str, params: tuple) -> None:
    register_on_sub_worlds(name, "06_tensor_parallel", params=params, cases=cases,
                           reference=reference, harness=harness, points=2, rtol=1e-10,
                           atol=1e-12, hints=(hint,))


_FG_CASES = [case(RANK, WORLD_SIZE, k, seed, label=f"{k} ranks") for k, seed in
             ((2, 0), (3, 1), (4, 2))]


# --- lesson06.copy_to_parallel (f) -------------------------------------------------------------

def _copy_body(dist, rank: int, fn, seed: int) -> dict:
    """x is the same on every rank (a column-parallel layer's input); rank r's loss uses its own
    weight, like its shard of the layer, so dL/dx is the sum over ranks."""
    x = _randn(seed, 3, 4).requires_grad_()
    out = _passes(dist, lambda: fn(x, dist, None),
                  lambda y: (y * _randn(100 * seed + rank, 3, 4)).sum())
    return {**out, "x.grad": x.grad}


def _copy_reference(rank: int, world_size: int, k: int, seed: int):
    if rank >= k:
        return None
    return {"output": _randn(seed, 3, 4), "forward collectives": {},
            "backward collectives": {"all_reduce": 1},
            "x.grad": sum(_randn(100 * seed + r, 3, 4) for r in range(k))}


_register_06("lesson06.copy_to_parallel", _FG_CASES, _copy_reference, _on_sub_worlds(_copy_body),
             "f is the identity forward (no communication). Backward, each rank holds only its "
             "shard's part of dL/dx: all_reduce (SUM) the gradient, once, so each rank gets the "
             "whole of it; return None for dist and group.", ("x", "dist", "group"))


# --- lesson06.reduce_from_parallel (g) ---------------------------------------------------------

def _reduce_body(dist, rank: int, fn, seed: int) -> dict:
    """Each rank holds a different partial result; one loss on their sum, the same everywhere."""
    part = (_randn(seed, 3, 4) * (rank + 1)).requires_grad_()
    before = part.detach().clone()
    out = _passes(dist, lambda: fn(part, dist, None), lambda y: (y * _randn(seed + 7, 3, 4)).sum())
    return {**out, "partial.grad": part.grad, "input left as it was": torch.equal(part, before)}


def _reduce_reference(rank: int, world_size: int, k: int, seed: int):
    if rank >= k:
        return None
    return {"output": sum(_randn(seed, 3, 4) * (r + 1) for r in range(k)),
            "forward collectives": {"all_reduce": 1}, "backward collectives": {},
            "partial.grad": _randn(seed + 7, 3, 4), "input left as it was": True}


_register_06("lesson06.reduce_from_parallel", _FG_CASES, _reduce_reference,
             _on_sub_worlds(_reduce_body),
             "g sums the partial outputs forward: one all_reduce into a copy (do not change the "
             "input in place). Backward, the output is the same on every rank, so each partial "
             "result gets the gradient unchanged: no communication.", ("x", "dist", "group"))


# --- lesson06.gather_from_parallel -------------------------------------------------------------

def _gather_body(dist, rank: int, fn, seed: int) -> dict:
    """Rank r holds columns r*2..r*2+1 of the output; the loss uses the whole gathered output."""
    k = dist.get_world_size()
    part = _randn(seed, 3, 2 * k)[:, 2 * rank:2 * rank + 2].clone().requires_grad_()
    out = _passes(dist, lambda: fn(part, dist, None),
                  lambda y: (y * _randn(seed + 7, 3, 2 * k)).sum())
    return {**out, "partial.grad": part.grad}


def _gather_reference(rank: int, world_size: int, k: int, seed: int):
    if rank >= k:
        return None
    return {"output": _randn(seed, 3, 2 * k), "forward collectives": {"all_gather": 1},
            "backward collectives": {},
            "partial.grad": _randn(seed + 7, 3, 2 * k)[:, 2 * rank:2 * rank + 2]}


_register_06("lesson06.gather_from_parallel", _FG_CASES, _gather_reference,
             _on_sub_worlds(_gather_body),
             "Forward: one all_gather of the (contiguous) slice into world_size tensors, "
             "concatenated along the last dimension in rank order. Backward: every rank computed "
             "the same loss from the whole output, so keep only this rank's slice of the "
             "gradient (grad.chunk(world, -1)[rank]): no communication.", ("x", "dist", "group"))


# --- lesson06.column_parallel_forward and lesson06.row_parallel_forward ------------------------
# The learner's function becomes the layer's forward; the layer holds its shard of one full
# float64 nn.Linear, and everything is compared with that unsplit layer on one process.

_B, _IN, _OUT = 3, 4, 6  # a multiple of 2 and 3; 4 ranks get in 4 / out 8 below


def _dims(k: int) -> tuple[int, int]:
    return (_IN, _OUT) if k < 4 else (_IN, 8)


def _full(seed: int, n_in: int, n_out: int) -> nn.Linear:
    torch.manual_seed(seed)
    return nn.Linear(n_in, n_out).double()


def _column_body(dist, rank: int, fn, seed: int, gather: bool) -> dict:
    from course_lib.tensor_parallel import ColumnParallelLinear

    k = dist.get_world_size()
    n_in, n_out = _dims(k)
    layer = ColumnParallelLinear.from_linear(_full(seed, n_in, n_out), gather_output=gather,
                                             dist=dist)
    layer.forward = lambda x: fn(layer, x)
    x = _randn(seed + 1, _B, n_in).requires_grad_()
    w = _randn(seed + 2, _B, n_out)
    if not gather:  # this rank's output columns meet their part of the loss
        w = w.chunk(k, dim=-1)[rank]
    out = _passes(dist, lambda: layer(x), lambda y: (y * w).sum())
    return {**out, "x.grad": x.grad, "weight.grad": layer.weight.grad, "bias.grad": layer.bias.grad}


def _column_reference(rank: int, world_size: int, k: int, seed: int, gather: bool):
    if rank >= k:
        return None
    n_in, n_out = _dims(k)
    full = _full(seed, n_in, n_out)
    x = _randn(seed + 1, _B, n_in).requires_grad_()
    y = full(x)
    (y * _randn(seed + 2, _B, n_out)).sum().backward()
    mine = lambda t, dim=0: t.chunk(k, dim=dim)[rank]  # noqa: E731
    return {"output": y.detach() if gather else mine(y.detach(), -1),
            "forward collectives": {"all_gather": 1} if gather else {},
            "backward collectives": {"all_reduce": 1}, "x.grad": x.grad,
            "weight.grad": mine(full.weight.grad), "bias.grad": mine(full.bias.grad)}


_register_06(
    "lesson06.column_parallel_forward",
    [case(RANK, WORLD_SIZE, k, seed, gather, label=f"{k} ranks" + (", gather_output" if gather
                                                                  else ""))
     for k, seed, gather in ((2, 0, False), (3, 1, True), (4, 2, False), (4, 3, True))],
    _column_reference, _on_sub_worlds(_column_body),
    "f on the input (copy_to_parallel(x, layer.dist, layer.group)), then F.linear with this "
    "rank's weight and bias rows; with layer.gather_output, gather_from_parallel the result.",
    ("layer", "x"))


def _row_body(dist, rank: int, fn, seed: int, parallel_input: bool) -> dict:
    from course_lib.tensor_parallel import RowParallelLinear

    k = dist.get_world_size()
    n_out, n_in = _dims(k)  # split along the input: the larger dimension
    layer = RowParallelLinear.from_linear(_full(seed, n_in, n_out),
                                          input_is_parallel=parallel_input, dist=dist)
    layer.forward = lambda x: fn(layer, x)
    h = _randn(seed + 1, _B, n_in)
    x = (h.chunk(k, dim=-1)[rank].clone() if parallel_input else h).requires_grad_()
    out = _passes(dist, lambda: layer(x), lambda y: (y * _randn(seed + 2, _B, n_out)).sum())
    return {**out, "x.grad": x.grad, "weight.grad": layer.weight.grad, "bias.grad": layer.bias.grad}


def _row_reference(rank: int, world_size: int, k: int, seed: int, parallel_input: bool):
    if rank >= k:
        return None
    n_out, n_in = _dims(k)
    full = _full(seed, n_in, n_out)
    h = _randn(seed + 1, _B, n_in).requires_grad_()
    y = full(h)
    (y * _randn(seed + 2, _B, n_out)).sum().backward()
    mine = lambda t: t.chunk(k, dim=-1)[rank]  # noqa: E731
    return {"output": y.detach(), "forward collectives": {"all_reduce": 1},
            "backward collectives": {} if parallel_input else {"all_reduce": 1},
            "x.grad": mine(h.grad) if parallel_input else h.grad,
            "weight.grad": mine(full.weight.grad), "bias.grad": full.bias.grad}


_register_06(
    "lesson06.row_parallel_forward",
    [case(RANK, WORLD_SIZE, k, seed, par, label=f"{k} ranks" + ("" if par else
                                                             ", whole input"))
     for k, seed, par in ((2, 0, True), (3, 1, False), (4, 2, True), (3, 3, True))],
    _row_reference, _on_sub_worlds(_row_body),
    "Without layer.input_is_parallel, f on the whole input and keep this rank's chunk of its "
    "last dimension. Then F.linear with this rank's weight columns and no bias, "
    "reduce_from_parallel (g) to sum the partial results, and add the bias once, after the sum.",
    ("layer", "x"))


# --- lesson06.attention_forward ----------------------------------------------------------------

_HEADS, _EMBED, _SEQ = 12, 24, 5  # 12 heads: 6, 4 and 3 per rank on 2, 3 and 4 ranks


def _mha(seed: int) -> nn.MultiheadAttention:
    torch.manual_seed(seed)
    return nn.MultiheadAttention(_EMBED, _HEADS, batch_first=True, dtype=torch.float64)


def _attention_body(dist, rank: int, fn, seed: int, causal: bool) -> dict:
    from course_lib.tensor_parallel import TensorParallelAttention

    attn = TensorParallelAttention.from_torch(_mha(seed), causal=causal, dist=dist)
    attn.forward = lambda x: fn(attn, x)
    x = _randn(seed + 1, 2, _SEQ, _EMBED).requires_grad_()
    out = _passes(dist, lambda: attn(x), lambda y: (y * _randn(seed + 2, 2, _SEQ, _EMBED)).sum())
    return {**out, "x.grad": x.grad}


def _attention_reference(rank: int, world_size: int, k: int, seed: int, causal: bool):
    if rank >= k:
        return None
    mha = _mha(seed)
    x = _randn(seed + 1, 2, _SEQ, _EMBED).requires_grad_()
    mask = torch.triu(torch.ones(_SEQ, _SEQ, dtype=torch.bool), 1) if causal else None
    y, _ = mha(x, x, x, attn_mask=mask, need_weights=False)
    (y * _randn(seed + 2, 2, _SEQ, _EMBED)).sum().backward()
    return {"output": y.detach(), "forward collectives": {"all_reduce": 1},
            "backward collectives": {"all_reduce": 1}, "x.grad": x.grad}


_register_06(
    "lesson06.attention_forward",
    [case(RANK, WORLD_SIZE, k, seed, causal, label=f"{k} ranks" + (", causal" if causal else ""))
     for k, seed, causal in ((2, 0, False), (3, 1, True), (4, 2, False))],
    _attention_reference, _on_sub_worlds(_attention_body),
    "q, k, v = attn.qkv(x).view(b, t, 3, attn.local_heads, attn.head_dim).unbind(2), each "
    "transposed to (b, heads, t, head_dim); F.scaled_dot_product_attention(q, k, v, "
    "is_causal=attn.causal); transpose back, reshape to (b, t, local_heads * head_dim), and "
    "attn.out_proj of that.",
    ("attn", "x"))


# --- lesson06.initial_slice --------------------------------------------------------------------

def init_harness(fn, n_in: int, n_out: int, dim: int, parts: int, rank: int, k: int,
                 bias: bool, seed: int) -> dict:
    """`fn` on a stand-in layer (only the fields it reads), from a known random state."""
    from types import SimpleNamespace

    layer = SimpleNamespace(in_features=n_in, out_features=n_out, dim=dim, parts=parts,
                            rank=rank, world_size=k)
    torch.manual_seed(seed)
    weight, b = fn(layer, bias)
    return {"weight": weight, "bias": b}


def _init_reference(n_in: int, n_out: int, dim: int, parts: int, rank: int, k: int,
                    bias: bool, seed: int) -> dict:
    from course_lib.tensor_parallel import shard

    torch.manual_seed(seed)
    full = nn.Linear(n_in, n_out, bias=bias)
    b = full.bias
    if b is not None and dim == 0:
        b = shard(b, 0, rank, k, parts)
    return {"weight": shard(full.weight, dim, rank, k, parts).detach(),
            "bias": None if b is None else b.detach()}


register(Exercise(
    name="lesson06.initial_slice",
    notebook="06_tensor_parallel",
    params=("layer", "bias"),
    cases=[
        case(4, 6, 0, 1, 1, 2, True, 0, label="column-parallel, rank 1 of 2"),
        case(5, 12, 0, 1, 2, 3, True, 1, label="column-parallel, rank 2 of 3"),
        case(4, 18, 0, 3, 1, 3, True, 2, label="packed q, k, v (parts=3), rank 1 of 3"),
        case(8, 6, 1, 1, 3, 4, True, 3, label="row-parallel, rank 3 of 4"),
        case(6, 5, 1, 1, 0, 3, False, 4, label="row-parallel, rank 0 of 3, no bias"),
    ],
    reference=_init_reference,
    harness=init_harness,
    points=2,
    rtol=0, atol=0,
    hints=("bound = 1 / sqrt(in_features). Draw the weight in blocks of rows, in order, each "
          "torch.empty(rows_in_block, in_features).uniform_(-bound, bound): keep the blocks j "
          "with j % world_size == rank (column-parallel, blocks of out_features / (world_size "
          "* parts) rows) or this rank's columns of each block (row-parallel). Then draw the "
          "whole bias the same way and keep its shard (column) or all of it (row).",),
))
