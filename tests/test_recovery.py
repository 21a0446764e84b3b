"""Recovery on a real cluster: a rank's engine is SIGKILLed in the middle of a step, the run
notices, restarts the engines (or goes on with the survivors) and resumes from the newest
checkpoint, and the training ends where one process training on the whole batch ends.

Each step takes a global batch of 12 samples in micro-batches of 1: 3 per rank on 4 ranks,
4 per rank on the 3 survivors, so the global batch does not change. The reference is plain
PyTorch on one process; float64, tolerance rtol 1e-10 (sums are grouped differently).
"""

from __future__ import annotations

import os
import sys

import cloudpickle
import numpy as np
import pytest
import test_resume as tr
from test_resume import STEPS, build, full_params, reference, restore, state_of, train

cloudpickle.register_pickle_by_value(sys.modules[__name__])  # engines cannot import tests/
cloudpickle.register_pickle_by_value(tr)
pytestmark = pytest.mark.cluster
EVERY, KILL_RANK, KILL_STEP, MICRO = 4, 2, 6, 1


def resilient(root: str, kind: str) -> dict:
    """Train to the end, checkpointing every EVERY steps and resuming from the newest; on the
    first attempt rank KILL_RANK SIGKILLs itself mid-step KILL_STEP."""
    import signal

    from course_lib import dist
    from course_lib.recovery import CheckpointManager

    rank, world = dist.get_rank(), dist.get_world_size()
    marker = os.path.join(root, "killed")

    def maybe_die(step: int) -> None:
        if rank == KILL_RANK and step == KILL_STEP and not os.path.exists(marker):
            open(marker, "w").close()
            os.kill(os.getpid(), signal.SIGKILL)

    manager = CheckpointManager(os.path.join(root, kind), keep=2)
    parts = build(kind, seed=7, dropout=0.0)
    state = state_of(parts, rank, 0, init_state=True)
    del state["rng"]  # no dropout here; ranks of another world have no RNG of their own
    step = manager.load_latest(state)
    if step is None:  # a fresh start: the optimizer must not keep the state made to load into
        step, parts = 0, build(kind, seed=7, dropout=0.0)
    else:
        restore(parts, {**state, "rng": {f"rank{rank}": state_of(parts, rank, 0)["rng"][
            f"rank{rank}"]}}, rank)
    resumed_at = step
    while step < STEPS:
        train(parts, step, step + 1, rank, world, micro=MICRO, after_backward=maybe_die)
        step += 1
        if step % EVERY == 0:
            saved = state_of(parts, rank, step)
            del saved["rng"]
            manager.save(saved, step)
    return {"resumed_at": resumed_at, "world": world, "final": full_params(parts)}


def test_a_killed_rank_is_recovered_and_training_ends_where_one_process_does(tmp_path):
    """DDP restarted on 4 ranks, then ZeRO-1 resharded onto the 3 survivors (one cluster)."""
    from course_lib.cluster import start
    from course_lib.recovery import run_with_recovery

    want = reference()
    with start(4, backend="scratch", timeout=60) as cluster:
        for kind, on_failure, survivors in (("ddp", "restart", 4), ("zero1", "shrink", 3)):
            root = tmp_path / kind
            root.mkdir()
            results, failures = run_with_recovery(cluster, resilient, str(root), kind,
                                                  on_failure=on_failure)
            assert len(failures) == 1 and list(failures[0].dead) == [KILL_RANK], failures
            assert failures[0].world_size == survivors == cluster.world_size
            assert len(results) == survivors
            for rank, r in enumerate(results):
                # the newest complete checkpoint before the kill: step 4; steps 5, 6 are redone
                assert (r["resumed_at"], r["world"]) == (EVERY, survivors), (kind, r)
                for name, value in want.items():
                    np.testing.assert_allclose(r["final"][name], value, rtol=1e-10, atol=1e-13,
                                               err_msg=f"{kind} {name} rank {rank}")
