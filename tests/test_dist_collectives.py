"""Parity of every course_lib.dist collective with plain single-process PyTorch, on 2-4 ranks.

Each rank builds every rank's input from a seed, so it can compute the single-process answer
itself. Integers must match exactly; floats within rtol=atol=1e-5 (float32) or 1e-12 (float64),
since a distributed reduction adds in a different order. All checks run inside one spawned
function per world size and come back as a list of failures.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed

from course_lib.spawn import spawn

SIZES = [0, 1, 7, 1001, 70001]
SEGMENT_BYTES = 64 * 1024  # so that 70001 elements travel in several pipelined segments
DTYPES = [torch.float32, torch.int64]
ALGORITHMS = ["naive", "ring", "tree", "rabenseifner", "one_shot", "auto"]


def make(rank: int, n: int, dtype: torch.dtype, salt: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * rank + 7 * n + salt)
    if dtype.is_floating_point:
        return torch.randn(n, generator=g).to(dtype)
    return torch.randint(-5, 6, (n,), generator=g).to(dtype)


def reference(inputs: list[torch.Tensor], op) -> torch.Tensor:
    from course_lib.dist import ReduceOp

    x = torch.stack(inputs)
    if op is ReduceOp.SUM:
        return x.sum(0)
    if op is ReduceOp.PRODUCT:
        return x.prod(0)
    if op is ReduceOp.MIN:
        return x.amin(0)
    if op is ReduceOp.MAX:
        return x.amax(0)
    s = x.sum(0)
    return s / len(inputs) if s.is_floating_point() else torch.div(s, len(inputs),
                                                                  rounding_mode="floor")


def same(got: torch.Tensor, want: torch.Tensor) -> bool:
    if got.dtype != want.dtype or got.shape != want.shape:
        return False
    if got.is_floating_point():
        tol = 1e-12 if got.dtype == torch.float64 else 1e-5
        return torch.allclose(got, want, rtol=tol, atol=tol)
    return torch.equal(got, want)


def check_all(rank: int, world: int, group=None, members=None) -> list[str]:
    """Every collective on `group` (ranks `members`, global) against the reference."""
    from course_lib import dist
    from course_lib.dist import ReduceOp

    members = members or list(range(world))
    p, me = len(members), members.index(rank)
    bad: list[str] = []

    def expect(what: str, got: torch.Tensor, want: torch.Tensor) -> None:
        if not same(got, want):
            bad.append(f"rank {rank} group {members}: {what}: got {got.flatten()[:5].tolist()}"
                       f" want {want.flatten()[:5].tolist()}")

    for dtype in DTYPES:
        for n in SIZES:
            inputs = [make(r, n, dtype) for r in members]
            for op in ReduceOp:
                want = reference(inputs, op)
                for alg in ALGORITHMS:
                    t = inputs[me].clone()
                    dist.all_reduce(t, op=op, group=group, algorithm=alg)
                    expect(f"all_reduce({alg}, {op.name}, {dtype}, n={n})", t, want)
                for dst in members:
                    t = inputs[me].clone()
                    dist.reduce(t, dst=dst, op=op, group=group)
                    expect(f"reduce(dst={dst}, {op.name}, {dtype}, n={n})", t,
                           want if rank == dst else inputs[me])
            for src in members:
                for alg in ("naive", "tree"):
                    t = inputs[me].clone()
                    dist.broadcast(t, src=src, group=group, algorithm=alg)
                    expect(f"broadcast({alg}, src={src}, n={n})", t, inputs[members.index(src)])
                out = [torch.empty_like(inputs[0]) for _ in members] if rank == src else None
                dist.gather(inputs[me], out, dst=src, group=group)
                if rank == src:
                    for i in range(p):
                        expect(f"gather(dst={src}, n={n})[{i}]", out[i], inputs[i])
                pieces = [make(r, n, dtype, salt=src + 1) for r in members]
                t = torch.empty_like(inputs[me])
                dist.scatter(t, pieces if rank == src else None, src=src, group=group)
                expect(f"scatter(src={src}, n={n})", t, pieces[me])
            out = [torch.full_like(inputs[0], 9) for _ in members]
            dist.all_gather(out, inputs[me], group=group)
            for i in range(p):
                expect(f"all_gather(n={n})[{i}]", out[i], inputs[i])
            for op in (ReduceOp.SUM, ReduceOp.MAX, ReduceOp.AVG):
                lists = [[make(r, n, dtype, salt=10 + i) for i in range(p)] for r in members]
                mine = [t.clone() for t in lists[me]]
                t = torch.empty_like(inputs[me])
                dist.reduce_scatter(t, mine, op=op, group=group)
                expect(f"reduce_scatter({op.name}, n={n})", t,
                       reference([lists[r][me] for r in range(p)], op))
                for a, b in zip(mine, lists[me]):
                    expect("reduce_scatter leaves its inputs alone", a, b)
    # Other shapes and dtypes, non-contiguous tensors, async ops, barrier.
    for dtype in (torch.float64, torch.int32, torch.int8, torch.bfloat16):
        inputs = [make(r, 15, torch.float64).to(dtype) for r in members]
        t = inputs[me].clone()
        dist.all_reduce(t, group=group, algorithm="ring")
        want = reference([x.double() for x in inputs], ReduceOp.SUM).to(dtype)
        if dtype == torch.bfloat16:
            ok = torch.allclose(t.double(), want.double(), atol=0.1, rtol=0.02)
            if not ok:
                bad.append(f"rank {rank}: bfloat16 all_reduce {t.tolist()} vs {want.tolist()}")
        else:
            expect(f"all_reduce(ring, {dtype})", t, want)
    # bool: SUM and MAX are "any", PRODUCT and MIN "all" (as torch.distributed's backends do)
    flags = torch.stack([make(r, 70, torch.int64) > 2 for r in members])
    for op, want in ((ReduceOp.SUM, flags.any(0)), (ReduceOp.MAX, flags.any(0)),
                     (ReduceOp.PRODUCT, flags.all(0)), (ReduceOp.MIN, flags.all(0))):
        for alg in ALGORITHMS:
            t = flags[me].clone()
            dist.all_reduce(t, op=op, group=group, algorithm=alg)
            expect(f"all_reduce({alg}, {op.name}, bool)", t, want)
    full = [make(r, 35, torch.float32).view(5, 7) for r in members]
    t = full[me].clone().t()  # non-contiguous
    dist.all_reduce(t, group=group, algorithm="ring")
    expect("all_reduce of a transposed 5x7", t, reference(full, ReduceOp.SUM).t())
    a, b = full[me].clone(), full[me].clone() * 2
    w1 = dist.all_reduce(a, group=group, async_op=True, algorithm="ring")
    w2 = dist.all_reduce(b, group=group, async_op=True, algorithm="tree")
    w2.wait()
    w1.wait()
    expect("async all_reduce 1", a, reference(full, ReduceOp.SUM))
    expect("async all_reduce 2", b, reference([x * 2 for x in full], ReduceOp.SUM))
    t = full[me].clone()  # torch.distributed's ReduceOp works too (components may pass it)
    dist.all_reduce(t, op=torch.distributed.ReduceOp.MAX, group=group)
    expect("all_reduce with torch's ReduceOp.MAX", t, reference(full, ReduceOp.MAX))
    dist.barrier(group=group)
    return bad


def check_auto_table(rank: int, world: int) -> list[str]:
    """all_reduce(algorithm="auto") runs what the group's table says, row by row; a table that
    differs between ranks fails on every rank."""
    from course_lib import dist

    table = {world: [[100, "naive"], [4000, "rabenseifner"], [None, "ring"]], 0: [[None, "tree"]]}
    dist.set_all_reduce_table(table)
    bad = []
    for n, want in ((10, "naive"), (25, "naive"), (26, "rabenseifner"), (1000, "rabenseifner"),
                    (1001, "ring")):
        t = torch.ones(n)  # float32: 4 n bytes
        dist.all_reduce(t)
        got = dist.flight_record()["groups"]["0"]["entries"][-1]["algorithm"]
        if got != want or not torch.equal(t, torch.full((n,), float(world))):
            bad.append(f"rank {rank}: auto table: {4 * n} bytes ran {got}, want {want}")
    try:
        dist.set_all_reduce_table({0: [[None, "ring" if rank == world - 1 else "tree"]]})
        bad.append(f"rank {rank}: tables that differ between ranks were accepted")
    except ValueError as exc:
        if f"ranks [{world - 1}] passed a table different" not in str(exc):
            bad.append(f"rank {rank}: unclear table mismatch error: {exc}")
    dist.set_all_reduce_table(None)  # the default: staged through shared memory while it fits
    from course_lib.dist.collectives import table_choice
    from course_lib.dist.symmetric import ONE_SHOT_MAX_BYTES

    above = ONE_SHOT_MAX_BYTES // 4 + 1
    for n, want in ((3, "one_shot"), (above, table_choice(None, 4 * above, world))):
        dist.all_reduce(torch.ones(n))
        got = dist.flight_record()["groups"]["0"]["entries"][-1]["algorithm"]
        if got != want:
            bad.append(f"rank {rank}: with no table, {4 * n} bytes ran {got}, want {want}")
    return bad


def rabenseifner_worker(rank: int, world: int) -> list[str]:
    """Rabenseifner on worlds with several ranks beyond a power of two (6 = 4 + 2, and 5)."""
    from course_lib import dist
    from course_lib.dist import ReduceOp

    bad = []
    five = dist.new_group(list(range(5)))
    for group, members in ((None, list(range(world))), (five, list(range(5)))):
        if rank not in members:
            continue
        for dtype in (torch.float64, torch.int64):
            for n in (0, 1, 5, 6, 7, 1001):
                inputs = [make(r, n, dtype) for r in members]
                for op in (ReduceOp.SUM, ReduceOp.MAX, ReduceOp.AVG):
                    t = inputs[members.index(rank)].clone()
                    dist.all_reduce(t, op=op, group=group, algorithm="rabenseifner")
                    if not same(t, reference(inputs, op)):
                        bad.append(f"rank {rank}: rabenseifner on {len(members)} ranks, "
                                   f"{op.name} {dtype} n={n}")
    dist.barrier()
    return bad


def test_rabenseifner_beyond_powers_of_two():
    results = spawn(rabenseifner_worker, 6, backend="scratch", timeout=120)
    failures = [msg for rank_failures in results for msg in rank_failures]
    assert not failures, "\n".join(failures[:30])


def run_parity(rank: int, world: int) -> list[str]:
    from course_lib import dist
    from course_lib.dist import collectives

    collectives.SEGMENT_BYTES = SEGMENT_BYTES
    bad = check_all(rank, world)
    bad += check_auto_table(rank, world)
    if world >= 3:  # sub-groups: global ranks in src/dst, members only
        evens, odds = [r for r in range(world) if r % 2 == 0], [r for r in range(world) if r % 2]
        groups = {tuple(evens): dist.new_group(evens), tuple(odds): dist.new_group(odds)}
        mine = evens if rank % 2 == 0 else odds
        if dist.get_rank(groups[tuple(mine)]) != mine.index(rank):
            bad.append(f"rank {rank}: get_rank(group) is not its index in {mine}")
        if len(mine) > 1:
            bad += check_all(rank, world, groups[tuple(mine)], mine)
        other = groups[tuple(odds if mine is evens else evens)]
        try:
            dist.all_reduce(torch.ones(1), group=other)
            bad.append(f"rank {rank}: all_reduce on a group it is not in did not raise")
        except dist.DistError as exc:
            if "not a member" not in str(exc):
                bad.append(f"rank {rank}: unclear non-member error: {exc}")
        dist.barrier()
    return bad


@pytest.mark.parametrize("world", [2, 3, 4])
def test_collectives_match_single_process(world):
    results = spawn(run_parity, world, backend="scratch", timeout=240)
    failures = [msg for rank_failures in results for msg in rank_failures]
    assert not failures, "\n".join(failures[:30])
