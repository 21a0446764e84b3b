"""Lesson 06 (tensor parallel): the right shard of a weight; f, g and the all-gather, forward and
backward; the sharded initialization; the column- and row-parallel layers' forward passes and
attention split by heads. The distributed checks run on 2, 3 and 4 ranks and count the
collectives of each pass: where the communication goes is the lesson's point (an all_reduce in
the wrong pass often gives wrong gradients only upstream).

What a harness returns is a dict whose first key (in the table's sorted order) is "comm", the
collectives of each pass as one short string, so a table cut at 60 characters still shows it;
then the tensors: "out", "dx" (dL/dx), "dW" and "db" (this rank's weight and bias gradients),
"d partial" (the gradient of a rank's partial result or slice). Expected values and the
explanations of wrong ones are judge-side, in `course_lib/course/grading/references/lesson06.py`.

Components (course_lib.ddp, ...) are imported inside the functions that use them, on
purpose: the learner's overlay decides at each call which version runs (theirs or the
reference), and a name bound at import time would keep the first one.
"""

from __future__ import annotations

from types import SimpleNamespace

import torch
from torch import nn

from course_lib.course.grading import RANK, WORLD_SIZE, Exercise, case, register
from course_lib.course.grading.sub_worlds import (counted_passes, harness,
                                                  register_on_sub_worlds)

NOTEBOOK = "06_tensor_parallel"


def _matrix(rows: int, cols: int):
    return torch.arange(rows * cols, dtype=torch.float32).reshape(rows, cols)


register(Exercise(
    name="lesson06.shard",
    notebook=NOTEBOOK,
    params=("tensor", "dim", "rank", "world_size", "parts"),
    cases=[
        case(_matrix(4, 6), 0, 0, 2, label="rows, rank 0 of 2"),
        case(_matrix(4, 6), 0, 1, 2, label="rows, rank 1 of 2"),
        case(_matrix(4, 6), 1, 2, 3, label="columns, rank 2 of 3"),
        case(_matrix(6, 2)[:, 0].clone(), 0, 1, 3, label="a bias, rank 1 of 3"),
        case(_matrix(12, 2), 0, 1, 2, parts=3, label="packed q, k, v (parts=3), rank 1 of 2"),
    ],
    reference="lesson06:shard",
    explain="lesson06:explain_shard",
    points=2,
    hints=("Along `dim`, the ranks own equal, contiguous slices in rank order: rank 0 the "
           "first, rank 1 the next, and so on, with nothing left over. Packed blocks (q, k, v) "
           "are split each on its own: a rank owns its slice of every block.",
           "Picture 12 rows on 2 ranks with parts=3: three blocks of 4 rows; rank 1 keeps the "
           "last 2 rows of each block, 6 rows in all, in block order. So: cut the tensor into "
           "its blocks, take this rank's slice of each, and join the slices along the same "
           "dimension; `divide` gives the slice's size and refuses sizes that do not split."),
))


def _randn(seed: int, *shape: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def _calls(counted: dict) -> str:
    """{'all_reduce': 2} -> 'all_reduce x2'; nothing -> 'none'."""
    return ", ".join(name if n == 1 else f"{name} x{n}"
                     for name, n in sorted(counted.items()) if n) or "none"


def comm(forward: dict, backward: dict) -> str:
    """The collectives of each pass as the table shows them, e.g.
    'forward: none; backward: all_reduce'."""
    return f"forward: {_calls(forward)}; backward: {_calls(backward)}"


def _register_06(name: str, cases: list, harness, *, hints: tuple, params: tuple) -> None:
    function = name.split(".", 1)[1]
    register_on_sub_worlds(name, NOTEBOOK, params=params, cases=cases,
                           reference=f"lesson06:{function}", explain=f"lesson06:explain_{function}",
                           harness=harness, points=2, rtol=1e-10, atol=1e-12, hints=hints)


_FG_CASES = [case(RANK, WORLD_SIZE, 2, 0, label="2 ranks"),
             case(RANK, WORLD_SIZE, 3, 1, label="3 ranks"),
             case(RANK, WORLD_SIZE, 4, 2, label="4 ranks")]


# --- lesson06.copy_to_parallel (f) -------------------------------------------------------------

def copy_input(seed: int) -> torch.Tensor:
    """The input, the same on every rank (a column-parallel layer's)."""
    return _randn(seed, 3, 4)


def copy_upstream(seed: int, rank: int) -> torch.Tensor:
    """dL/dy on `rank`: rank r's loss uses its own weight, like its shard of the layer."""
    return _randn(100 * seed + rank, 3, 4)


def _copy_body(dist, rank: int, fn, seed: int) -> dict:
    x = copy_input(seed).requires_grad_()
    out = counted_passes(dist, lambda: fn(x, dist, None), copy_upstream(seed, rank), comm)
    return {**out, "dx": x.grad}


_register_06("lesson06.copy_to_parallel", _FG_CASES, harness(_copy_body), hints=(
    "f is the identity in the forward pass: every rank already holds the whole input. In the "
    "backward pass, rank r holds only its own term of dL/dx, the sum over ranks of dL/dy_r · "
    "A_r, and every rank needs the whole sum.",
    "Forward: remember on ctx what backward will need to communicate (the dist and the "
    "group), and hand the input on. Backward: one collective that sums the incoming gradient "
    "over the group, into a new tensor; then one gradient per input of forward, nothing for "
    "the two that are not tensors."), params=("x", "dist", "group"))


# --- lesson06.reduce_from_parallel (g) ---------------------------------------------------------

def partial_result(seed: int, rank: int) -> torch.Tensor:
    """Rank r's partial result: each rank's differs."""
    return _randn(seed, 3, 4) * (rank + 1)


def reduce_upstream(seed: int) -> torch.Tensor:
    """dL/dz, the same on every rank: one loss on the sum."""
    return _randn(seed + 7, 3, 4)


def _reduce_body(dist, rank: int, fn, seed: int) -> dict:
    part = partial_result(seed, rank).requires_grad_()
    before = part.detach().clone()
    out = counted_passes(dist, lambda: fn(part, dist, None), reduce_upstream(seed), comm)
    return {**out, "d partial": part.grad, "input kept": torch.equal(part, before)}


_register_06("lesson06.reduce_from_parallel", _FG_CASES, harness(_reduce_body), hints=(
    "g is f's conjugate. Forward: the output is the sum of the ranks' partial results, the "
    "same on every rank. Backward: dL/dz is then the same on every rank too, and it is "
    "already the gradient of each partial result.",
    "Forward: one collective that sums over the group, working on a copy, since the caller "
    "may still need its partial result. Backward: hand the incoming gradient on as it is; "
    "summing it again would multiply it by the number of ranks."), params=("x", "dist", "group"))


# --- lesson06.gather_from_parallel -------------------------------------------------------------

def gathered(seed: int, k: int) -> torch.Tensor:
    """The whole output on k ranks; rank r holds its columns 2r, 2r + 1."""
    return _randn(seed, 3, 2 * k)


def gather_upstream(seed: int, k: int) -> torch.Tensor:
    return _randn(seed + 7, 3, 2 * k)


def _gather_body(dist, rank: int, fn, seed: int) -> dict:
    k = dist.get_world_size()
    part = gathered(seed, k)[:, 2 * rank:2 * rank + 2].clone().requires_grad_()
    out = counted_passes(dist, lambda: fn(part, dist, None), gather_upstream(seed, k), comm)
    return {**out, "d partial": part.grad}


_register_06("lesson06.gather_from_parallel", _FG_CASES, harness(_gather_body), hints=(
    "Forward: every rank ends with all the slices side by side along the last dimension, in "
    "rank order. Backward: every rank computed the same loss from that whole output, so each "
    "already holds the gradient of its own slice: no communication.",
    "Forward: an all-gather fills one buffer per rank (a contiguous input), then the buffers "
    "are joined along the last dimension. Backward: cut the incoming gradient into as many "
    "equal pieces as there are ranks and keep this rank's piece; remember on ctx which one."),
    params=("x", "dist", "group"))


# --- lesson06.column_parallel_forward and lesson06.row_parallel_forward ------------------------
# The learner's function is called on a stand-in layer holding the fields the lesson lists:
# this rank's shard of one full float64 nn.Linear (rows, or columns and the whole bias), so the
# check needs nothing else the learner wrote. Compared with that unsplit layer on one process.

_B, _IN, _OUT = 3, 4, 6  # a multiple of 2 and 3; 4 ranks get in 4 / out 8 below


def dims(k: int) -> tuple[int, int]:
    return (_IN, _OUT) if k < 4 else (_IN, 8)


def full_linear(seed: int, n_in: int, n_out: int) -> nn.Linear:
    torch.manual_seed(seed)
    return nn.Linear(n_in, n_out).double()


def layer_input(seed: int, n: int) -> torch.Tensor:
    return _randn(seed + 1, _B, n)


def layer_upstream(seed: int, n: int) -> torch.Tensor:
    return _randn(seed + 2, _B, n)


def stand_in_layer(full: nn.Linear, dist, rank: int, k: int, dim: int, **flags) -> SimpleNamespace:
    """A layer's fields: rank's rows of `full` (dim 0, with its bias rows) or its columns (dim
    1, with the whole bias), the group (the counting dist's own), and the flags."""
    weight = full.weight.detach().chunk(k, dim=dim)[rank].clone()
    bias = full.bias.detach().clone()
    if dim == 0:
        bias = bias.chunk(k)[rank].clone()
    return SimpleNamespace(dist=dist, group=None, rank=rank, world_size=k, dim=dim, parts=1,
                           in_features=full.in_features, out_features=full.out_features,
                           weight=nn.Parameter(weight), bias=nn.Parameter(bias), **flags)


def _column_body(dist, rank: int, fn, seed: int, gather: bool) -> dict:
    k = dist.get_world_size()
    n_in, n_out = dims(k)
    layer = stand_in_layer(full_linear(seed, n_in, n_out), dist, rank, k, 0,
                           gather_output=gather)
    x = layer_input(seed, n_in).requires_grad_()
    w = layer_upstream(seed, n_out)
    if not gather:  # this rank's output columns meet their part of the loss
        w = w.chunk(k, dim=-1)[rank]
    out = counted_passes(dist, lambda: fn(layer, x), w, comm)
    return {**out, "dx": x.grad, "dW": layer.weight.grad, "db": layer.bias.grad}


_register_06(
    "lesson06.column_parallel_forward",
    [case(RANK, WORLD_SIZE, 2, 0, False, label="2 ranks"),
     case(RANK, WORLD_SIZE, 3, 1, True, label="3 ranks, gather_output"),
     case(RANK, WORLD_SIZE, 4, 2, False, label="4 ranks"),
     case(RANK, WORLD_SIZE, 4, 3, True, label="4 ranks, gather_output")],
    harness(_column_body), hints=(
        "The input is whole on every rank and this rank's rows of the weight give its slice of "
        "the output features. dL/dx is a sum over the ranks' shards, so it must be summed in "
        "the backward pass; with gather_output, every rank needs every feature forward.",
        "Of the three autograd functions you wrote, one is exactly the communication a "
        "column-parallel input needs, and one hands a split output on whole. Apply the first "
        "to the input before the local linear, and the second to its result when asked."),
    params=("layer", "x"))


def _row_body(dist, rank: int, fn, seed: int, parallel_input: bool) -> dict:
    k = dist.get_world_size()
    n_out, n_in = dims(k)  # split along the input: the larger dimension
    layer = stand_in_layer(full_linear(seed, n_in, n_out), dist, rank, k, 1,
                           input_is_parallel=parallel_input)
    h = layer_input(seed, n_in)
    x = (h.chunk(k, dim=-1)[rank].clone() if parallel_input else h).requires_grad_()
    out = counted_passes(dist, lambda: fn(layer, x), layer_upstream(seed, n_out), comm)
    return {**out, "dx": x.grad, "dW": layer.weight.grad, "db": layer.bias.grad}


_register_06(
    "lesson06.row_parallel_forward",
    [case(RANK, WORLD_SIZE, 2, 0, True, label="2 ranks"),
     case(RANK, WORLD_SIZE, 3, 1, False, label="3 ranks, whole input"),
     case(RANK, WORLD_SIZE, 4, 2, True, label="4 ranks"),
     case(RANK, WORLD_SIZE, 3, 3, True, label="3 ranks")],
    harness(_row_body), hints=(
        "Each rank's columns of the weight, times its slice of the input features, give a "
        "partial result; the output is their sum, the same on every rank. The bias belongs in "
        "that sum once, not once per rank.",
        "With a whole input, each rank's chunk comes from the same x: like a column-parallel "
        "layer's input, its gradient is a sum over ranks, so it goes through the same autograd "
        "function before it is cut. Then the local product without the bias, the sum over "
        "ranks, and the bias last."),
    params=("layer", "x"))


# --- lesson06.attention_forward ----------------------------------------------------------------

HEADS, EMBED, SEQ = 12, 24, 5  # 12 heads: 6, 4 and 3 per rank on 2, 3 and 4 ranks


def attention_module(seed: int) -> nn.MultiheadAttention:
    torch.manual_seed(seed)
    return nn.MultiheadAttention(EMBED, HEADS, batch_first=True, dtype=torch.float64)


def attention_input(seed: int) -> torch.Tensor:
    return _randn(seed + 1, 2, SEQ, EMBED)


def attention_upstream(seed: int) -> torch.Tensor:
    return _randn(seed + 2, 2, SEQ, EMBED)


def _attention_body(dist, rank: int, fn, seed: int, causal: bool) -> dict:
    from course_lib.tensor_parallel import TensorParallelAttention

    attn = TensorParallelAttention.from_torch(attention_module(seed), causal=causal, dist=dist)
    x = attention_input(seed).requires_grad_()
    out = counted_passes(dist, lambda: fn(attn, x), attention_upstream(seed), comm)
    return {**out, "dx": x.grad}


_register_06(
    "lesson06.attention_forward",
    [case(RANK, WORLD_SIZE, 2, 0, False, label="2 ranks"),
     case(RANK, WORLD_SIZE, 3, 1, True, label="3 ranks, causal"),
     case(RANK, WORLD_SIZE, 4, 2, False, label="4 ranks")],
    harness(_attention_body), hints=(
        "Heads are independent until the output projection: this rank runs ordinary "
        "attention on its own heads only, and the row-parallel output projection sums every "
        "rank's heads into the whole output.",
        "The packed projection's last dimension holds this rank's q heads, then its k heads, "
        "then its v heads, head_dim features each. Separate q, k and v and the heads, move the "
        "heads in front of the sequence for attention, and back behind it before joining them "
        "into one dimension again (a reshape alone would mix sequence and heads)."),
    params=("attn", "x"))


# --- lesson06.initial_slice --------------------------------------------------------------------

def init_harness(fn, n_in: int, n_out: int, dim: int, parts: int, rank: int, k: int,
                 bias: bool, seed: int) -> dict:
    """`fn` on a stand-in layer (only the fields it reads), from a known random state."""
    layer = SimpleNamespace(in_features=n_in, out_features=n_out, dim=dim, parts=parts,
                            rank=rank, world_size=k)
    torch.manual_seed(seed)
    weight, b = fn(layer, bias)
    return {"weight": weight, "bias": b}


register(Exercise(
    name="lesson06.initial_slice",
    notebook=NOTEBOOK,
    params=("layer", "bias"),
    cases=[
        case(4, 6, 0, 1, 1, 2, True, 0, label="column-parallel, rank 1 of 2"),
        case(5, 12, 0, 1, 2, 3, True, 1, label="column-parallel, rank 2 of 3"),
        case(4, 18, 0, 3, 1, 3, True, 2, label="packed q, k, v (parts=3), rank 1 of 3"),
        case(8, 6, 1, 1, 3, 4, True, 3, label="row-parallel, rank 3 of 4"),
        case(6, 5, 1, 1, 0, 3, False, 4, label="row-parallel, rank 0 of 3, no bias"),
    ],
    reference="lesson06:initial_slice",
    explain="lesson06:explain_initial_slice",
    harness=init_harness,
    points=2,
    rtol=0, atol=0,
    hints=("Every rank must hold exactly its slice of the one nn.Linear a single process draws "
           "from the same random state: walk the whole stream in nn.Linear's order (the weight "
           "row after row, then the bias), a block of rows at a time, and keep only what is "
           "this rank's.",
           "Column-parallel: the rows come in world_size x parts equal blocks, owned in turn by "
           "rank 0, 1, ... and again for each packed part (with parts=3: q's blocks, then k's, "
           "then v's). "
           "Row-parallel: any blocks of rows will do; keep this rank's columns of each. Both "
           "draw uniformly within plus or minus one over the square root of in_features; the "
           "bias comes last, and only a column-parallel rank cuts it."),
))
