"""Lesson 07 (pipeline parallel): micro-batches through stages in one process; schedule orders."""

from __future__ import annotations

from course_lib.grading import Exercise, case, register


def _model_and_batch(seed: int, batch: int = 8):
    import torch
    from torch import nn

    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 7), nn.Tanh(),
                          nn.Linear(7, 6), nn.Tanh(), nn.Linear(6, 3)).double()
    g = torch.Generator().manual_seed(seed + 100)
    return (model, torch.randn(batch, 5, generator=g, dtype=torch.float64),
            torch.randn(batch, 3, generator=g, dtype=torch.float64))


def pipeline_harness(fn, seed: int, n_stages: int, n_microbatches: int) -> list:
    """Split the model into stages, let `fn` run the micro-batches, return every .grad."""
    from torch.nn import functional as F

    from course_lib.pipeline import split_sequential

    model, x, y = _model_and_batch(seed)
    fn(split_sequential(model, n_stages), x, y, F.mse_loss, n_microbatches)
    return [p.grad for p in model.parameters()]


def _full_batch_grads(seed: int, n_stages: int, n_microbatches: int) -> list:
    from torch.nn import functional as F

    model, x, y = _model_and_batch(seed)
    F.mse_loss(model(x), y).backward()
    return [p.grad for p in model.parameters()]


register(Exercise(
    name="lesson07.pipeline_grads",
    notebook="07_pipeline_parallel",
    params=("stages", "x", "target", "loss_fn", "n_microbatches"),
    cases=[case(0, 2, 1, label="2 stages, 1 micro-batch"),
           case(0, 2, 4, label="2 stages, 4 micro-batches"),
           case(1, 3, 4, label="3 stages, 4 micro-batches"),
           case(2, 4, 8, label="4 stages, 8 micro-batches")],
    reference=_full_batch_grads,
    harness=pipeline_harness,
    points=3,
    rtol=1e-9, atol=1e-12,
    hint=("Forward each micro-batch through the stages, giving every stage a detached copy of "
          "its input with requires_grad and keeping (input, output) per stage. Backward each "
          "micro-batch: loss / n_microbatches on the last stage, then out.backward(grad) with "
          "the grad of the next stage's input, for the SAME micro-batch."),
))


def _order(kind: str):
    from course_lib import pipeline

    return getattr(pipeline, kind)


def _reference(kind: str):
    def ref(n_microbatches: int, num_stages: int, stage_index: int) -> list:
        return [tuple(a) for a in _order(kind)(n_microbatches, num_stages, stage_index)]
    return ref


def order_harness(fn, n_microbatches: int, num_stages: int, stage_index: int) -> list:
    return [tuple(a) for a in fn(n_microbatches, num_stages, stage_index)]


_ORDER_CASES = [case(4, 2, 0, label="m=4, p=2, stage 0"), case(4, 2, 1, label="m=4, p=2, stage 1"),
                case(8, 4, 0, label="m=8, p=4, stage 0"), case(8, 4, 2, label="m=8, p=4, stage 2"),
                case(2, 4, 0, label="m=2 < p=4, stage 0"), case(1, 3, 2, label="m=1, p=3, last")]

register(Exercise(
    name="lesson07.gpipe_order",
    notebook="07_pipeline_parallel",
    params=("n_microbatches", "num_stages", "stage_index"),
    cases=_ORDER_CASES,
    reference=_reference("gpipe_order"),
    harness=order_harness,
    points=1,
    hint="All forwards F0..F(m-1), then all backwards B0..B(m-1), in the same micro-batch order "
         "on every stage, so a gradient always meets its own activations.",
))

register(Exercise(
    name="lesson07.one_f_one_b_order",
    notebook="07_pipeline_parallel",
    params=("n_microbatches", "num_stages", "stage_index"),
    cases=_ORDER_CASES,
    reference=_reference("one_f_one_b_order"),
    harness=order_harness,
    points=2,
    hint="Warm up with min(p - 1 - stage, m) forwards; then for each remaining micro-batch one "
         "forward (the next one) and one backward (the oldest); then the leftover backwards.",
))
