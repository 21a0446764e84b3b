"""Lesson 07's exercises: the solutions score full points, realistic wrong versions less."""

from __future__ import annotations

from course_lib.grading import grade_function
from course_lib.pipeline import gpipe_order, one_f_one_b_order, pipeline_grads


def _forward_all(stages, x, target, loss_fn, m, scale):
    acts = [[] for _ in stages]
    losses = []
    for xb, yb in zip(x.chunk(m), target.chunk(m)):
        h = xb
        for s, stage in enumerate(stages):
            inp = h.detach().requires_grad_()
            h = stage(inp)
            acts[s].append((inp, h))
        losses.append(loss_fn(h, yb) / (m if scale else 1))
    return acts, losses


def _pipeline_unscaled(stages, x, target, loss_fn, n_microbatches):
    """Forgets to divide each micro-batch's loss by m."""
    acts, losses = _forward_all(stages, x, target, loss_fn, n_microbatches, scale=False)
    for i, loss in enumerate(losses):
        loss.backward()
        for s in range(len(stages) - 2, -1, -1):
            acts[s][i][1].backward(acts[s + 1][i][0].grad)


def _pipeline_lifo(stages, x, target, loss_fn, n_microbatches):
    """Earlier stages pop their stored activations last-in-first-out while gradients arrive
    in micro-batch order: the order mismatch."""
    acts, losses = _forward_all(stages, x, target, loss_fn, n_microbatches, scale=True)
    for i, loss in enumerate(losses):
        loss.backward()
        grad = acts[-1][i][0].grad
        for s in range(len(stages) - 2, -1, -1):
            inp, out = acts[s].pop()
            out.backward(grad)
            grad = inp.grad


def _gpipe_reversed_backward(n_microbatches, num_stages, stage_index):
    m = n_microbatches
    return [("F", i) for i in range(m)] + [("B", i) for i in reversed(range(m))]


def _1f1b_off_by_one(n_microbatches, num_stages, stage_index):
    m = n_microbatches
    warmup = min(num_stages - stage_index, m)
    actions = [("F", i) for i in range(warmup)]
    for i in range(m - warmup):
        actions += [("F", warmup + i), ("B", i)]
    return actions + [("B", i) for i in range(m - warmup, m)]


def _1f1b_uncapped_warmup(n_microbatches, num_stages, stage_index):
    m = n_microbatches
    warmup = num_stages - 1 - stage_index
    actions = [("F", i) for i in range(warmup)]
    for i in range(m - warmup):
        actions += [("F", warmup + i), ("B", i)]
    return actions + [("B", i) for i in range(max(m - warmup, 0), m)]


def test_lesson07_exercises_score_solutions_and_reject_wrong_versions():
    cases = [("lesson07.pipeline_grads", pipeline_grads, [_pipeline_unscaled, _pipeline_lifo]),
             ("lesson07.gpipe_order", gpipe_order, [_gpipe_reversed_backward]),
             ("lesson07.one_f_one_b_order", one_f_one_b_order,
              [_1f1b_off_by_one, _1f1b_uncapped_warmup, gpipe_order])]
    for name, solution, wrongs in cases:
        right = grade_function(name, solution)
        assert right.points == right.max_points, (name, right.reason)
        for wrong in wrongs:
            result = grade_function(name, wrong)
            assert result.points < result.max_points, (name, wrong.__name__, result.reason)
