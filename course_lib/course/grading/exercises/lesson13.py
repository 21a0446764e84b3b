"""Lesson 13 (experts): the pairwise all_to_all from send/recv, checked on the first 2, 3 and
4 ranks of the grader's 4-rank cluster; the dispatch permutation and its inverse, each on its
own data on rank 0 (neither runs the other, nor the drop policy); the capacity drop policy on
hand-made cases on rank 0, then inside the expert-parallel layer (`course_lib.moe`, with the
learner's own dispatch and combine from `course_lib.moe_dispatch`) on 2, 3 and 4 ranks,
against one process computing every expert on the whole batch.

The expected values and the explanations of wrong ones are judge-side:
`course_lib/course/grading/references/lesson13.py`."""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

import torch

from course_lib.course.grading import RANK, WORLD_SIZE, case
from course_lib.course.grading.sub_worlds import (counting_messages, first_ranks_as_world,
                                                  on_first_ranks, register_on_sub_worlds)
from course_lib.i18n import N_

NOTEBOOK = "13_experts"

# --- lesson13.pairwise_all_to_all ----------------------------------------------------------------

# sizes[i][j]: elements rank i sends rank j (0 included), and the case's label (a literal, so
# that the catalogue holds it: a label is translated where the report shows it)
A2A_SIZES = {
    "2 ranks": [[2, 3], [1, 0]],
    "3 ranks": [[1, 2, 3], [4, 0, 1], [2, 2, 0]],
    "4 ranks": [[1, 2, 0, 3], [2, 1, 1, 0], [0, 3, 2, 1], [4, 0, 1, 2]],
    "3 ranks, equal blocks": [[2, 2, 2], [2, 2, 2], [2, 2, 2]],
    "4 ranks, rank 2 sends nothing": [[3, 0, 2, 1], [1, 1, 1, 1], [0, 0, 0, 0], [2, 5, 0, 3]],
}
A2A_LABELS = {
    "2 ranks": N_("2 ranks, block sizes [[2, 3], [1, 0]]"),
    "3 ranks": N_("3 ranks, block sizes [[1, 2, 3], [4, 0, 1], [2, 2, 0]]"),
    "4 ranks": N_("4 ranks, block sizes [[1, 2, 0, 3], [2, 1, 1, 0], [0, 3, 2, 1], [4, 0, 1, 2]]"),
    "3 ranks, equal blocks": N_("3 ranks, equal blocks, block sizes [[2, 2, 2], [2, 2, 2], "
                                "[2, 2, 2]]"),
    "4 ranks, rank 2 sends nothing": N_("4 ranks, rank 2 sends nothing, block sizes [[3, 0, 2, "
                                        "1], [1, 1, 1, 1], [0, 0, 0, 0], [2, 5, 0, 3]]"),
}


def a2a_block(i: int, j: int, n: int) -> torch.Tensor:
    """What rank i sends rank j: its values say where they come from (100 i + 10 j + m)."""
    return torch.arange(n, dtype=torch.float32) + 100 * i + 10 * j


@contextmanager
def message_order() -> Iterator[dict]:
    """The peers of course_lib.dist's send/isend (and recv/irecv) calls, in call order."""
    from course_lib import dist

    log: dict = {"to": [], "from": []}
    names = {"send": "to", "isend": "to", "recv": "from", "irecv": "from"}
    saved = {name: getattr(dist, name) for name in names}

    def logged(name: str):
        def call(tensor, *args, **kwargs):
            peer = args[0] if args else kwargs.get("dst", kwargs.get("src"))
            log[names[name]].append(peer)
            return saved[name](tensor, *args, **kwargs)
        return call

    for name in names:
        setattr(dist, name, logged(name))
    try:
        yield log
    finally:
        for name, fn in saved.items():
            setattr(dist, name, fn)


def a2a_harness(fn, rank: int, world_size: int, label: str) -> dict | None:
    """On the first k ranks as a world of k: the output blocks, the messages, and whether every
    round pairs up (the rank this one sends to in round s receives from it in round s)."""
    from course_lib import dist

    sizes = A2A_SIZES[label]
    k = len(sizes)
    group = dist.new_group(list(range(k)), timeout=5.0)  # every rank creates it
    if rank >= k:
        return None
    inputs = [a2a_block(rank, j, sizes[rank][j]) for j in range(k)]
    outputs = [torch.full((sizes[i][rank],), -1.0) for i in range(k)]
    with message_order() as order, first_ranks_as_world(k), counting_messages() as counts:
        fn(outputs, inputs)
    froms = torch.full((k,), -1, dtype=torch.int64)
    froms[:min(k, len(order["from"]))] = torch.tensor(order["from"][:k], dtype=torch.int64)
    everyone = [torch.empty_like(froms) for _ in range(k)]
    dist.all_gather(everyone, froms, group=group)
    paired = all(0 <= to < k and int(everyone[to][s]) == rank
                 for s, to in enumerate(order["to"][:k - 1]))
    return {"output blocks": outputs, "messages sent": counts["sent"],
            "messages received": counts["received"],
            "one message to each other rank": sorted(order["to"]) == [q for q in range(k)
                                                                     if q != rank],
            "each round pairs up": paired}


register_on_sub_worlds(
    "lesson13.pairwise_all_to_all", NOTEBOOK,
    params=("output_list", "input_list"),
    cases=[case(RANK, WORLD_SIZE, key, label=A2A_LABELS[key]) for key in A2A_SIZES],
    reference="lesson13:pairwise_all_to_all",
    explain="lesson13:explain_pairwise_all_to_all",
    harness=a2a_harness,
    points=3,
    time_limit=10.0,
    hints=("The exchange transposes the matrix of blocks. In every round each rank sends one "
           "block and receives one, and a round can only end if the rank you send to is "
           "receiving from you in that same round.",
           "Draw p = 3 and p = 4 as rounds by ranks, with an arrow per message. For p = 3 try "
           "\"everyone sends one step to the right\" and ask whom each rank must hear from in "
           "that round. For p = 4 there is a pairing in which your partner's partner is you, "
           "in every round."),
)

# --- the layer's cases (lesson13.keep_top_scores) -------------------------------------------------

# (ranks, top_k, capacity_factor, experts per rank)
LAYER_CASES = [(2, 1, 0.5, 2), (3, 2, 0.75, 2), (4, 2, 0.6, 1)]
DIM, HIDDEN, TOKENS = 6, 8, 10
LAYER_LABELS = {
    (2, 1, 0.5, 2): N_("2 ranks, top-1, 4 experts, capacity factor 0.5"),
    (3, 2, 0.75, 2): N_("3 ranks, top-2, 6 experts, capacity factor 0.75"),
    (4, 2, 0.6, 1): N_("4 ranks, top-2, 4 experts, capacity factor 0.6"),
}


def layer_label(k: int, top_k: int, factor: float | None, per: int) -> str:
    """The case's label (a catalogue entry: translated where the report shows it)."""
    return LAYER_LABELS[k, top_k, factor, per]


def whole_layer(k: int, top_k: int, factor: float | None, per: int):
    """The same whole layer (float64, seeded) on every rank and in the judge."""
    from course_lib import moe

    torch.manual_seed(1000 + 100 * k + 10 * top_k + per)
    return moe.MoE(DIM, HIDDEN, per * k, top_k, factor).double()


def layer_batch(k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The whole batch (k * TOKENS, DIM) and the gradient the loss sends back into the output."""
    g = torch.Generator().manual_seed(k)
    x = torch.randn(k * TOKENS, DIM, generator=g, dtype=torch.float64)
    return x, torch.randn(k * TOKENS, DIM, generator=g, dtype=torch.float64)


def _layer_body(d, rank: int, fn, k: int, top_k: int, factor, per: int) -> dict:
    """This rank's output and input gradient of the expert-parallel layer with `fn` as its
    drop policy (its dispatch and combine: `course_lib.moe_dispatch`'s, lesson 13's own)."""
    from course_lib import moe

    layer = whole_layer(k, top_k, factor, per)
    moe.expert_parallel(layer, dist=d)
    x_all, g_all = layer_batch(k)
    x = x_all.tensor_split(k)[rank].clone().requires_grad_()
    y = moe.moe_forward(layer, x, keep=fn)
    (y * g_all.tensor_split(k)[rank]).sum().backward()
    return {"output": y.detach(), "input gradient": x.grad}


# --- lesson13.permute and lesson13.unpermute: each on its own, on rank 0 --------------------------
# Neither check runs the other piece, nor the drop policy: the choices, their kept mask and
# (for unpermute) the order the rows come back in are the case's data, so each exercise is
# judged alone, whatever the learner's other pieces do. unpermute's order is a seeded
# shuffle of the kept choices: any order `permute` could send must come back right.

# (tokens, top_k, experts, share of the choices dropped, seed)
PIECE_CASES = [(8, 1, 4, 0.0, 1), (8, 2, 4, 0.0, 2), (10, 2, 6, 0.3, 3), (9, 1, 3, 0.4, 4),
               (5, 2, 4, 1.0, 5)]
PIECE_LABELS = [N_("8 tokens, top-1, 4 experts, every choice kept"),
                N_("8 tokens, top-2, 4 experts, every choice kept"),
                N_("10 tokens, top-2, 6 experts, some choices dropped"),
                N_("9 tokens, top-1, 3 experts, some choices dropped"),
                N_("5 tokens, top-2, 4 experts, every choice dropped")]
PIECE_DIM = 3


def piece_inputs(n: int) -> dict:
    """Case n's data: tokens x (T, d), the experts chosen (T, k) (distinct per token), the kept
    mask, gate weights (0 where dropped), the rows coming back for the kept choices, the order
    they come back in, and the gradient sent into the combined output."""
    num_tokens, k, experts, dropped, seed = PIECE_CASES[n]
    g = torch.Generator().manual_seed(1300 + seed)
    x = torch.randn(num_tokens, PIECE_DIM, generator=g, dtype=torch.float64)
    index = torch.stack([torch.randperm(experts, generator=g)[:k] for _ in range(num_tokens)])
    kept = torch.rand(num_tokens, k, generator=g) >= dropped
    weights = torch.rand(num_tokens, k, generator=g, dtype=torch.float64) * kept
    kept_numbers = torch.flatten(torch.nonzero(torch.flatten(kept)))
    back = kept_numbers[torch.randperm(len(kept_numbers), generator=g)]
    rows = torch.randn(len(back), PIECE_DIM, generator=g, dtype=torch.float64)
    grad = torch.randn(num_tokens, PIECE_DIM, generator=g, dtype=torch.float64)
    return {"x": x, "expert_index": index, "kept": kept, "weights": weights, "order": back,
            "rows": rows, "grad": grad}


def permute_harness(fn, rank: int, world_size: int, n: int) -> dict | None:
    """Rank 0: the rows and order `fn` returns, and the gradient its rows pass back to x."""
    if rank != 0:
        return None
    data = piece_inputs(n)
    x = data["x"].clone().requires_grad_()
    rows, order = fn(x, data["expert_index"], data["kept"])
    (rows * rows).sum().backward()
    return {"rows": rows.detach(), "order": order, "input gradient": x.grad}


def unpermute_harness(fn, rank: int, world_size: int, n: int) -> dict | None:
    """Rank 0: `fn`'s combined output and the gradients it passes to rows and weights."""
    if rank != 0:
        return None
    data = piece_inputs(n)
    rows = data["rows"].clone().requires_grad_()
    weights = data["weights"].clone().requires_grad_()
    out = fn(rows, data["order"], weights, len(data["x"]))
    (out * data["grad"]).sum().backward()
    return {"output": out.detach(), "rows gradient": rows.grad, "weights gradient": weights.grad}


_PIECES = [case(RANK, WORLD_SIZE, n, label=label) for n, label in enumerate(PIECE_LABELS)]

register_on_sub_worlds(
    "lesson13.permute", NOTEBOOK,
    params=("x", "expert_index", "kept"),
    cases=_PIECES,
    reference="lesson13:permute",
    explain="lesson13:explain_permute",
    harness=permute_harness,
    points=2,
    time_limit=10.0,
    rtol=0.0, atol=1e-12,
    hints=("Dispatch is a sort: the rows leave grouped by the expert they go to, and each row "
           "must still say which token and which of its choices it came from.",
           "Number the choices token by token, the way the (tokens, k) table is laid out. Keep "
           "only the numbers of the kept choices, then reorder those numbers by their expert "
           "without disturbing the token order inside one expert."),
)

register_on_sub_worlds(
    "lesson13.unpermute", NOTEBOOK,
    params=("rows", "order", "weights", "num_tokens"),
    cases=_PIECES,
    reference="lesson13:unpermute",
    explain="lesson13:explain_unpermute",
    harness=unpermute_harness,
    points=2,
    time_limit=10.0,
    rtol=0.0, atol=1e-12,
    hints=("Combine undoes the sort: each returning row belongs to one (token, choice), and a "
           "token with two choices gets two rows back. The router's weight of that choice "
           "scales its row.",
           "Start from zeros, one row per token. For every returning row, find its token and "
           "its choice's weight from what dispatch recorded, and accumulate row times weight "
           "into that token's row: accumulate, since two rows may meet there."),
)

# --- lesson13.keep_top_scores -------------------------------------------------------------------

# (label, expert_index, scores, experts, capacity): judged on rank 0 alone
DROP_CASES = [
    (N_("3 choices for expert 0, room for 2"), [[0], [0], [0]], [[0.5], [0.9], [0.7]], 2, 2),
    (N_("equal scores"), [[1], [1], [1]], [[0.6], [0.6], [0.6]], 2, 2),
    (N_("top-2: each expert ranks its own choices"),
     [[0, 1], [1, 0], [0, 1], [1, 0]], [[0.6, 0.3], [0.5, 0.4], [0.45, 0.4], [0.9, 0.05]], 2, 2),
    (N_("capacity 0"), [[0], [1]], [[0.8], [0.7]], 2, 0),
]


def keep_harness(fn, rank: int, world_size: int, kind: str, *args) -> dict | None:
    """A hand-made case on rank 0 ("local"), or the layer with `fn` as its drop policy."""
    if kind == "layer":
        return on_first_ranks(args[0], _layer_body, fn, *args)
    if rank != 0:
        return None
    _, index, scores, experts, capacity = DROP_CASES[args[0]]
    kept = fn(torch.tensor(index), torch.tensor(scores, dtype=torch.float64), experts, capacity)
    return {"kept": kept}


register_on_sub_worlds(
    "lesson13.keep_top_scores", NOTEBOOK,
    params=("expert_index", "scores", "num_experts", "capacity"),
    cases=[case(RANK, WORLD_SIZE, "local", n, label=c[0]) for n, c in enumerate(DROP_CASES)]
    + [case(RANK, WORLD_SIZE, "layer", *c, label=layer_label(*c)) for c in LAYER_CASES],
    reference="lesson13:keep_top_scores",
    explain="lesson13:explain_keep_top_scores",
    harness=keep_harness,
    points=2,
    time_limit=10.0,
    rtol=0.0, atol=1e-10,
    hints=("Each expert has a queue of the choices that picked it. When the queue is longer "
           "than the capacity, the router's least confident choices leave it first; between "
           "equal scores, the later token leaves first.",
           "Picture one queue per expert, its choices lined up best score first. A choice's "
           "place in its own expert's queue, compared with the capacity, decides whether it "
           "stays."),
)
