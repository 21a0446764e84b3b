"""Lesson 05 (gradient accumulation): p ranks x k micro-batches of padded sequences equal one
step on the per-token loss of every real token of the step, with the gradient exchanged once
per step, and the step returns this rank's loss per token; no_sync inside the library's
DDP; the bytes autograd saves. Checked on 2, 3 and 4 ranks. The expected values and the
explanations are judge-side (course_lib/course/grading/references/lesson05.py).

Components (course_lib.ddp, ...) are imported inside the functions that use them, on
purpose: the learner's overlay decides at each call which version runs (theirs or the
reference), and a name bound at import time would keep the first one.
"""

from __future__ import annotations

from course_lib.course.grading import RANK, WORLD_SIZE, Exercise, case, register
from course_lib.course.grading.sub_worlds import on_first_ranks, register_on_sub_worlds

IN, OUT = 4, 2
LR = 0.5


def model_for_checks():
    """The small float64 model every check trains (seeded: the same on every rank)."""
    import torch
    from torch import nn

    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(IN, 8), nn.Tanh(), nn.Linear(8, OUT)).double()


def batch_for_checks(step: int, size: int):
    """The global batch of step `step`: every rank draws the same and takes its share."""
    import torch

    g = torch.Generator().manual_seed(100 + step)
    return (torch.randn(size, IN, generator=g, dtype=torch.float64),
            torch.randn(size, OUT, generator=g, dtype=torch.float64))


def flat_weights(model):
    import torch

    return torch.cat([q.detach().reshape(-1) for q in model.parameters()])


# --- lesson05.accumulation_step ---------------------------------------------------------------

SEQ = 5  # the padded length of every sequence in the token-weighted checks


def sequences_for_checks(step: int, n: int):
    """The global batch of step `step`: `n` sequences of 1 to SEQ real tokens, zero-padded to
    SEQ; (x, y, mask) with mask True on the real tokens. Every rank draws the same."""
    import torch

    g = torch.Generator().manual_seed(300 + step)
    lengths = torch.randint(1, SEQ + 1, (n,), generator=g)
    mask = torch.arange(SEQ) < lengths[:, None]
    x = torch.randn(n, SEQ, IN, generator=g, dtype=torch.float64) * mask[..., None]
    y = torch.randn(n, SEQ, OUT, generator=g, dtype=torch.float64) * mask[..., None]
    return x, y, mask


def token_loss(output, target):
    """Each token's loss, shape (batch, seq): the squared error averaged over its features."""
    return ((output - target) ** 2).mean(-1)


def rank_micro_batches(step: int, rank: int, p: int, sizes: tuple):
    """Rank `rank`'s micro-batches of step `step`: its share (every p-th sequence) of the
    global batch, cut into micro-batches of `sizes` sequences each."""
    x, y, mask = (t[rank::p] for t in sequences_for_checks(step, p * sum(sizes)))
    out, start = [], 0
    for size in sizes:
        out.append((x[start:start + size], y[start:start + size], mask[start:start + size]))
        start += size
    return out


def _what(value) -> object:
    """What a step returned, as the check shows it: a float as itself, anything else by type."""
    if isinstance(value, float):
        return value
    return "None" if value is None else f"a {type(value).__name__}"


def _refuses(fn) -> bool:
    """Whether fn refuses an empty list of micro-batches with a ValueError."""
    import torch

    model = model_for_checks()
    try:
        fn(model, torch.optim.SGD(model.parameters(), lr=LR), token_loss, [])
    except ValueError:
        return True
    return False


def _accumulation_body(dist, rank: int, fn, sizes: tuple, steps: int, plain: bool) -> dict:
    """`steps` calls of `fn` on this rank's micro-batches (`sizes` sequences each), on a DDP
    model (or a plain module): the weights after them, the all_reduce calls, and what each
    call returned."""
    import torch

    from course_lib.ddp import DistributedDataParallel

    p = dist.get_world_size()
    model = model_for_checks()
    if not plain:
        model = DistributedDataParallel(model, dist=dist)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    dist.reset()
    returned = []
    for step in range(steps):
        returned.append(_what(fn(model, opt, token_loss,
                                 rank_micro_batches(step, rank, p, sizes))))
    out = {"weights": flat_weights(model), "all_reduce calls": dist.calls["all_reduce"],
           "returned losses": returned}
    if plain:
        out["ValueError for no micro-batch"] = _refuses(fn)
    return out


def accumulation_harness(fn, rank: int, world_size: int, p: int, sizes: tuple, steps: int,
                         plain: bool = False):
    return on_first_ranks(p, _accumulation_body, fn, tuple(sizes), steps, plain)


register_on_sub_worlds(
    "lesson05.accumulation_step", "05_grad_accumulation",
    params=("model", "optimizer", "loss_fn", "micro_batches"),
    cases=[
        case(RANK, WORLD_SIZE, 2, (2, 2, 2, 2), 3,
             label="2 ranks, k=4 micro-batches of 2 sequences, 3 steps"),
        case(RANK, WORLD_SIZE, 3, (4,), 2, label="3 ranks, k=1 (a plain DDP step), 2 steps"),
        case(RANK, WORLD_SIZE, 3, (3, 1), 2,
             label="3 ranks, k=2 micro-batches of 3 and 1 sequences, 2 steps"),
        case(RANK, WORLD_SIZE, 4, (1, 2, 1), 2,
             label="4 ranks, k=3 micro-batches of 1, 2, 1 sequences, 2 steps"),
        case(RANK, WORLD_SIZE, 2, (2, 1), 2, True,
             label="2 ranks, plain modules (no no_sync), k=2 of 2 and 1, 2 steps; [] refused"),
    ],
    reference="lesson05:accumulation_step",
    explain="lesson05:explain_accumulation_step",
    harness=accumulation_harness,
    points=2,
    rtol=1e-7,
    atol=1e-9,
    hints=("One step over k micro-batches on p ranks must equal one step on the per-token loss "
           "of all the real tokens of the step, every rank's together: each real token weighs "
           "the same, wherever it sits, and padding weighs nothing. The ranks exchange the "
           "gradient once, the optimizer steps once.",
           "The step's number of real tokens is known before any backward: count this rank's, "
           "then the world's. Each micro-batch's summed token loss, divided by that number, "
           "is its exact share; remember that the wrapper averages the ranks' gradients, it "
           "does not add them."),
)


# --- lesson05.no_sync: the learner's no_sync inside the library's DDP, on 2, 3 and 4 ranks ------

def _no_sync_body(dist, rank: int, fn, m: int, b: int, steps: int, scenario: str) -> dict:
    """Accumulate `m` micro-batches per step, the first m-1 inside the learner's `fn(model)`:
    one block per micro-batch ("plain"), blocks nested, or after a block that raised."""
    import contextlib

    import torch
    from torch import nn

    from course_lib.ddp import DistributedDataParallel

    k = dist.get_world_size()
    model = DistributedDataParallel(model_for_checks(), dist=dist)
    opt = torch.optim.SGD(model.parameters(), lr=LR)

    def backward(x, y):
        (nn.functional.mse_loss(model(x), y) / m).backward()

    calls = []
    for step in range(steps):
        dist.reset()
        x, y = batch_for_checks(step, k * m * b)
        x, y = x[rank::k], y[rank::k]
        micro = [(x[i * b:(i + 1) * b], y[i * b:(i + 1) * b]) for i in range(m)]
        if scenario == "nested":  # micro-batch 0 in both blocks, the others but the last in one
            with fn(model):
                with fn(model):
                    backward(*micro[0])
                for mx, my in micro[1:-1]:
                    backward(mx, my)
        else:
            if scenario == "a block raised":
                with contextlib.suppress(KeyError):
                    with fn(model):
                        raise KeyError("a learner's bug inside the block")
            for mx, my in micro[:-1]:
                with fn(model):
                    backward(mx, my)
        backward(*micro[-1])
        opt.step()
        opt.zero_grad()
        calls.append(dist.calls["all_reduce"])
    return {"weights": flat_weights(model), "all_reduce calls per step": calls,
            "require_backward_grad_sync after": model.require_backward_grad_sync}


def no_sync_harness(fn, rank: int, world_size: int, k: int, *args) -> dict:
    return on_first_ranks(k, _no_sync_body, fn, *args)


register_on_sub_worlds(
    "lesson05.no_sync", "05_grad_accumulation",
    params=("ddp",),
    cases=[
        case(RANK, WORLD_SIZE, 2, 3, 2, 2, "plain",
             label="2 ranks, 3 micro-batches, one block each, 2 steps"),
        case(RANK, WORLD_SIZE, 3, 3, 1, 2, "nested", label="3 ranks, nested blocks, 2 steps"),
        case(RANK, WORLD_SIZE, 4, 2, 2, 2, "a block raised",
             label="4 ranks, after a block that raised, 2 steps"),
    ],
    reference="lesson05:no_sync",
    explain="lesson05:explain_no_sync",
    harness=no_sync_harness,
    points=2,
    rtol=1e-7,
    atol=1e-9,
    hints=("The block's only job is a switch: inside it the wrapper must not sync, and on the "
           "way out the switch is back exactly as the block found it, however the block ends "
           "and however many blocks are open.",
           "The wrapper's forward reads one attribute to decide whether this backward will "
           "sync, so that attribute is the switch. Note its value before turning it off; "
           "putting back that noted value, not a fixed one, is what makes nesting work, and "
           "putting it back on every exit is what survives an exception."),
)


# --- lesson05.saved_activation_bytes -----------------------------------------------------------

def saving_model(kind: str):
    """Models whose saved tensors differ: an MLP (inputs, ReLU outputs; weights by reference),
    a square (the input saved twice, kept once), and a LayerNorm (its statistics too)."""
    import torch
    from torch import nn

    torch.manual_seed(0)
    if kind == "mlp":
        return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))

    class Square(nn.Module):
        def forward(self, x):
            return (x * x).sum()
    if kind == "square":
        return Square()
    return nn.Sequential(nn.Linear(8, 8), nn.LayerNorm(8), nn.Tanh())


def saving_input(kind: str, batch: int):
    import torch

    x = torch.randn(batch, 8, generator=torch.Generator().manual_seed(batch))
    return x.requires_grad_(kind == "square")


def saved_harness(fn, kind: str, batch: int) -> int:
    return int(fn(saving_model(kind), saving_input(kind, batch)))


register(Exercise(
    name="lesson05.saved_activation_bytes",
    notebook="05_grad_accumulation",
    params=("model",),
    cases=[case("mlp", 4, label="MLP, batch 4"), case("mlp", 32, label="MLP, batch 32"),
           case("square", 5, label="x * x: x saved twice, stored once"),
           case("layernorm", 6, label="Linear, LayerNorm, Tanh")],
    reference="lesson05:saved_activation_bytes",
    explain="lesson05:explain_saved_activation_bytes",
    harness=saved_harness,
    points=2,
    hints=("Autograd can tell you every tensor it keeps for backward, as it keeps it, while "
           "forward runs: count the bytes of those, except the ones that are not activations.",
           "Two kinds are not activations: a parameter (or a view of one, such as a transposed "
           "weight: it shares the parameter's storage), and a tensor already counted, saved a "
           "second time by another operation. Tell them apart by where their memory lives "
           "and how they view it."),
))
