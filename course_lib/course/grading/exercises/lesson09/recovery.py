"""Lesson 09b's checks (recovery): the flight recorder's verdict on another rank from its record,
what a checkpoint must hold to resume exactly (checked by resuming a short run on 2, 3 and 4
ranks), the accumulation that keeps the global batch when the world shrinks, and which
checkpoints in a folder are complete.

Components (course_lib.checkpoint, course_lib.recovery, ...) are imported inside the functions
that use them, on purpose: the learner's overlay decides at each call which version runs (theirs
or the reference), and a name bound at import time would keep the first one.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

from course_lib.course.grading import RANK, WORLD_SIZE, Exercise, case, register
from course_lib.course.grading.exercises.lesson09.fixtures import (_cleanup, _remove,
                                                                  _shared_folder, write_fixture)
from course_lib.course.grading.sub_worlds import on_first_ranks, register_on_sub_worlds

PART_B = "09b_recovery"


# --- lesson09.standing: the flight recorder's verdict on one rank -------------------------------


def _entry(seq: int, op: str, state: str, dtype: str | None = "float32",
           shape: list | None = None) -> dict:
    if op == "barrier":
        dtype, shape = None, None
    return {"seq": seq, "op": op, "dtype": dtype, "shape": [1024] if shape is None and dtype
            else shape, "start": float(seq), "end": None if state == "started" else seq + 0.5,
            "state": state, "algorithm": None}


def _done(n: int, op: str = "all_reduce") -> list[dict]:
    return [_entry(s, op, "completed") for s in range(n)]


# Each scenario: (the asking rank's failed call, {rank: its record or None}); the asking rank
# is not in the records, as in the flight recorder.
SCENARIOS = {
    "2 ranks: rank 1 sleeps": (
        _entry(3, "all_reduce", "failed"), {1: _done(3)}),
    "3 ranks: rank 2 skipped a barrier": (
        _entry(3, "barrier", "failed"),
        {1: _done(3) + [_entry(3, "barrier", "started")],
         2: _done(3) + [_entry(3, "all_reduce", "started")]}),
    "3 ranks: rank 2 called all_reduce on another shape": (
        _entry(3, "all_reduce", "failed"),
        {1: _done(3) + [_entry(3, "all_reduce", "failed")],
         2: _done(3) + [_entry(3, "all_reduce", "failed", shape=[5])]}),
    "4 ranks: rank 3 sleeps, ranks 1 and 2 wait too": (
        _entry(3, "all_reduce", "failed"),
        {1: _done(3) + [_entry(3, "all_reduce", "started")],
         2: _done(3) + [_entry(3, "all_reduce", "started")], 3: _done(3)}),
    "4 ranks: one done, one gone, one stuck in an earlier call": (
        _entry(3, "all_reduce", "failed"),
        {1: _done(3) + [_entry(3, "all_reduce", "completed")], 2: None,
         3: _done(2) + [_entry(2, "all_gather", "started")]}),
    "4 ranks: rank 2 never completed a call of this group": (
        _entry(0, "broadcast", "failed"),
        {1: [_entry(0, "broadcast", "started")], 2: [], 3: [_entry(0, "broadcast", "started")]}),
}


def standing_harness(fn, scenario: str) -> list:
    """The learner's verdict on every other rank of the scenario, in rank order (None for the
    asking rank 0)."""
    call, records = SCENARIOS[scenario]
    world = 1 + max(records)
    out = [None] * world
    for rank in range(1, world):
        record = records[rank]
        got = fn(dict(call), None if record is None else [dict(e) for e in record])
        out[rank] = got
    return out


register(Exercise(
    name="lesson09.standing",
    notebook=PART_B,
    params=("call", "record"),
    cases=[case("2 ranks: rank 1 sleeps", label="2 ranks: rank 1 sleeps"),
           case("3 ranks: rank 2 skipped a barrier", label="3 ranks: rank 2 skipped a barrier"),
           case("3 ranks: rank 2 called all_reduce on another shape",
                label="3 ranks: rank 2 called all_reduce on another shape"),
           case("4 ranks: rank 3 sleeps, ranks 1 and 2 wait too",
                label="4 ranks: rank 3 sleeps, ranks 1 and 2 wait too"),
           case("4 ranks: one done, one gone, one stuck in an earlier call",
                label="4 ranks: one done, one gone, one stuck in an earlier call"),
           case("4 ranks: rank 2 never completed a call of this group",
                label="4 ranks: rank 2 never completed a call of this group")],
    reference="lesson09:standing",
    explain="lesson09:explain_standing",
    harness=standing_harness,
    points=3,
    hints=("A rank that made the same call at the same sequence number is not to blame, "
           "whatever state it is in: it waits, or got through, like this rank. The rank to "
           "blame made no call at that number yet, or made a different one there; and the same "
           "call means the same operation, dtype and shape, not only the same number.",
           "Look at the other rank's entries with this call's sequence number: the last of "
           "them, if any, decides between the same call and another call. For any other "
           "verdict, say how far it got (the highest sequence number below this one that it "
           "completed) and where it is now (the collective it is in, if any)."),
))


# --- lesson09.run_state: what a checkpoint holds to resume exactly ------------------------------

RESUME_SAMPLES, RESUME_PER_RANK, RESUME_STEPS = 24, 2, 6


def _resume_body(dist, rank: int, fn) -> dict:
    import torch

    from course_lib import checkpoint
    from course_lib.recovery import ResumableSampler, restore

    k = dist.get_world_size()
    xs = torch.randn(RESUME_SAMPLES, 6, generator=torch.Generator().manual_seed(1),
                     dtype=torch.float64)
    ys = xs.sum(1, keepdim=True).tanh()

    def build():
        torch.manual_seed(11)
        model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Dropout(0.3),
                                    torch.nn.Tanh(), torch.nn.Linear(8, 1)).double()
        opt = torch.optim.AdamW(model.parameters(), lr=0.05)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
        sampler = ResumableSampler(range(RESUME_SAMPLES), num_replicas=k, rank=rank,
                                   shuffle=True, seed=5)
        torch.manual_seed(100 + rank)  # each rank draws its own dropout masks
        return model, opt, sched, sampler

    def train(parts, steps):
        model, opt, sched, sampler = parts
        for _ in range(steps):
            if sampler.position >= RESUME_SAMPLES:
                sampler.set_epoch(sampler.epoch + 1)
            idx = list(sampler)[:RESUME_PER_RANK]
            sampler.position += RESUME_PER_RANK * k
            torch.nn.functional.mse_loss(model(xs[idx]), ys[idx]).backward()
            for p in model.parameters():
                dist.all_reduce(p.grad)
                p.grad /= k
            opt.step()
            opt.zero_grad()
            sched.step()

    def now(parts):
        model, opt, _, sampler = parts
        if sampler.position >= RESUME_SAMPLES:
            sampler.set_epoch(sampler.epoch + 1)
        return {"next samples": list(sampler)[:RESUME_PER_RANK],
                "learning rate": opt.param_groups[0]["lr"], "draw": torch.rand(3).tolist()}

    half = RESUME_STEPS // 2
    clean = build()
    train(clean, half)
    want = now(clean)
    train(clean, RESUME_STEPS - half)
    folder = _shared_folder(dist, rank, "resume")
    try:
        first = build()
        train(first, half)
        checkpoint.save(fn(*first, half), folder, dist=dist)
        second = build()
        torch.manual_seed(12345)  # whatever the restart's RNG holds: the checkpoint decides
        state = fn(*second, 0, init=True)
        try:
            checkpoint.load(state, folder, dist=dist)
        except checkpoint.CheckpointError as exc:
            return {"resumes at step": "load failed: " + str(exc).rsplit(": ", 1)[-1][:80]}
        try:
            step = restore(*second, state)
        except (KeyError, TypeError) as exc:
            return {"resumes at step": f"restore failed: {type(exc).__name__} {exc}"}
        got = now(second)
        train(second, RESUME_STEPS - half)
        diff = max(float((a - b).abs().max()) for a, b in
                   zip(clean[0].parameters(), second[0].parameters()))
        return {"resumes at step": step, "next samples": got["next samples"],
                "learning rate": got["learning rate"],
                "next random draw": ("as in the uninterrupted run" if got["draw"] == want["draw"]
                                     else "not the uninterrupted run's"),
                "parameters": ("bitwise equal to the uninterrupted run's" if diff == 0 else
                               f"differ from the uninterrupted run's by up to {diff:.1e}")}
    finally:
        _cleanup(dist, rank, folder)


def resume_harness(fn, rank: int, world_size: int, k: int):
    return on_first_ranks(k, _resume_body, fn)


register_on_sub_worlds(
    "lesson09.run_state", PART_B,
    params=("model", "optimizer", "scheduler", "sampler", "step"),
    cases=[case(RANK, WORLD_SIZE, 2, label="2 ranks: 3 steps, save, restart, 3 steps"),
           case(RANK, WORLD_SIZE, 3, label="3 ranks: 3 steps, save, restart, 3 steps"),
           case(RANK, WORLD_SIZE, 4, label="4 ranks: 3 steps, save, restart, 3 steps")],
    reference="lesson09:run_state",
    explain="lesson09:explain_run_state",
    harness=resume_harness,
    points=2,
    time_limit=20.0,
    hints=("The next step depends on more than the weights: on the optimizer's moments, on "
           "the learning rate the scheduler will give, on which samples come next, and on the "
           "random numbers each rank will draw. Some of that is the same on every rank and some "
           "is a rank's own; a checkpoint keeps one copy of what is the same everywhere.",
           "Six entries, by the names the restore expects. The RNG state of a rank must sit "
           "under a key that names that rank, or every rank comes back with one rank's stream."),
)


# --- lesson09.accumulation_steps ---------------------------------------------------------------


def accumulation_harness(fn, global_batch: int, micro_batch: int, world_size: int):
    try:
        return fn(global_batch, micro_batch, world_size)
    except ValueError:
        return "raises ValueError"


register(Exercise(
    name="lesson09.accumulation_steps",
    notebook=PART_B,
    params=("global_batch", "micro_batch", "world_size"),
    cases=[case(12, 1, 4, label="12 = 4 ranks x 3 micro-batches of 1"),
           case(12, 1, 3, label="one of the 4 ranks died: 3 ranks"),
           case(48, 4, 2, label="48 on 2 ranks of micro-batches of 4"),
           case(64, 8, 8, label="a step of one micro-batch each"),
           case(12, 1, 5, label="5 ranks cannot share 12 samples: an error"),
           case(48, 5, 2, label="micro-batches of 5 do not add up to 48: an error")],
    reference="lesson09:accumulation_steps",
    explain="lesson09:explain_accumulation_steps",
    harness=accumulation_harness,
    points=1,
    hints=("A step must take the same number of samples on any world: that number is fixed, "
           "the world is not, so what each rank accumulates must make up the difference; and a "
           "step that cannot take exactly that many is an error, never a rounded step.",
           "One round of micro-batches, one per rank, takes micro_batch samples on each of the "
           "ranks; count how many such rounds make one global batch."),
))


# --- lesson09.checkpoints: which checkpoint to load ---------------------------------------------


def checkpoints_harness(fn, layout: str) -> list:
    """Make a folder of checkpoints, some damaged, and return what `fn(root)` lists:
    [(step, folder name)], newest first."""
    from course_lib import checkpoint_files as cf

    root = Path(tempfile.mkdtemp(prefix="lesson09-choose-"))
    try:
        steps = {"plain": [5, 10, 15], "damaged": [100, 200, 300, 400, 900],
                 "wide": [8, 9, 10, 11, 99, 100]}[layout]
        for step in steps:
            write_fixture(root / f"step-{step:09d}", 1, step=step)
        if layout == "damaged":
            (root / "step-000000900" / cf.MANIFEST).unlink()  # killed before its manifest
            shard = next((root / "step-000000400").glob("*.safetensors"))
            shard.write_bytes(shard.read_bytes()[:-8])  # truncated after its manifest
            (root / "step-000000250").mkdir()  # an empty folder
            (root / "notes.txt").write_text("not a checkpoint")
            (root / "step-latest").mkdir()
        got = fn(root)
        return [(int(s), Path(p).name) for s, p in got]
    finally:
        _remove(root)


register(Exercise(
    name="lesson09.checkpoints",
    notebook=PART_B,
    params=("root",),
    cases=[case("plain", label="three complete checkpoints"),
           case("damaged", label="one without a manifest, one truncated, strays"),
           case("wide", label="steps 8 to 100: newest by number")],
    reference="lesson09:checkpoints",
    explain="lesson09:explain_checkpoints",
    harness=checkpoints_harness,
    points=2,
    hints=("A folder is a checkpoint only if its manifest exists, parses, and every file it "
           "names is there at its size: the reader the lesson gives says so, or raises. "
           "Anything else in the root is not a checkpoint, whatever its name.",
           "Newest means the highest step, compared as a number: the folder names hold it with "
           "leading zeros, and strays do not hold one at all."),
))
