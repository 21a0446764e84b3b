"""Lesson 13's expected values and the reasons for wrong ones (judge side: see this package's
docstring).

A block of the all_to_all check says where it comes from: element m of what rank i sends rank
j is 100 i + 10 j + m, so a wrong block is read back as "rank 2's block for rank 0". The
permutation's cases are judged against `course_lib.moe_dispatch` (the packaged module, as
every reference runs) on the case's data. The layer's cases are judged against one process
that computes every expert on every token of the whole batch, weighted by the same gates
(`course_lib.moe.dense_reference`), routed in as many groups as there are ranks, so its drops
are the ranks' drops.
"""

from __future__ import annotations

import torch

from course_lib.course.compare import mismatch
from course_lib.course.grading.exercises.lesson13 import (A2A_SIZES, DROP_CASES, a2a_block,
                                                          layer_batch, piece_inputs, whole_layer)
from course_lib.i18n import _

# --- lesson13.pairwise_all_to_all -----------------------------------------------------------------


def pairwise_all_to_all(rank: int, world_size: int, label: str) -> dict | None:
    sizes = A2A_SIZES[label]
    k = len(sizes)
    if rank >= k:
        return None
    return {"output blocks": [a2a_block(i, rank, sizes[i][rank]) for i in range(k)],
            "messages sent": k - 1, "messages received": k - 1,
            "one message to each other rank": True, "each round pairs up": True}


def _differs(expected: dict, got, key: str) -> bool:
    if not isinstance(got, dict) or key not in got or key not in expected:
        return False
    return mismatch(got[key], expected[key], 0.0, 0.0) is not None


def _read_block(block: torch.Tensor) -> tuple[int, int] | None:
    """(i, j) when `block` is (the start of) what rank i sends rank j."""
    if not isinstance(block, torch.Tensor) or block.numel() == 0:
        return None
    first = int(block.reshape(-1)[0])
    if first < 0 or first % 10 != 0 and first % 10 > 5:
        return None
    return first // 100, (first % 100) // 10


def explain_pairwise_all_to_all(c, rank: int, expected, got) -> str | None:
    k = len(A2A_SIZES[c.args[2]])
    if _differs(expected, got, "output blocks"):
        blocks = got["output blocks"]
        if not isinstance(blocks, list) or len(blocks) != k:
            return None
        for i, (have, want) in enumerate(zip(blocks, expected["output blocks"])):
            if mismatch(have, want, 0.0, 0.0) is None:
                continue
            if isinstance(have, torch.Tensor) and have.numel() and bool((have == -1).all()):
                return _("output block {i} was never written; it should hold rank "
                         "{i}'s block for rank {rank}", rank=rank, i=i)
            read = _read_block(have)
            if read is None:
                return None
            return _("output block {i} holds rank {src}'s block for rank {dst}; "
                     "it should hold rank {i}'s block for rank {rank}", rank=rank, i=i,
                     src=read[0], dst=read[1])
        return None
    if _differs(expected, got, "one message to each other rank") or _differs(
            expected, got, "messages sent"):
        return _("rank {rank} sent {sent} message(s), not one to each of the {others} other "
                 "ranks: its own block is copied, every other block travels once", rank=rank,
                 sent=got.get("messages sent"), others=k - 1)
    if _differs(expected, got, "each round pairs up"):
        return _("in some round rank {rank} sends to a rank that receives from another "
                 "rank in that round; each round's sends and receives must pair up, or a rank "
                 "waits for a message that is not sent until later", rank=rank)
    return None


# --- lesson13.permute and lesson13.unpermute (rank 0, the case's data) ----------------------------


def permute(rank: int, world_size: int, n: int) -> dict | None:
    if rank != 0:
        return None
    from course_lib import moe_dispatch

    data = piece_inputs(n)
    x = data["x"].clone().requires_grad_()
    rows, order = moe_dispatch.permute(x, data["expert_index"], data["kept"])
    (rows * rows).sum().backward()
    return {"rows": rows.detach(), "order": order, "input gradient": x.grad}


def _choice(c: int, k: int) -> dict:
    return {"c": c, "t": c // k, "j": c % k}


def explain_permute(c, rank: int, expected, got) -> str | None:
    if not isinstance(got, dict) or expected is None:
        return None
    data = piece_inputs(c.args[2])
    k, flat = data["expert_index"].shape[1], data["expert_index"].reshape(-1)
    have, want = got.get("order"), expected["order"]
    if _differs(expected, got, "order"):
        if not isinstance(have, torch.Tensor) or have.dim() != 1 or have.is_floating_point():
            return None
        mine, right = set(have.tolist()), set(want.tolist())
        if mine - right:
            extra = min(mine - right)
            return _("order holds choice {c} (token {t}, its choice {j}), which was dropped: "
                     "only kept choices leave for an expert", **_choice(extra, k))
        if right - mine:
            return _("order misses the kept choice {c} (token {t}, its choice {j})",
                     **_choice(min(right - mine), k))
        if len(have) != len(want):
            return _("order lists a choice more than once")
        experts = flat[have].tolist()
        for i in range(1, len(experts)):
            if experts[i] < experts[i - 1]:
                return _("order is not grouped by expert: choice {c} (expert {e}) comes after a "
                         "choice of expert {before}; the rows leave expert by expert",
                         c=int(have[i]), e=experts[i], before=experts[i - 1])
        first = next(i for i in range(len(want)) if int(have[i]) != int(want[i]))
        return _("inside expert {e} the choices are not in token order: token {t} comes before "
                 "token {s}", e=experts[first], t=int(have[first]) // k,
                 s=int(want[first]) // k)
    if _differs(expected, got, "rows"):
        rows = got.get("rows")
        if not isinstance(rows, torch.Tensor) or rows.shape != expected["rows"].shape:
            return _("rows has one row per kept choice, {n} of them, of the token's width",
                     n=len(want))
        i = next((i for i in range(len(rows))
                  if not torch.allclose(rows[i], expected["rows"][i], rtol=0.0, atol=1e-12)), 0)
        return _("row {i} should be a copy of token {t}, whose choice {c} is order[{i}]", i=i,
                 t=int(want[i]) // k, c=int(want[i]))
    if _differs(expected, got, "input gradient"):
        return _("rows and order are right but the gradient does not reach the tokens: the rows "
                 "must be built from x with operations autograd follows")
    return None


def unpermute(rank: int, world_size: int, n: int) -> dict | None:
    if rank != 0:
        return None
    return _combined(n, weighted=True)


def _combined(n: int, weighted: bool) -> dict:
    """The reference combine of case n (weighted=False: every kept choice weighs 1)."""
    from course_lib import moe_dispatch

    data = piece_inputs(n)
    rows = data["rows"].clone().requires_grad_()
    weights = (data["weights"] if weighted else data["kept"].to(rows.dtype)).clone()
    weights.requires_grad_()
    out = moe_dispatch.unpermute(rows, data["order"], weights, len(data["x"]))
    (out * data["grad"]).sum().backward()
    return {"output": out.detach(), "rows gradient": rows.grad, "weights gradient": weights.grad}


def explain_unpermute(c, rank: int, expected, got) -> str | None:
    if not isinstance(got, dict) or expected is None:
        return None
    n = c.args[2]
    if _differs(expected, got, "output"):
        have, want = got.get("output"), expected["output"]
        if not isinstance(have, torch.Tensor) or have.shape != want.shape:
            return _("the output has one row per token, {n} of them, of the rows' width",
                     n=len(want))
        unit = _combined(n, weighted=False)["output"]
        return _token_reason(rank, have, want, unit, piece_inputs(n))
    if _differs(expected, got, "rows gradient"):
        return _("the output is right but the gradient of rows is not: the combine must be "
                 "built from operations autograd follows")
    if _differs(expected, got, "weights gradient"):
        return _("the output is right but the gradient of weights is not: the router learns "
                 "through them, so the combine must multiply by them with operations autograd "
                 "follows")
    return None


# --- the layer ------------------------------------------------------------------------------------


def _dense(k: int, top_k: int, factor, per: int, weighted: bool = True):
    """One process's output and input gradient on the whole batch; with weighted=False, every
    kept choice weighs 1 (a combine that forgets the router's weights)."""
    from course_lib import moe

    layer = whole_layer(k, top_k, factor, per)
    x_all, g_all = layer_batch(k)
    x = x_all.clone().requires_grad_()
    if weighted:
        y, _aux = moe.dense_reference(layer, x, groups=k)
    else:
        routes = [moe.route(layer, t) for t in x.tensor_split(k)]
        gate = torch.cat([torch.zeros_like(r.probs).scatter(1, r.expert_index, r.kept.to(
            r.probs.dtype)) for r in routes])
        y = sum(gate[:, e:e + 1] * ex(x) for e, ex in enumerate(layer.experts))
    (y * g_all).sum().backward()
    return y.detach(), x.grad


def layer(rank: int, world_size: int, k: int, top_k: int, factor, per: int) -> dict | None:
    if rank >= k:
        return None
    y, grad = _dense(k, top_k, factor, per)
    return {"output": y.tensor_split(k)[rank], "input gradient": grad.tensor_split(k)[rank]}


def _token_reason(rank: int, have: torch.Tensor, want: torch.Tensor, unit: torch.Tensor,
                  data: dict | None = None) -> str | None:
    """Why a combined output `have` is not `want` (unit: the output without the router's
    weights); `data`: a piece case's inputs, to name the row a token got instead."""
    if torch.allclose(have, unit, rtol=0.0, atol=1e-10):
        return _("every token's output is the plain sum of its experts' outputs, "
                 "without the router's weights", rank=rank)
    bad = ((have - want).abs() > 1e-10).any(dim=1).nonzero().flatten().tolist()
    if not bad:
        return None
    t = bad[0]
    if not want[t].any() and have[t].any():
        return _("token {t} lost its place at every expert it chose (an expert over "
                 "capacity keeps its highest router scores), yet it has an output", rank=rank,
                 t=t)
    if want[t].any() and not have[t].any():
        return _("token {t} keeps a place at an expert, yet its output is zero",
                 rank=rank, t=t)
    moved = [s for s in range(len(want)) if torch.allclose(have[t], want[s], atol=1e-10)]
    if not moved and data is not None:  # the weighted row of another token's choice
        k = data["weights"].shape[1]
        gate = data["weights"].reshape(-1)[data["order"]].unsqueeze(1)
        moved = [int(data["order"][i]) // k for i, row in enumerate(data["rows"] * gate)
                 if int(data["order"][i]) // k != t and torch.allclose(have[t], row, atol=1e-10)]
    if moved:
        return _("token {t} got the output of token {s}: the rows did not come "
                 "back to their tokens", rank=rank, t=t, s=moved[0])
    if data is not None:
        return _("the output of {n} of the {total} tokens is not the weighted sum of the rows of "
                 "their kept choices, first token {t}", n=len(bad), total=len(want), t=t)
    return _("the output of {n} of its {total} tokens differs from one process "
             "computing every expert, first token {t}", rank=rank, n=len(bad), total=len(want),
             t=t)


def explain_layer(c, rank: int, expected, got) -> str | None:
    if not isinstance(got, dict) or expected is None:
        return None
    args = c.args[2:]
    if _differs(expected, got, "output"):
        have, want = got.get("output"), expected["output"]
        if not isinstance(have, torch.Tensor) or have.shape != want.shape:
            return None
        unit = _dense(*args, weighted=False)[0].tensor_split(args[0])[rank]
        return _token_reason(rank, have, want, unit)
    if _differs(expected, got, "input gradient"):
        return _("the output is right but the input gradient is not: the "
                 "combine must be built from operations autograd follows", rank=rank)
    return None


# --- lesson13.keep_top_scores -----------------------------------------------------------------


def keep_top_scores(rank: int, world_size: int, kind: str, *args) -> dict | None:
    if kind == "layer":
        return layer(rank, world_size, *args)
    if rank != 0:
        return None
    from course_lib import moe

    _label, index, scores, experts, capacity = DROP_CASES[args[0]]
    return {"kept": moe.keep_top_scores(torch.tensor(index), torch.tensor(
        scores, dtype=torch.float64), experts, capacity)}


def explain_keep_top_scores(c, rank: int, expected, got) -> str | None:
    if c.args[2] == "layer":
        if not isinstance(got, dict) or expected is None:
            return None
        return explain_layer(_Shifted(c), rank, expected, got)
    if not _differs(expected, got, "kept"):
        return None
    have, want = got["kept"], expected["kept"]
    if not isinstance(have, torch.Tensor) or have.shape != want.shape:
        return None
    _label, index, scores, experts, capacity = DROP_CASES[c.args[3]]
    for e in range(experts):
        mine = [(t, j) for t, row in enumerate(index) for j, x in enumerate(row) if x == e]
        kept = sum(bool(have[t, j]) for t, j in mine)
        if kept != min(capacity, len(mine)):
            return _("expert {e} kept {kept} of its {n} choices; its capacity is {capacity}",
                     e=e, kept=kept, n=len(mine), capacity=capacity)
        wrong = [(t, j) for t, j in mine if bool(have[t, j]) != bool(want[t, j])]
        if wrong:
            t, j = wrong[0]
            return _("expert {e} kept the right number of choices but not the right ones: token "
                     "{t}'s choice (score {score}) {fate}; an expert over capacity keeps its "
                     "highest router scores, the earlier token first between equal ones", e=e,
                     t=t, score=scores[t][j],
                     fate=_("stays") if bool(have[t, j]) else _("is dropped"))
    return None


class _Shifted:
    """A layer case of keep_top_scores seen as the layer's case (without the "layer" tag)."""

    def __init__(self, c):
        self.args = (*c.args[:2], *c.args[3:])
        self.label = c.label
