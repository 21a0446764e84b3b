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
import torch
from torch import nn

import test_resume as tr
from course_lib.data import shard_indices
from test_resume import STEPS, build, full_params, restore, state_of, train

cloudpickle.register_pickle_by_value(sys.modules[__name__])  # engines cannot import tests/
cloudpickle.register_pickle_by_value(tr)
pytestmark = pytest.mark.cluster
EVERY, KILL_RANK, KILL_STEP, MICRO = 4, 2, 6, 1


def reference() -> dict[str, np.ndarray]:
    """One process, the whole global batch each step, the same sample order."""
    torch.manual_seed(7)
    model = tr.Net(0.0).double()
    opt = torch.optim.AdamW(model.parameters(), lr=0.01, weight_decay=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=4, gamma=0.7)
    for step in range(tr.STEPS):
        epoch, at = divmod(step * tr.G, tr.N)
        idx = shard_indices(tr.N, 1, 0, shuffle=True, seed=3 + epoch)[at:at + tr.G]
        opt.zero_grad()
        nn.functional.mse_loss(model(tr.DATA[0][idx]), tr.DATA[1][idx]).backward()
        opt.step()
        sched.step()
    return {k: v.detach().numpy().copy() for k, v in model.state_dict().items()}


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


@pytest.mark.parametrize("kind, on_failure", [("ddp", "restart"), ("zero1", "shrink")])
def test_a_killed_rank_is_recovered_and_training_ends_where_one_process_does(
        kind, on_failure, tmp_path):
    from course_lib.cluster import start
    from course_lib.recovery import run_with_recovery

    want = reference()
    with start(4, backend="scratch", timeout=60) as cluster:
        results, failures = run_with_recovery(cluster, resilient, str(tmp_path), kind,
                                              on_failure=on_failure)
        survivors = 4 if on_failure == "restart" else 3
        assert len(failures) == 1 and list(failures[0].dead) == [KILL_RANK], failures
        assert failures[0].world_size == survivors == cluster.world_size
    assert len(results) == survivors
    for rank, r in enumerate(results):
        # the newest complete checkpoint before the kill was step 4; steps 5 and 6 are redone
        assert (r["resumed_at"], r["world"]) == (EVERY, survivors), r
        for name, value in want.items():
            np.testing.assert_allclose(r["final"][name], value, rtol=1e-10, atol=1e-13,
                                       err_msg=f"{kind} {name} rank {rank}")
