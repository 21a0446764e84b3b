"""Lesson 12's expected values and explanations (judge side: see this package's docstring).

Expected values come from plain PyTorch on one process (`F.scaled_dot_product_attention`,
softmax over the concatenated blocks, slicing and sums), never from the components being built.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from course_lib.course.grading.exercises import lesson12 as ex
from course_lib.i18n import _


def _keeps_rng(fn):
    @functools.wraps(fn)
    def wrapped(*args, **kwargs):
        with torch.random.fork_rng(devices=[]):
            return fn(*args, **kwargs)
    return wrapped


def _close(a, b) -> bool:
    return (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.shape == b.shape
            and bool(torch.allclose(a.double(), b.double(), rtol=1e-9, atol=1e-10)))


def _zigzag_chunks(cp: int, rank: int) -> tuple[int, int]:
    return rank, 2 * cp - 1 - rank


def _padded(t: int, cp: int) -> int:
    return -(-t // (2 * cp)) * 2 * cp


def _held(cp: int, t: int, rank: int) -> list:
    n = _padded(t, cp) // (2 * cp)
    return [p if p < t else ex.PAD for c in _zigzag_chunks(cp, rank)
            for p in range(c * n, (c + 1) * n)]


# --- lesson12.zigzag_split --------------------------------------------------------------------------

def zigzag_split(kind: str, cp: int, t: int, rank: int = 0) -> dict:
    if kind == "held":
        positions = _held(cp, t, rank)
        return {"positions": positions, "shape": [2, len(positions), 3]}
    return {"work per rank": [sum(p + 1 for p in _held(cp, t, r) if p != ex.PAD)
                              for r in range(cp)]}


def explain_zigzag_split(case, rank, expected, got) -> str | None:
    kind, cp, t = case.args[:3]
    if not isinstance(got, dict):
        return None
    if kind == "work":
        return _("the causal work per rank (keys seen, summed over its queries) is {work}: the "
                 "ranks holding late positions wait for nothing while the others idle",
                 work=got.get("work per rank"))
    me = case.args[3]
    positions = got.get("positions")
    if positions is None:
        return None
    if ex.PAD not in expected["positions"] or ex.PAD in positions:
        return _("rank {rank} of {cp} holds positions {got}, expected {expected}: in the zigzag "
                 "layout every rank holds one early and one late chunk of the {n}",
                 rank=me, cp=cp, got=positions, expected=expected["positions"], n=2 * cp)
    return _("rank {rank} of {cp} holds positions {got}, expected {expected}: T={t} does not "
             "divide into {n} chunks; the sequence is padded so that every rank's part has "
             "the same length", rank=me, cp=cp, got=positions, expected=expected["positions"],
             t=t, n=2 * cp)


# --- lesson12.merge -----------------------------------------------------------------------------------

def merge(n_a: int, n_b: int, scale: float, empty: str) -> dict:
    q, k, v, mask = ex.merge_inputs(n_a, n_b, empty)
    scores = (q @ k.transpose(-2, -1) * scale).masked_fill(~mask, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    if not mask.any():
        return {"out": torch.zeros(2, 3, 4, dtype=torch.float64), "lse": lse}
    return {"out": torch.softmax(scores, dim=-1) @ v, "lse": lse}


def explain_merge(case, rank, expected, got) -> str | None:
    if not isinstance(got, dict) or "out" not in got:
        return None
    out, lse = got["out"], got["lse"]
    if not isinstance(out, torch.Tensor) or out.shape != expected["out"].shape:
        return None
    if out.isnan().any():
        if case.args[3] == "both":
            return _("out is nan: a query that sees no key in either block keeps out = 0 and "
                     "lse = -inf")
        return _("out is nan: the log-sum-exps reach {top:.0f}, and exp overflows float64 "
                 "above 709", top=float(expected["lse"].max()))
    if not _close(out, expected["out"]):
        return _("out is not attention over both blocks: each block's output counts in "
                 "proportion to its share of the total sum of exponentials")
    if isinstance(lse, torch.Tensor) and lse.isnan().any():
        return _("lse is nan where a query saw no key: it stays -inf")
    return _("lse is not the log-sum-exp of both blocks' scores")


# --- lesson12.ring_step ------------------------------------------------------------------------------

def ring_step(cp: int, t: int, causal: bool, layout: str) -> dict:
    from course_lib.context_parallel import padded_length, positions

    q, k, v = ex.ring_inputs(t)
    full = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
    local = padded_length(t, cp) // cp
    return {f"rank {r}": ex.part(full, cp, r, layout)[..., positions(layout, r, cp, local) < t, :]
            for r in range(cp)}


def explain_ring_step(case, rank, expected, got) -> str | None:
    from course_lib.context_parallel import padded_length, positions

    cp, t, causal, layout = case.args
    if not isinstance(got, dict):
        return None
    local = padded_length(t, cp) // cp
    for name, rows in expected.items():
        if not _close(got.get(name), rows):
            r = int(name.split()[1])
            held = [p if p < t else ex.PAD for p in positions(layout, r, cp, local).tolist()]
            if causal:
                return _("{name}'s rows differ from causal attention after the {cp} steps: "
                         "{name} holds positions {held}, and a query sees exactly the keys at "
                         "or before its own position", name=name, cp=cp, held=held)
            return _("{name}'s rows differ from full attention after the {cp} steps: {name} "
                     "holds positions {held}; every real key is seen, padding (position {t} "
                     "and beyond) never", name=name, cp=cp, held=held, t=t)
    return None


# --- lesson12.gather_from_sequence_parallel / reduce_scatter_to_sequence_parallel -------------

def gather_from_sequence_parallel(rank: int, world_size: int, k: int, seed: int):
    if rank >= k:
        return None
    grad = sum(ex.upstream(seed, k, r) for r in range(k))
    return {"comm": ex.comm({"all_gather": 1}, {"reduce_scatter": 1}), "out": ex.whole(seed, k),
            "dx": grad.chunk(k, dim=1)[rank]}


def reduce_scatter_to_sequence_parallel(rank: int, world_size: int, k: int, seed: int):
    if rank >= k:
        return None
    total = ex.whole(seed, k) * (k * (k + 1) // 2)
    return {"comm": ex.comm({"reduce_scatter": 1}, {"all_gather": 1}),
            "out": total.chunk(k, dim=1)[rank], "d partial": ex.upstream(seed, k, 0)}


def _comm_reason(expected: dict, got: dict) -> str | None:
    if got.get("comm") == expected["comm"]:
        return None
    if "all_reduce" in str(got.get("comm")):
        return _("right values, wrong communication: {got}, expected {expected}; an all_reduce "
                 "sends twice the bytes of a reduce_scatter or an all_gather, and SP's point is "
                 "sending no more than TP", got=got.get("comm"), expected=expected["comm"])
    return _("the collectives were {got}, expected {expected}", got=got.get("comm"),
             expected=expected["comm"])


def explain_gather_from_sequence_parallel(case, rank, expected, got) -> str | None:
    if expected is None or not isinstance(got, dict):
        return None
    k = case.args[2]
    if not _close(got.get("out"), expected["out"]):
        return _("rank {rank}'s output is not the whole sequence, every rank's slice in rank "
                 "order", rank=rank)
    seed = case.args[3]
    own = ex.upstream(seed, k, rank).chunk(k, dim=1)[rank]
    if _close(got.get("dx"), own):
        return _("rank {rank}'s dL/dx misses the other ranks' contributions: after the gather "
                 "each rank's output features covered only its share, so every rank's gradient "
                 "of the slice is partial", rank=rank)
    if not _close(got.get("dx"), expected["dx"]):
        return None
    return _comm_reason(expected, got)


def explain_reduce_scatter_to_sequence_parallel(case, rank, expected, got) -> str | None:
    if expected is None or not isinstance(got, dict):
        return None
    if not _close(got.get("out"), expected["out"]):
        return _("rank {rank}'s output is not its slice of the sum over the {k} ranks' partial "
                 "results", rank=rank, k=case.args[2])
    if not _close(got.get("d partial"), expected["d partial"]):
        return _("rank {rank}'s partial result fed the whole sequence: its gradient is the "
                 "gradient of the whole output, every rank's slice", rank=rank)
    return _comm_reason(expected, got)


# --- lesson12.stream_seeds ----------------------------------------------------------------------

def stream_seeds(rank: int, world_size: int, k: int, dp: int, tp: int):
    if rank >= k:
        return None
    here = ex.layout_coords(rank, dp, tp)
    same = [r for r in range(k) if all(ex.layout_coords(r, dp, tp)[a] == here[a]
                                       for a in ("dp_rank", "pp_rank"))]
    return ex.masks_alike(same, [rank], True)


def explain_stream_seeds(case, rank, expected, got) -> str | None:
    if expected is None or ex.alike_of(got) is None:
        return None
    k, dp, tp = case.args[2:5]
    replicated, sharded, changes = ex.alike_of(got)
    want = ex.alike_of(expected)[0]
    if not changes:
        return _("rank {rank}'s masks do not change with the base seed: two runs, or a run "
                 "restarted with a new seed, would drop the same units", rank=rank)
    if len(replicated) == k and len(sharded) == k and tp > 1:
        return _("every rank drew the same masks in both streams: one seed everywhere, so the "
                 "tp slices are dropped in the same places and the dp replicas repeat each "
                 "other's masks")
    here = ex.layout_coords(rank, dp, tp)
    others = [r for r in replicated if r not in want]
    if any(ex.layout_coords(r, dp, tp)["dp_rank"] != here["dp_rank"] for r in others + [
            r for r in sharded if r != rank]):
        return _("rank {rank} draws the same masks as a rank of another data-parallel replica: "
                 "the replicas see different samples and must drop different units", rank=rank)
    if others:
        return _("rank {rank} draws the same replicated masks as a rank of another stage: each "
                 "stage's layers need their own masks", rank=rank)
    if len(replicated) < len(want):
        return _("the ranks of rank {rank}'s tp group drew different masks in the replicated "
                 "stream: they hold the same activation, and different masks make their copies "
                 "disagree", rank=rank)
    if len(sharded) > 1:
        return _("rank {rank} draws the same sharded masks as ranks {ranks}: each tp rank "
                 "holds a different slice, and the same mask drops every slice in the same "
                 "places", rank=rank, ranks=[r for r in sharded if r != rank])
    return None
