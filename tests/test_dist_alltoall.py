"""all_to_all and all_to_all_single from scratch: parity with gloo's on 2, 3 and 4 ranks for
every block-size pattern (0-length blocks included), the schedule's deadlock-freedom proof,
bounded waits and errors naming rank and peer, the alpha-beta models, and the byte count.

Data movement is exact: outputs must equal gloo's bit for bit (and the transposition the
parent computes itself). Each world size runs in one spawned function per backend.
"""

from __future__ import annotations

import itertools
import random

import pytest
import torch

from course_lib.spawn import spawn

from course_lib.dist import alltoall as a2a

LARGE = 300_000  # float32 rows per block: 1.2 MB, so blocks travel through shared memory


def split_cases(p: int) -> list[dict]:
    """The block-size matrices the parity test runs on p ranks (sizes[i][j]: rows i sends j):
    every matrix over a small alphabet on 2 ranks, else a seeded sample, plus
    the patterns an MoE router makes (a rank sending or receiving nothing, everything to one
    rank), trailing dims, dtypes and blocks large enough for shared memory."""
    if p == 2:  # every matrix over {0, 1, 3}
        grids = itertools.product((0, 1, 3), repeat=p * p)
    else:  # a seeded sample, 0 twice as likely as any other size
        rng = random.Random(p)
        grids = [[rng.choice((0, 0, 1, 2, 5)) for _ in range(p * p)] for _ in range(60)]
    cases = [{"sizes": [list(g[i * p:(i + 1) * p]) for i in range(p)], "row": [],
              "dtype": "float32"} for g in grids]
    even = [[3] * p for _ in range(p)]
    special = {
        "all empty": [[0] * p for _ in range(p)],
        "own block only": [[4 if i == j else 0 for j in range(p)] for i in range(p)],
        "rank 0 sends nothing": [[0] * p] + [[2] * p for _ in range(p - 1)],
        "rank 1 receives nothing": [[0 if j == 1 else 2 for j in range(p)] for _ in range(p)],
        "everything to rank 0": [[5 if j == 0 else 0 for j in range(p)] for _ in range(p)],
    }
    cases += [{"sizes": s, "row": [], "dtype": "float32", "label": k} for k, s in special.items()]
    cases += [{"sizes": even, "row": [3], "dtype": "float64"},
              {"sizes": even, "row": [2, 2], "dtype": "int64"},
              {"sizes": even, "row": [5], "dtype": "bfloat16"},
              {"sizes": [[LARGE + i] * p for i in range(p)], "row": [], "dtype": "float32",
               "label": "large blocks"}]
    return cases


def block(i: int, j: int, rows: int, row: list[int], dtype: str) -> torch.Tensor:
    """What rank i sends rank j: values that say where they come from (exact in every dtype)."""
    n = rows * (torch.Size(row).numel() if row else 1)
    values = (torch.arange(n) % 61) + 64 * (i * 4 + j) % 256 if dtype == "bfloat16" else (
        torch.arange(n) + 1_000_000 * i + 10_000 * j)
    return values.to(getattr(torch, dtype)).reshape(rows, *row)


def inputs(rank: int, case: dict) -> list[torch.Tensor]:
    p = len(case["sizes"])
    return [block(rank, j, case["sizes"][rank][j], case["row"], case["dtype"]) for j in range(p)]


def expected(rank: int, case: dict) -> torch.Tensor:
    p = len(case["sizes"])
    return torch.cat([block(i, rank, case["sizes"][i][rank], case["row"], case["dtype"])
                      for i in range(p)])


def out_splits(rank: int, case: dict) -> list[int]:
    return [row[rank] for row in case["sizes"]]


def uniform(case: dict) -> bool:
    """Every block the same size: what gloo's all_to_all (list form) accepts."""
    return len({n for row in case["sizes"] for n in row}) == 1


def run_gloo(rank: int, world: int) -> list:
    """gloo's all_to_all_single on every case, its all_to_all (list form) on uniform ones."""
    import torch.distributed as tdist

    got = []
    for n, case in enumerate(split_cases(world)):
        blocks = inputs(rank, case)
        out = torch.full((sum(out_splits(rank, case)), *case["row"]), -7).to(blocks[0].dtype)
        tdist.all_to_all_single(out, torch.cat(blocks), out_splits(rank, case),
                                case["sizes"][rank])
        lists = None
        if uniform(case):
            lists = [torch.full_like(block(i, rank, case["sizes"][i][rank], case["row"],
                                           case["dtype"]), -7) for i in range(world)]
            tdist.all_to_all(lists, blocks)
        got.append((out, lists))
    return got


def run_ours(rank: int, world: int) -> list:
    """Ours on every case: both algorithms, the list form on uniform cases and every seventh,
    and every third case asynchronously."""
    got = []
    for n, case in enumerate(split_cases(world)):
        blocks = inputs(rank, case)
        outs = {}
        for algorithm in a2a.ALGORITHMS:
            out = torch.full((sum(out_splits(rank, case)), *case["row"]), -7).to(blocks[0].dtype)
            work = a2a.all_to_all_single(out, torch.cat(blocks), out_splits(rank, case),
                                         case["sizes"][rank], async_op=n % 3 == 0,
                                         algorithm=algorithm)
            if work is not None:
                assert work.wait() and work.get_future().wait() == [out]
            outs[algorithm] = out
        lists = None
        if uniform(case) or n % 7 == 0:
            lists = [torch.full_like(block(i, rank, case["sizes"][i][rank], case["row"],
                                           case["dtype"]), -7) for i in range(world)]
            a2a.all_to_all(lists, blocks)
        got.append((outs, lists))
    return got


@pytest.mark.parametrize("world", [2, 3, 4])
def test_parity_with_gloo(world: int) -> None:
    theirs = spawn(run_gloo, world, backend="gloo", timeout=120)
    ours = spawn(run_ours, world, backend="scratch", timeout=120)
    cases = split_cases(world)
    for rank in range(world):
        for n, case in enumerate(cases):
            gloo_out, gloo_lists = theirs[rank][n]
            want = expected(rank, case)
            label = f"rank {rank}, case {n} {case.get('label', case['sizes'])}"
            assert torch.equal(gloo_out, want), f"gloo differs from the transposition: {label}"
            for algorithm, out in ours[rank][n][0].items():
                assert out.dtype == gloo_out.dtype and torch.equal(out, gloo_out), \
                    f"{algorithm} differs from gloo: {label}"
            our_lists = ours[rank][n][1]
            if our_lists is not None:
                want_lists = gloo_lists or [block(i, rank, case["sizes"][i][rank], case["row"],
                                                  case["dtype"]) for i in range(world)]
                for i, (a, b) in enumerate(zip(our_lists, want_lists)):
                    assert torch.equal(a, b), f"all_to_all list form, block from {i}: {label}"


# --- the schedule ------------------------------------------------------------------------------

def test_schedule_is_deadlock_free_and_complete() -> None:
    """Every round's sends meet receives in the same round; every pair exchanges once."""
    for p in range(1, 17):
        assert a2a.check_schedule(p) == [], p
    assert a2a.schedule(4)[0] == [(1, 1), (0, 0), (3, 3), (2, 2)]  # XOR: pairs swap
    assert a2a.schedule(3)[0] == [(1, 2), (2, 0), (0, 1)]  # shift: a ring, one way


def collide(rank: int, world_size: int, step: int) -> tuple[int, int]:
    """Wrong: send to and receive from rank r + s (right only where the pairing is symmetric)."""
    to = (rank + step) % world_size
    return to, to


def xor_everywhere(rank: int, world_size: int, step: int) -> tuple[int, int]:
    """Wrong: XOR on every world size (rank r ^ s may not exist)."""
    return rank ^ step, rank ^ step


def test_wrong_schedules_are_caught() -> None:
    assert a2a.check_schedule(2, collide) == []  # two ranks cannot tell
    problems = a2a.check_schedule(3, collide)
    assert any("round 1: rank 0 sends to rank 1, which receives from rank 2" in p
               for p in problems), problems
    assert a2a.check_schedule(3, xor_everywhere)
    assert a2a.check_schedule(6, xor_everywhere)
    assert a2a.check_schedule(4, xor_everywhere) == []


# --- waits, errors, async, debug mode ------------------------------------------------------------

def errors(rank: int, world: int) -> dict:
    """Mismatched splits, a rank that never arrives, argument errors, DETAIL mode."""
    from course_lib import dist

    seen = {}
    # rank 0 expects 2 rows from rank 1, which sends 3: the message's shape is wrong
    ins = [3, 1, 1] if rank == 1 else [1, 1, 1]
    outs = [1, 2, 1] if rank == 0 else [1, 1, 1]
    try:
        a2a.all_to_all_single(torch.zeros(sum(outs)), torch.zeros(sum(ins)), outs, ins)
        seen["mismatch"] = None
    except dist.DistError as exc:
        seen["mismatch"] = (str(exc), exc.rank, exc.peer_rank)
    dist.barrier()
    quick = dist.new_group([0, 1, 2], timeout=2.0)
    try:  # rank 2 never calls
        if rank != 2:
            a2a.all_to_all_single(torch.zeros(3), torch.zeros(3), group=quick)
        seen["timeout"] = None
    except dist.DistTimeoutError as exc:
        seen["timeout"] = (str(exc), exc.rank, exc.peer_rank)
    dist.barrier()
    for bad, call in {
        "uneven without splits": lambda: a2a.all_to_all_single(torch.zeros(4), torch.zeros(4)),
        "splits that do not add up": lambda: a2a.all_to_all_single(
            torch.zeros(3), torch.zeros(3), [1, 1, 1], [1, 1, 2]),
        "list of the wrong length": lambda: a2a.all_to_all([torch.zeros(1)] * 2,
                                                          [torch.zeros(1)] * 3),
        "unknown algorithm": lambda: a2a.all_to_all_single(torch.zeros(3), torch.zeros(3),
                                                           algorithm="ring"),
    }.items():
        try:
            call()
            seen[bad] = None
        except ValueError as exc:
            seen[bad] = str(exc)
    dist.set_debug_level("DETAIL")  # fingerprints traded before every collective
    out = torch.zeros(3)
    a2a.all_to_all_single(out, torch.full((3,), float(rank)))
    seen["detail"] = out.tolist()
    dist.set_debug_level("OFF")
    return seen


def test_errors_name_rank_and_peer() -> None:
    results = spawn(errors, 3, backend="scratch", timeout=60)
    message, rank, peer = results[0]["mismatch"]
    assert (rank, peer) == (0, 1) and "all_to_all_single(pairwise)" in message, message
    assert "rank 0" in message and "rank 1" in message
    for r in (0, 1):
        message, rank, peer = results[r]["timeout"]
        assert rank == r and peer == 2, message
        assert "all_to_all_single" in message and "timed out" in message, message
        assert "rank 2" in message, message
    for r in range(3):
        for key in ("uneven without splits", "splits that do not add up",
                    "list of the wrong length", "unknown algorithm"):
            assert results[r][key], (r, key)
        assert results[r]["detail"] == [0.0, 1.0, 2.0]


# --- the models ---------------------------------------------------------------------------------

def test_alpha_beta_models() -> None:
    alpha, beta = 20e-6, 1e-9
    for p in (2, 3, 4, 8):
        even = [[4096.0] * p for _ in range(p)]
        want = a2a.even_time(4096.0 * p, p, alpha, beta)
        assert a2a.pairwise_time(even, alpha, beta) == pytest.approx(want)
        assert a2a.naive_time(even, alpha, beta) == pytest.approx(want)
    skew = [[0.0, 1e6, 0.0], [0.0, 0.0, 0.0], [0.0, 1e6, 0.0]]  # everything to rank 1
    # pairwise: rank 0's and rank 2's messages to rank 1 fall in different rounds
    assert a2a.pairwise_time(skew, alpha, beta) == pytest.approx(2 * alpha + 2e6 * beta)
    assert a2a.naive_time(skew, alpha, beta) == pytest.approx(2 * alpha + 2e6 * beta)
    assert a2a.sent_bytes([3, 0, 5], 0, 8) == 40 and a2a.sent_bytes([3, 0, 5], 2, 8) == 24
