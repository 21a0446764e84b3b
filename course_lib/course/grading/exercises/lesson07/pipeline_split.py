"""Lesson 07a's checks (splitting a model into stages): the bubble of a timeline, balanced
stages, micro-batches through the stages in one process. Expected values and explanations:
`course_lib/course/grading/references/lesson07.py`.

Components (course_lib.pipeline_split, ...) are imported inside the functions that use them, on
purpose: the learner's overlay decides at each call which version runs (theirs or the
reference), and a name bound at import time would keep the first one.
"""

from __future__ import annotations

from course_lib.course.grading import Exercise, case, register
from course_lib.i18n import N_

PART_A = "07a_pipeline_split"


# --- 07a: lesson07.bubble_fractions ------------------------------------------------------------

VALID = "a split of the layers"  # n_stages non-empty contiguous ranges, every layer once, in order


def bubble_harness(fn, spans: list) -> dict | str:
    """Events from (stage, action, start, end) tuples; the fractions `fn` computes, rounded."""
    from course_lib.pipeline_split import Event

    events = [Event(rank, action, i, start, end) for i, (rank, action, start, end)
              in enumerate(spans)]
    try:
        return {r: round(f, 9) for r, f in fn(events).items()}
    except ValueError:
        return "raises ValueError"


register(Exercise(
    name="lesson07.bubble_fractions",
    notebook=PART_A,
    params=("events",),
    cases=[
        case([(0, "F", 0.0, 1.0), (1, "F", 1.0, 2.0), (1, "B", 2.0, 3.0), (0, "B", 3.0, 4.0)],
             label="2 stages, one micro-batch: half idle each"),
        case([(0, "F", 0.0, 1.0), (0, "F", 1.0, 2.0), (1, "F", 1.0, 2.0), (1, "F", 2.0, 3.0),
              (1, "B", 3.0, 4.0), (1, "B", 4.0, 5.0), (0, "B", 4.0, 5.0), (0, "B", 5.0, 6.0)],
             label="2 stages, all forwards then all backwards, m = 2"),
        case([(2, "F", 5.0, 6.0), (0, "F", 0.0, 3.0), (1, "F", 3.0, 5.0)],
             label="3 stages, uneven, out of order"),
        case([], label="no events: an error"),
    ],
    reference="lesson07:bubble_fractions",
    explain="lesson07:explain_bubble",
    harness=bubble_harness,
    points=1,
    hints=("A stage's bubble is its idle share of the whole step. The step runs from the "
           "earliest start of any stage to the latest end of any stage: one span, the same for "
           "every stage, so a stage that starts late is idle until it starts.",
           "Add up each stage's busy time (how long each of its events lasts); what is left of "
           "the span is idle. Picture the first case: stage 1 starts one unit late and stage 0 "
           "waits one unit in the middle, so each is idle half of the four units."),
))


# --- 07a: lesson07.partition -------------------------------------------------------------------

def partition_harness(fn, costs: list, n_stages: int) -> dict | str:
    """Whether `fn`'s ranges are a valid split (or what is wrong with them), and its largest
    stage cost: any split with the smallest largest stage is right (ties either way)."""
    try:
        ranges = list(fn(costs, n_stages))
    except ValueError:
        return "raises ValueError"
    layers = [i for r in ranges for i in r]
    problem = (N_("not one range per stage") if len(ranges) != n_stages else
               N_("a stage is empty") if any(len(r) == 0 for r in ranges) else
               N_("a range that skips layers") if any(r.step != 1 for r in ranges) else
               N_("not every layer once, in order") if layers != list(range(len(costs))) else
               None)
    return {VALID: problem or True,
            "largest stage cost": None if problem else max(sum(costs[i] for i in r)
                                                          for r in ranges)}


register(Exercise(
    name="lesson07.partition",
    notebook=PART_A,
    params=("costs", "n_stages"),
    cases=[
        case([1, 1, 1, 1], 2, label="4 equal layers, 2 stages"),
        case([5, 1, 1, 1, 1, 1], 2, label="a heavy first layer"),
        case([1, 2, 3, 4, 5, 6, 7, 8, 9], 3, label="growing costs, 3 stages"),
        case([4, 1, 1, 4, 1, 1, 4], 3, label="three heavy layers, 3 stages"),
        case([3, 3, 3], 3, label="one layer per stage"),
        case([1, 100, 1, 1], 3, label="one layer dominates"),
        case([2, 2], 3, label="more stages than layers: an error"),
    ],
    reference="lesson07:partition",
    explain="lesson07:explain_partition",
    harness=partition_harness,
    points=2,
    hints=("Build a table over (stages, layers): the smallest largest stage for the first few "
           "layers in a few stages. An entry follows from entries with one stage fewer, because "
           "the best split ends with one last stage after the best split of what comes before.",
           "For a prefix of layers in k stages, try every place for the last cut: the candidate "
           "is the larger of the table's entry before the cut (k - 1 stages) and the cost of the "
           "layers after it; keep the smallest, and remember which cut won. Walking the winning "
           "cuts back from all layers in all stages gives the ranges."),
))


# --- 07a: lesson07.pipeline_grads --------------------------------------------------------------

def model_and_batch(seed: int, batch: int = 8):
    """The float64 model every stage check splits, and its batch."""
    import torch
    from torch import nn

    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 7), nn.Tanh(),
                          nn.Linear(7, 6), nn.Tanh(), nn.Linear(6, 3)).double()
    g = torch.Generator().manual_seed(seed + 100)
    return (model, torch.randn(batch, 5, generator=g, dtype=torch.float64),
            torch.randn(batch, 3, generator=g, dtype=torch.float64))


def pipeline_harness(fn, seed: int, n_stages: int, n_microbatches: int) -> dict:
    """Split the model into stages, let `fn` run the micro-batches, return each stage's .grad."""
    from torch.nn import functional as F

    from course_lib.pipeline_split import split_sequential

    model, x, y = model_and_batch(seed)
    stages = split_sequential(model, n_stages)
    fn(stages, x, y, F.mse_loss, n_microbatches)
    return {f"stage {s} gradients": [p.grad for p in stage.parameters()]
            for s, stage in enumerate(stages)}


register(Exercise(
    name="lesson07.pipeline_grads",
    notebook=PART_A,
    params=("stages", "x", "target", "loss_fn", "n_microbatches"),
    cases=[case(0, 2, 1, label="2 stages, 1 micro-batch"),
           case(0, 2, 4, label="2 stages, 4 micro-batches"),
           case(1, 3, 4, label="3 stages, 4 micro-batches"),
           case(2, 4, 8, label="4 stages, 8 micro-batches")],
    reference="lesson07:full_batch_grads",
    explain="lesson07:explain_stage_grads",
    harness=pipeline_harness,
    points=3,
    rtol=1e-9, atol=1e-12,
    hints=("Two invariants. Each micro-batch's loss counts for 1/m of the batch's loss. And a "
           "stage's backward for a micro-batch starts from the gradient that the next stage's "
           "input received for that same micro-batch.",
           "Keep, for every micro-batch and every stage, the detached input you fed the stage "
           "and the output it gave. Then, micro-batch by micro-batch, go backward from the last "
           "stage's scaled loss and walk the stages back, each one's output taking the gradient "
           "that the next stage's input received."),
))
