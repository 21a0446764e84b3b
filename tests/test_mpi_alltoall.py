"""course_lib.mpi's all_to_all and all_to_all_single. Under mpiexec (inside the launch of
tests/test_mpi.py, whose `check_collectives` calls `check_alltoall` here): on 2 and 3 ranks,
the block-size patterns of tests/test_dist_alltoall.py (0-length blocks included) land as
gloo's and ours do (that file holds both to the transposition checked here), in place and into
strided outputs too; the argument errors are course_lib.dist's, word for word. Here: a tensor
on another device is refused, naming the device and the operation."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from test_dist_alltoall import (block, expected, inputs, out_splits,  # noqa: E402
                                split_cases, uniform)

from course_lib import mpi  # noqa: E402


def _message(call) -> str | None:
    try:
        call()
    except ValueError as exc:
        return str(exc)
    return None


def bad_calls(a2a, rank: int, **group) -> dict:
    """The argument errors on 3 ranks (course_lib.mpi's, or course_lib.dist's)."""
    zeros = torch.zeros
    return {name: _message(call) for name, call in {
        "uneven without splits": lambda: a2a.all_to_all_single(zeros(4), zeros(4), **group),
        "splits that do not add up": lambda: a2a.all_to_all_single(
            zeros(3), zeros(3), [1, 1, 1], [1, 1, 2], **group),
        "list of the wrong length": lambda: a2a.all_to_all([zeros(1)] * 2, [zeros(1)] * 3,
                                                          **group),
        "unknown algorithm": lambda: a2a.all_to_all_single(zeros(3), zeros(3),
                                                           algorithm="ring", **group),
        "own block of another size": lambda: a2a.all_to_all_single(  # every rank's differs
            zeros(3), zeros(3), [0, 1, 2], [2, 0, 1], **group),
    }.items()}


def dist_errors(rank: int) -> dict:
    """course_lib.dist's messages for `bad_calls` on rank `rank` of 3, from its own checks."""
    from course_lib.dist.alltoall import _check_algorithm, _splits

    return {
        "uneven without splits": _message(lambda: _splits(None, torch.zeros(4), 3, "input")),
        "splits that do not add up": _message(
            lambda: _splits([1, 1, 2], torch.zeros(3), 3, "input")),
        "list of the wrong length": "all_to_all: output_tensor_list must hold one tensor per "
                                    "rank of the group (3), got 2",
        "unknown algorithm": _message(lambda: _check_algorithm("ring")),
        "own block of another size": f"all_to_all_single: rank {rank} keeps {[2, 0, 1][rank]} "
                                     f"rows of its input but expects {[0, 1, 2][rank]}",
    }


def sampled(p: int) -> list[dict]:
    """split_cases(p) but its large blocks (shared memory is the scratch backend's concern):
    every named pattern, every other dtype and row shape, and one in four of the others."""
    return [c for n, c in enumerate(split_cases(p)) if c.get("label", "") != "large blocks"
            and ("label" in c or c["row"] or n % 4 == 0)]


def check_alltoall(dist, rank: int, world: int) -> list[str]:
    """The sampled cases on the first p ranks, p = 2 .. world: single (every third
    asynchronously, a transposed output on every fifth) and the list form on uniform cases
    and every seventh; in place; then the argument errors (world 3)."""
    bad = []
    for p in range(2, world + 1):
        group = dist.new_group(list(range(p)))  # every rank creates it
        if rank >= p:
            continue
        for n, case in enumerate(sampled(p)):
            label = f"rank {rank} of {p}, case {n} {case.get('label', case['sizes'])}"
            blocks, want = inputs(rank, case), expected(rank, case)
            out = torch.full((sum(out_splits(rank, case)), *case["row"]), -7).to(want.dtype)
            if n % 5 == 0 and out.dim() == 2:  # strided: filled through a contiguous copy
                out = torch.full(out.shape[::-1], -7).to(want.dtype).t()
            work = dist.all_to_all_single(out, torch.cat(blocks), out_splits(rank, case),
                                          case["sizes"][rank], group=group, async_op=n % 3 == 0)
            if work is not None:
                work.wait()
            if not torch.equal(out, want):
                bad.append(f"all_to_all_single, {label}")
            if uniform(case) or n % 7 == 0:
                want_lists = [block(i, rank, case["sizes"][i][rank], case["row"], case["dtype"])
                              for i in range(p)]
                lists = [torch.full_like(t, -7) for t in want_lists]
                dist.all_to_all(lists, blocks, group=group)
                if not all(map(torch.equal, lists, want_lists)):
                    bad.append(f"all_to_all, {label}")
    t = torch.arange(2.0 * world) + 100 * rank  # in place: input and output one tensor
    dist.all_to_all_single(t, t)
    if not torch.equal(t, torch.cat([torch.arange(2.0) + 2 * rank + 100 * i
                                     for i in range(world)])):
        bad.append(f"rank {rank}: all_to_all_single in place: {t.tolist()}")
    if world == 3:
        got, want = bad_calls(dist, rank), dist_errors(rank)
        bad += [f"rank {rank}: {name}: {got[name]!r}, course_lib.dist says {want[name]!r}"
                for name in want if got[name] is None or got[name] != want[name]]
    return bad


def test_mpi_refuses_a_tensor_on_another_device():
    meta = torch.empty(4, device="meta")
    for name, call in {
        "all_reduce": lambda: mpi.all_reduce(meta),
        "all_gather": lambda: mpi.all_gather([torch.empty(4)], meta),
        "gather": lambda: mpi.gather(meta),
        "reduce_scatter": lambda: mpi.reduce_scatter(meta, [meta]),
        "isend": lambda: mpi.isend(meta, 1),
        "all_to_all_single": lambda: mpi.all_to_all_single(torch.empty(4), meta),
        "all_to_all": lambda: mpi.all_to_all([torch.empty(4)], [meta]),
    }.items():
        with pytest.raises(TypeError, match=rf"course_lib\.mpi\.{name}: .* on meta"):
            call()
