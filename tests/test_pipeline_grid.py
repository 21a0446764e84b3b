"""Issue 50's proof on real ranks: every pipeline schedule gives the gradients of one process.

GPipe, 1F1B, interleaved 1F1B (v = 2), ZB-H1 and ZBV, for p = 2, 3, 4 stages and m = 1..8
micro-batches (m < p included; every schedule admits every m of the grid), each a real step of
`course_lib.pipeline_multi`'s executor on its NCCL-ordered programs, on a tiny float64 model
(2p blocks of Linear(2, 2) + Tanh: every chunk of the interleaved and V schedules holds one
block). Two spawned worlds run the 120 (p, schedule, m) steps: gloo with 2 ranks for p = 2,
and the scratch backend with 7 ranks for p = 3 (ranks 0-2) and p = 4 (ranks 3-6) side by side,
each pipeline seeing its ranks as a world of its own (`Ranks`: point-to-point needs no group). Every parameter's gradient must equal one process's on the whole
batch within 1e-10 (relative, plus 1e-10 absolute), and each stage must run its actions in
its list's order. The simulator's grid (`test_pipeline_schedules.py`) proves the same lists
deadlock-free; this proves they compute the right thing.
"""

from __future__ import annotations

import pytest

from course_lib import pipeline_multi as ex
from course_lib import pipeline_schedules as sch
from course_lib.spawn import spawn

NAMES = tuple(sch.SCHEDULES)  # gpipe, 1f1b, interleaved, zb-h1, zbv
MICROBATCHES = tuple(range(1, 9))
TOL = 1e-10
WIDTH = 2


class Ranks:
    """Ranks first .. first + p - 1 of the process group, seen as a world of p ranks by the
    executor (its only calls: get_rank, get_world_size, isend, irecv)."""

    def __init__(self, first: int, p: int):
        from course_lib.backend import default_dist

        self.dist, self.first, self.p = default_dist(), first, p

    def get_rank(self, group=None) -> int:
        return self.dist.get_rank() - self.first

    def get_world_size(self, group=None) -> int:
        return self.p

    def isend(self, tensor, dst: int, group=None, tag: int = 0):
        return self.dist.isend(tensor, dst + self.first, tag=tag)

    def irecv(self, tensor, src: int, group=None, tag: int = 0):
        return self.dist.irecv(tensor, src + self.first, tag=tag)


def grid(rank: int, world: int, stages: tuple, names: tuple = NAMES,
         ms: tuple = MICROBATCHES) -> tuple[int, list[dict]]:
    """On each rank: (p, rows), the rows of one step of every schedule and m of the pipeline
    of p stages this rank belongs to (`stages`' pipelines laid out on consecutive ranks): this
    stage's worst gradient error against one process (<= 0: within tolerance; inf: a
    parameter got no gradient) and the actions in the order it ran them."""
    first = 0
    for p in stages:
        if rank < first + p:
            break
        first += p
    dist, stage, rows = Ranks(first, p), rank - first, []
    for name in names:
        for m in ms:
            s = sch.make(name, p, m)
            x, y = ex.make_batch(m, 2 * m, WIDTH)
            model = ex.build_model(m, WIDTH, blocks=2 * p)
            record, chunks = ex.run_step(stage, s, model, x, y, ex.programs_for(s)[stage],
                                         dist)
            want = ex.reference_grads(ex.build_model(m, WIDTH, blocks=2 * p), x, y,
                                      s.n_chunks)
            excess = max(float("inf") if q.grad is None else
                         float(((q.grad - r).abs() - TOL * (1 + r.abs())).max())
                         for c, chunk in zip(s.chunks_of(stage), chunks)
                         for q, r in zip(chunk.parameters(), want[c]))
            rows.append({"name": name, "m": m, "excess": excess,
                         "order": [(k, j, c) for _, k, j, c, *_ in record.timeline]})
    return p, rows


def failures(p: int, per_rank: list[list[dict]]) -> list[str]:
    """What differs from one process, or from the lists' order, one line per (schedule, m,
    stage)."""
    bad = []
    for rank, rows in enumerate(per_rank):
        for row in rows:
            where = f"{row['name']} p={p} m={row['m']} stage {rank}"
            if row["excess"] > 0:
                bad.append(f"{where}: gradients off one process by {row['excess']:.3g} "
                           "beyond the tolerance")
            want = [tuple(a) for a in sch.make(row["name"], p, row["m"]).stages[rank]]
            if row["order"] != want:
                bad.append(f"{where}: ran {row['order']}, the list says {want}")
    return bad


@pytest.mark.parametrize("backend, stages", [("gloo", (2,)), ("scratch", (3, 4))])
def test_every_schedule_equals_one_process_on_real_ranks(backend, stages):
    per_rank = spawn(grid, sum(stages), stages, backend=backend, timeout=120)
    for p in stages:
        rows = [r for q, r in per_rank if q == p]
        assert len(rows) == p and all(len(r) == len(NAMES) * len(MICROBATCHES) for r in rows)
        bad = failures(p, rows)
        assert not bad, "\n".join(bad)
