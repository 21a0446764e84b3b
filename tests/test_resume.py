"""Resume is exact: a run stopped, saved, rebuilt from nothing and reloaded ends where an
uninterrupted run ends, and a checkpoint saved on N ranks loads on M.

Same world size (scratch backend, 2 and 4 ranks): 20 steps uninterrupted against 10 steps, a
save, every object thrown away and rebuilt from other seeds with the RNGs scrambled, a load and
10 more steps; parameters, optimizer state and the samples each step read must be bitwise
equal (`torch.equal`), for DDP with accumulation, ZeRO-1, ZeRO-2 and FSDP, with dropout drawing
from the RNG. Across world sizes (gloo backend): saved on 4, loaded on 2 with twice the
accumulation, the 10 more steps must end where plain PyTorch on one process, training on the
whole global batch, ends after 20 (float64, rtol 1e-10: the sums are grouped differently); and 2 -> 3 -> 4, the full state assembled from
every rank's pieces must equal what was saved, element for element.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

from course_lib.spawn import spawn

KINDS = ("ddp", "zero1", "zero2", "fsdp")
N, G, MICRO, STEPS, HALF = 96, 12, 3, 20, 10  # dataset, global batch, micro-batch, steps


class Net(nn.Module):
    """Uneven shapes, dropout (draws from torch's RNG), a buffer and a frozen parameter."""

    def __init__(self, dropout: float):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(7, 13), nn.Linear(13, 5)
        self.drop = nn.Dropout(dropout)
        self.frozen = nn.Parameter(torch.randn(5) * 0.1, requires_grad=False)
        self.register_buffer("scale", torch.full((5,), 0.5, dtype=torch.float64))

    def forward(self, x):
        return self.fc2(self.drop(torch.tanh(self.fc1(x)))) * self.scale + self.frozen


DATA = (torch.randn(N, 7, generator=torch.Generator().manual_seed(1), dtype=torch.float64),
        torch.randn(N, 5, generator=torch.Generator().manual_seed(2), dtype=torch.float64))


def build(kind: str, seed: int, dropout: float):
    """Model, optimizer, scheduler and sampler for `kind`, from `seed` (rank 0's wins)."""
    from course_lib import zero
    from course_lib.ddp import DistributedDataParallel
    from course_lib.recovery import ResumableSampler

    torch.manual_seed(seed)
    model = Net(dropout).double()
    if kind == "ddp":
        model = DistributedDataParallel(model, bucket_cap_mb=0.0005)
        opt = torch.optim.AdamW(model.parameters(), lr=0.01, weight_decay=0.1)
    elif kind.startswith("zero"):
        opt = zero.ZeroRedundancyOptimizer(model.parameters(), torch.optim.AdamW,
                                           stage=int(kind[-1]), bucket_cap_mb=0.0005, lr=0.01,
                                           weight_decay=0.1)
    else:
        zero.fully_shard(model.fc1)
        zero.fully_shard(model.fc2)
        zero.fully_shard(model)
        opt = torch.optim.AdamW(model.parameters(), lr=0.01, weight_decay=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=4, gamma=0.7)
    return model, opt, sched, ResumableSampler(range(N), shuffle=True, seed=3)


def train(parts, start: int, stop: int, rank: int, world: int, micro: int = MICRO,
          after_backward=None) -> list[list[int]]:
    """Steps [start, stop) with gradient accumulation; returns the indices each step read.
    `after_backward(step)` runs after each micro-batch's backward (to fail mid-step)."""
    from contextlib import nullcontext

    from course_lib.recovery import accumulation_steps

    model, opt, sched, sampler = parts
    accum = accumulation_steps(G, micro, world)
    seen = []
    for step in range(start, stop):
        if sampler.position >= N:
            sampler.set_epoch(sampler.epoch + 1)
        mine = list(sampler)[:G // world]
        sampler.position += G
        seen.append(mine)
        for m in range(accum):
            idx = mine[m * micro:(m + 1) * micro]
            last = m == accum - 1
            sync = model.no_sync() if (hasattr(model, "no_sync") and not last) else nullcontext()
            with sync:
                loss = nn.functional.mse_loss(model(DATA[0][idx]), DATA[1][idx]) / accum
                loss.backward()
            if after_backward is not None:
                after_backward(step)
        opt.step()
        opt.zero_grad()
        sched.step()
    return seen


def state_of(parts, rank: int, step: int, *, init_state: bool = False) -> dict:
    from course_lib.recovery import get_state_dict, rng_state

    model, opt, sched, sampler = parts
    model_sd, optim_sd = get_state_dict(model, opt, init_state=init_state)
    return {"model": model_sd, "optim": optim_sd, "sched": sched.state_dict(),
            "sampler": sampler.state_dict(), "step": step, "rng": {f"rank{rank}": rng_state()}}


def restore(parts, state: dict, rank: int) -> None:
    from course_lib.recovery import set_rng_state, set_state_dict

    model, opt, sched, sampler = parts
    set_state_dict(model, opt, state["model"], state["optim"])
    sched.load_state_dict(state["sched"])
    sampler.load_state_dict(state["sampler"])
    set_rng_state(state["rng"][f"rank{rank}"])


def local_tensors(parts) -> list[torch.Tensor]:
    """Everything this rank holds that training changes: parameters and optimizer state."""
    model, opt, _, _ = parts
    inner = getattr(opt, "optim", opt)
    state = [v for p in inner.state for v in inner.state[p].values() if torch.is_tensor(v)]
    return [p.detach() for p in model.parameters()] + state


def full_params(parts) -> dict[str, np.ndarray]:
    from course_lib import zero
    from course_lib.recovery import _unwrap

    model = _unwrap(parts[0])
    sd = zero.full_state_dict(model, rank0_only=False) if zero._units(model) else model.state_dict()
    return {k: v.numpy().copy() for k, v in sd.items()}


def pieces(parts) -> dict[str, list]:
    """This rank's part of every tensor of the saved state: {key: [(offset, values)]}."""
    from course_lib.checkpoint import Piece, flatten

    sd = state_of(parts, 0, 0)
    out = {}
    for key, (leaf, _, _) in flatten({"model": sd["model"], "optim": sd["optim"]}).items():
        if isinstance(leaf, Piece):
            out[key] = (leaf.offset, leaf.tensor.numpy().copy(), list(leaf.shape))
        elif torch.is_tensor(leaf):
            out[key] = (0, leaf.reshape(-1).numpy().copy(), list(leaf.shape))
    return out


def same_world(rank: int, world: int, root: str) -> dict:
    from course_lib.recovery import CheckpointManager

    out = {}
    for kind in KINDS:
        torch.manual_seed(100 + rank)
        ref = build(kind, seed=7, dropout=0.2)
        ref_seen = train(ref, 0, STEPS, rank, world)

        torch.manual_seed(100 + rank)  # the same RNG stream as the uninterrupted run
        first = build(kind, seed=7, dropout=0.2)
        seen = train(first, 0, HALF, rank, world)
        manager = CheckpointManager(f"{root}/{kind}", keep=2)
        manager.save(state_of(first, rank, HALF), HALF)
        del first

        torch.manual_seed(12345 + rank)  # scrambled: everything must come from the checkpoint
        again = build(kind, seed=99, dropout=0.2)
        state = state_of(again, rank, 0, init_state=True)
        step = manager.load_latest(state)
        restore(again, state, rank)
        seen += train(again, step, STEPS, rank, world)
        a, b = local_tensors(ref), local_tensors(again)
        out[kind] = {"step": step, "count": (len(a), len(b)),
                     "equal": all(torch.equal(x, y) for x, y in zip(a, b)),
                     "seen": seen == ref_seen}
    return out


def save_for_reshard(rank: int, world: int, root: str) -> dict:
    """World 4: the state after 10 steps, saved for loading on 2."""
    from course_lib import checkpoint

    out = {}
    for kind in ("ddp", "zero1", "fsdp"):
        run = build(kind, seed=7, dropout=0.0)
        train(run, 0, HALF, rank, world)
        checkpoint.save(state_of(run, rank, HALF), f"{root}/{kind}-4")
        out[kind] = {"saved": pieces(run)}
    return out


def reference() -> dict[str, np.ndarray]:
    """One process, the whole global batch each step, the same sample order, 20 steps."""
    from course_lib.data import shard_indices

    torch.manual_seed(7)
    model = Net(0.0).double()
    opt = torch.optim.AdamW(model.parameters(), lr=0.01, weight_decay=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=4, gamma=0.7)
    for step in range(STEPS):
        epoch, at = divmod(step * G, N)
        idx = shard_indices(N, 1, 0, shuffle=True, seed=3 + epoch)[at:at + G]
        opt.zero_grad()
        nn.functional.mse_loss(model(DATA[0][idx]), DATA[1][idx]).backward()
        opt.step()
        sched.step()
    return {k: v.detach().numpy().copy() for k, v in model.state_dict().items()}


def reshard(rank: int, world: int, root: str, src: str, dst: str | None, more: bool) -> dict:
    """Load what `src` ranks saved, on this world; optionally train on and save again."""
    from course_lib import checkpoint

    out = {}
    for kind in ("ddp", "zero1", "fsdp"):
        run = build(kind, seed=99, dropout=0.0)
        state = state_of(run, rank, 0, init_state=True)
        del state["rng"]  # per-rank: a new world's ranks keep their own
        checkpoint.load(state, f"{root}/{kind}-{src}")
        restore(run, {**state, "rng": {f"rank{rank}": state_of(run, rank, 0)["rng"][
            f"rank{rank}"]}}, rank)
        out[kind] = {"loaded": pieces(run), "step": state["step"]}
        if more:
            train(run, HALF, STEPS, rank, world)
            out[kind]["final"] = full_params(run)
        if dst:
            checkpoint.save(state_of(run, rank, state["step"]), f"{root}/{kind}-{dst}")
            out[kind]["saved"] = pieces(run)
    return out


def assemble(per_rank: list[dict]) -> dict[str, np.ndarray]:
    """The full tensors from every rank's pieces; every element must be covered."""
    full: dict[str, np.ndarray] = {}
    filled: dict[str, np.ndarray] = {}
    for got in per_rank:
        for key, (offset, values, shape) in got.items():
            numel = int(np.prod(shape))
            if key not in full:
                full[key] = np.zeros(numel, values.dtype)
                filled[key] = np.zeros(numel, bool)
            full[key][offset:offset + values.size] = values
            filled[key][offset:offset + values.size] = True
    assert all(f.all() for f in filled.values()), "some elements are on no rank"
    return full


@pytest.mark.parametrize("world", [2, 4])
def test_resume_on_the_same_world_is_bitwise_exact(world, tmp_path):
    results = spawn(same_world, world, str(tmp_path), backend="scratch", timeout=120)
    for rank, by_kind in enumerate(results):
        for kind, r in by_kind.items():
            assert r["step"] == HALF, (kind, rank)
            assert r["count"][0] == r["count"][1] > 0, (kind, rank, r["count"])
            assert r["equal"], f"{kind}: rank {rank}'s parameters or optimizer state differ"
            assert r["seen"], f"{kind}: rank {rank} read other samples after the resume"


def test_checkpoints_reshard_4_to_2_to_3_to_4(tmp_path):
    root = str(tmp_path)
    final = reference()
    four = spawn(save_for_reshard, 4, root, backend="gloo", timeout=120)
    two = spawn(reshard, 2, root, "4", "2", True, backend="gloo", timeout=120)
    for kind in ("ddp", "zero1", "fsdp"):
        saved = assemble([r[kind]["saved"] for r in four])
        loaded = assemble([r[kind]["loaded"] for r in two])
        assert saved.keys() == loaded.keys(), kind
        for key in saved:
            assert np.array_equal(saved[key], loaded[key]), (kind, key)
        assert {r[kind]["step"] for r in two} == {HALF}
        # 4 -> 2 with twice the accumulation trains on as one process on the whole batch does.
        for rank in range(2):
            for name, want in final.items():
                np.testing.assert_allclose(two[rank][kind]["final"][name], want, rtol=1e-10,
                                           atol=1e-13, err_msg=f"{kind} {name} rank {rank}")
    # 2 -> 3 -> 4: what each world loads is what the previous saved, element for element.
    three = spawn(reshard, 3, root, "2", "3", False, backend="gloo", timeout=120)
    again = spawn(reshard, 4, root, "3", None, False, backend="gloo", timeout=120)
    for kind in ("ddp", "zero1", "fsdp"):
        for before, after in ((two, three), (three, again)):
            want = assemble([r[kind]["saved"] for r in before])
            got = assemble([r[kind]["loaded"] for r in after])
            assert want.keys() == got.keys(), kind
            for key in want:
                assert np.array_equal(want[key], got[key]), (kind, key)
