"""Lesson 12 (long sequences): the zigzag split of a sequence, the online-softmax merge and one
ring-attention step (12b, checked on one process: the ring is folded in order), and sequence
parallelism's all-gather / reduce-scatter pair (12a, on 2, 3 and 4 ranks, each pass's
collectives counted: an all-reduce there gives right values with twice the bytes).

Cases, inputs and harnesses (they run where the learner's code runs); expected values and the
explanations of wrong ones are judge-side, in `course_lib/course/grading/references/lesson12.py`.
Components are imported inside the harnesses on purpose: the learner's overlay decides at each
call which version runs.
"""

from __future__ import annotations

import re

import torch

from course_lib.course.grading import RANK, WORLD_SIZE, Exercise, case, register
from course_lib.i18n import N_
from course_lib.course.grading.sub_worlds import (counted_passes, harness,
                                                  register_on_sub_worlds)

SP, CP = "12a_sequence_parallel", "12b_ring_attention"
PAD = "pad"


def randn(seed: int, *shape: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


# --- lesson12.zigzag_split ------------------------------------------------------------------------

def held(part) -> dict:
    """What a part holds: its shape and, from its values (position + 1; 0 is padding), the
    positions along the sequence."""
    if not isinstance(part, torch.Tensor) or part.dim() != 3:
        return {"got": repr(part)[:60]}
    return {"positions": [int(p) - 1 if p else PAD for p in part[0, :, 0].tolist()],
            "shape": list(part.shape)}


def split_harness(fn, kind: str, cp: int, t: int, rank: int = 0) -> dict:
    """"held": the positions `rank` holds; "work": the causal work per rank (a query at
    position p sees p + 1 keys; padding holds 0, no work)."""
    x = torch.arange(1, t + 1, dtype=torch.float64).view(1, t, 1).expand(2, t, 3).contiguous()
    if kind == "held":
        return held(fn(x, cp, rank, 1))
    return {"work per rank": [int(fn(x, cp, r, 1)[0, :, 0].sum()) for r in range(cp)]}


register(Exercise(
    name="lesson12.zigzag_split",
    notebook=CP,
    params=("x", "cp", "rank", "dim"),
    cases=[case("held", cp, t, rank, label=f"{cp} ranks, T={t}, rank {rank}")
           for cp, t, rank in ((2, 8, 0), (2, 8, 1), (3, 12, 1), (4, 16, 3), (4, 13, 0),
                               (3, 4, 0))]
    + [case("work", 4, 16, label="causal work equal on 4 ranks")],
    harness=split_harness,
    reference="lesson12:zigzag_split",
    explain="lesson12:explain_zigzag_split",
    points=2,
    hints=("Under a causal mask a late position costs more than an early one: every rank gets "
           "some of each, and every rank's part has the same length, padding included.",
           "Picture the padded sequence cut into twice as many equal chunks as ranks, numbered "
           "from 0: which two chunks have costs that add up to the same total for every rank?"),
))


# --- lesson12.merge --------------------------------------------------------------------------------

MERGE_CASES = ((N_("two equal blocks"), 4, 4, 0.5, ""),
               (N_("one key and eight"), 1, 8, 0.5, ""),
               (N_("large scores (log-sum-exp over 1000)"), 4, 4, 600.0, ""),
               (N_("the first block masked out"), 4, 4, 0.5, "a"),
               (N_("both blocks masked out"), 4, 4, 0.5, "both"))


def merge_inputs(n_a: int, n_b: int, empty: str):
    """q, k, v and the mask of the two blocks side by side."""
    q, k, v = randn(1, 2, 3, 4), randn(2, 2, n_a + n_b, 4), randn(3, 2, n_a + n_b, 4)
    mask = torch.ones(3, n_a + n_b, dtype=torch.bool)
    if empty:
        mask[:, :n_a if empty == "a" else n_a + n_b] = False
    return q, k, v, mask


def merge_harness(fn, n_a: int, n_b: int, scale: float, empty: str) -> dict:
    """Each block's partial result (given block_attention), merged by `fn`."""
    from course_lib.context_parallel import block_attention

    q, k, v, mask = merge_inputs(n_a, n_b, empty)
    a = block_attention(q, k[:, :n_a], v[:, :n_a], mask[:, :n_a], scale)
    b = block_attention(q, k[:, n_a:], v[:, n_a:], mask[:, n_a:], scale)
    got = fn(*a, *b)
    if not isinstance(got, tuple) or len(got) != 2:
        return {"got": repr(got)[:60]}
    return {"out": got[0], "lse": got[1]}


register(Exercise(
    name="lesson12.merge",
    notebook=CP,
    params=("out_a", "lse_a", "out_b", "lse_b"),
    cases=[case(*c, label=label) for label, *c in MERGE_CASES],
    harness=merge_harness,
    reference="lesson12:merge",
    explain="lesson12:explain_merge",
    points=2,
    rtol=1e-9, atol=1e-10,
    hints=("Each block's output is normalized by its own sum of exponentials, and that sum is "
           "exp of its log-sum-exp; attention over both blocks is normalized by the sum of both.",
           "Take both sums relative to the larger log-sum-exp, so that no exponential exceeds 1; "
           "a row with no key in either block has nothing to normalize."),
))


# --- lesson12.ring_step ----------------------------------------------------------------------------

RING_CASES = (("causal, zigzag, 2 ranks", 2, 8, True, "zigzag"),
              ("causal, contiguous, 3 ranks", 3, 12, True, "contiguous"),
              ("causal, zigzag, 4 ranks, T=13 (padded)", 4, 13, True, "zigzag"),
              ("not causal, 2 ranks", 2, 8, False, "zigzag"),
              ("not causal, 3 ranks, T=7 (padded)", 3, 7, False, "contiguous"))


def part(z: torch.Tensor, cp: int, rank: int, layout: str) -> torch.Tensor:
    """Rank's two chunks of z along dim 2 (padded), with the given layout helpers only."""
    from course_lib.context_parallel import chunk_ids, pad_sequence, padded_length

    chunks = pad_sequence(z, padded_length(z.shape[2], cp), 2).chunk(2 * cp, dim=2)
    return torch.cat([chunks[c] for c in chunk_ids(layout, rank, cp)], dim=2)


def ring_inputs(t: int):
    return tuple(randn(s, 1, 2, t, 3) for s in (7, 8, 9))


def ring_harness(fn, cp: int, t: int, causal: bool, layout: str) -> dict:
    """Fold `fn` over every rank's block in ring order, on one process: each rank's rows at
    real positions."""
    from course_lib.context_parallel import padded_length, positions

    q, k, v = ring_inputs(t)
    local = padded_length(t, cp) // cp
    rows = {}
    for rank in range(cp):
        mine = part(q, cp, rank, layout)
        out = torch.zeros_like(mine)
        lse = torch.full(out.shape[:-1], float("-inf"), dtype=torch.float64)
        q_pos = positions(layout, rank, cp, local)
        for step in range(cp):
            src = (rank - step) % cp
            out, lse = fn(mine, part(k, cp, src, layout), part(v, cp, src, layout), q_pos,
                          positions(layout, src, cp, local), out, lse, causal=causal,
                          seq_len=t, scale=3 ** -0.5)
        rows[f"rank {rank}"] = out[..., q_pos < t, :] if isinstance(out, torch.Tensor) else out
    return rows


register(Exercise(
    name="lesson12.ring_step",
    notebook=CP,
    params=("q", "k", "v", "q_pos", "k_pos", "out", "lse", "causal", "seq_len", "scale"),
    cases=[case(*c, label=label) for label, *c in RING_CASES],
    harness=ring_harness,
    reference="lesson12:ring_step",
    explain="lesson12:explain_ring_step",
    points=2,
    rtol=1e-9, atol=1e-10,
    hints=("A block's rows and columns are not the sequence's first positions: each carries its "
           "global position, and only those say which key a query may see.",
           "Compare every query's global position with every key's; a key at the sequence's "
           "length or beyond is padding and is seen by no query."),
))


# --- lesson12.gather_from_sequence_parallel / reduce_scatter_to_sequence_parallel -------------

def _calls(counted: dict) -> str:
    return ", ".join(name if n == 1 else f"{name} x{n}"
                     for name, n in sorted(counted.items()) if n) or "none"


def comm(forward: dict, backward: dict) -> str:
    return f"forward: {_calls(forward)}; backward: {_calls(backward)}"


def whole(seed: int, k: int) -> torch.Tensor:
    """A whole activation (2, 2k, 3): rank r's slice is positions 2r, 2r + 1."""
    return randn(seed, 2, 2 * k, 3)


def upstream(seed: int, k: int, rank: int) -> torch.Tensor:
    """dL/d(output) on `rank`: rank r's loss uses its own output features (a TP share)."""
    return randn(100 * seed + rank, 2, 2 * k, 3)


def _gather_body(dist, rank: int, fn, seed: int) -> dict:
    k = dist.get_world_size()
    x = whole(seed, k).chunk(k, dim=1)[rank].clone().requires_grad_()
    out = counted_passes(dist, lambda: fn(x, dist, None), upstream(seed, k, rank), comm)
    return {**out, "dx": x.grad}


def _reduce_scatter_body(dist, rank: int, fn, seed: int) -> dict:
    k = dist.get_world_size()
    partial = (whole(seed, k) * (rank + 1)).requires_grad_()
    out = counted_passes(dist, lambda: fn(partial, dist, None),
                         upstream(seed, k, 0).chunk(k, dim=1)[rank], comm)
    return {**out, "d partial": partial.grad}


PAIR_CASES = [case(RANK, WORLD_SIZE, 2, 0, label="the sequence on 2 ranks"),
              case(RANK, WORLD_SIZE, 3, 1, label="the sequence on 3 ranks"),
              case(RANK, WORLD_SIZE, 4, 2, label="the sequence on 4 ranks")]

register_on_sub_worlds(
    "lesson12.gather_from_sequence_parallel", SP, params=("x", "dist", "group"),
    cases=PAIR_CASES, harness=harness(_gather_body),
    reference="lesson12:gather_from_sequence_parallel",
    explain="lesson12:explain_gather_from_sequence_parallel", points=2, rtol=1e-10, atol=1e-12,
    hints=("The pair is lesson 06's f and g with the sequence split: what one does in the forward "
           "pass, the other does in the backward pass. After the gather, each rank's gradient "
           "of the whole sequence covers only its own output features.",
           "Backward: sum those partial gradients over the ranks and keep only this rank's slice "
           "of the sequence, in one collective that sends half the bytes of a full sum."))

register_on_sub_worlds(
    "lesson12.reduce_scatter_to_sequence_parallel", SP, params=("x", "dist", "group"),
    cases=PAIR_CASES, harness=harness(_reduce_scatter_body),
    reference="lesson12:reduce_scatter_to_sequence_parallel",
    explain="lesson12:explain_reduce_scatter_to_sequence_parallel", points=2, rtol=1e-10,
    atol=1e-12,
    hints=("Forward: the ranks' partial results summed, each rank keeping its slice of the "
           "sequence. Backward: every rank's partial result fed the whole sequence, so each "
           "needs the gradient of the whole sequence.",
           "Backward: every rank holds the gradient of its own slice; join the slices in rank "
           "order along the sequence, on every rank."))


# --- lesson12.stream_seeds ----------------------------------------------------------------------
# Each rank of a (dp, tp, pp) layout seeds a tracker with the learner's seeds, draws a dropout
# mask in each stream, and compares its masks with every rank's: which ranks drew the same.

SEED = 1234


def layout_coords(rank: int, dp: int, tp: int) -> dict[str, int]:
    """rank = (pp_rank * dp + dp_rank) * tp + tp_rank."""
    return {"pp_rank": rank // (dp * tp), "dp_rank": rank // tp % dp, "tp_rank": rank % tp}


def _masks(fn, seed: int, coords: dict[str, int]) -> dict[str, torch.Tensor] | str:
    from course_lib.rng import REPLICATED, SHARDED, RNGStatesTracker

    seeds = fn(seed, **coords)
    if not isinstance(seeds, dict) or set(seeds) != {REPLICATED, SHARDED}:
        return f"a dict with the keys {REPLICATED!r}, {SHARDED!r} expected, got {seeds!r}"[:120]
    tracker, masks = RNGStatesTracker(), {}
    for name in (REPLICATED, SHARDED):
        try:
            tracker.add(name, int(seeds[name]))
        except ValueError as e:
            return str(e)
        with tracker.fork(name):
            masks[name] = (torch.rand(32) < 0.5).to(torch.float64)
    return masks


def masks_alike(replicated: list[int], sharded: list[int], changes: bool) -> str:
    """The ranks whose masks equal this rank's in each stream, and whether another base seed
    changes them: 'replicated as 0 1; sharded as 0; seed+1 changes them'."""
    return (f"replicated as {' '.join(map(str, replicated))}; sharded as "
            f"{' '.join(map(str, sharded))}; seed+1 {'changes' if changes else 'keeps'} them")


def alike_of(text: str) -> tuple[list[int], list[int], bool] | None:
    """`masks_alike`'s arguments back from its text (None for any other text)."""
    m = re.fullmatch(r"replicated as ([\d ]*); sharded as ([\d ]*); seed\+1 (changes|keeps) them",
                     str(text))
    if m is None:
        return None
    return ([int(r) for r in m[1].split()], [int(r) for r in m[2].split()],
            m[3] == "changes")


def _streams_body(dist, rank: int, fn, dp: int, tp: int) -> str:
    from course_lib.rng import REPLICATED, SHARDED

    coords = layout_coords(rank, dp, tp)
    mine, other = _masks(fn, SEED, coords), _masks(fn, SEED + 1, coords)
    if isinstance(mine, str) or isinstance(other, str):
        return mine if isinstance(mine, str) else other
    k = dist.get_world_size()
    alike = []
    for name in (REPLICATED, SHARDED):
        every = [torch.empty_like(mine[name]) for _ in range(k)]
        dist.all_gather(every, mine[name])
        alike.append([r for r in range(k) if torch.equal(every[r], mine[name])])
    return masks_alike(*alike, all(not torch.equal(mine[n], other[n])
                                   for n in (REPLICATED, SHARDED)))


streams_harness = harness(_streams_body)


register_on_sub_worlds(
    "lesson12.stream_seeds", SP, params=("seed", "tp_rank", "dp_rank", "pp_rank"),
    cases=[case(RANK, WORLD_SIZE, k, dp, tp, label=f"{k} ranks, (dp, tp, pp) = ({dp}, {tp}, "
                f"{k // (dp * tp)})")
           for k, dp, tp in ((2, 1, 2), (2, 2, 1), (3, 1, 3), (3, 1, 1), (4, 2, 2), (4, 1, 2))],
    harness=streams_harness,
    reference="lesson12:stream_seeds",
    explain="lesson12:explain_stream_seeds",
    points=2,
    hints=("A stream's seed must say everything that must differ, and nothing that must agree: "
           "ranks that compute the same tensor draw the same masks, ranks that hold different "
           "samples, slices or layers draw different ones.",
           "For each stream, list the coordinates along which its masks must differ: the "
           "replicated stream agrees inside a tp group, the sharded stream differs on every tp "
           "rank, and both differ across data-parallel replicas and stages. Only those go "
           "into the stream's seed, with the base seed and the stream's name."),
)
