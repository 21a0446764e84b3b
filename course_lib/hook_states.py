"""What the communication hooks of `course_lib.comm_hooks` keep and share: their state objects
(torch's names and defaults), where a hook communicates, the plain hook, PowerSGD's
orthogonalization and bookkeeping, and the bytes each hook puts into its collectives.

    state = PowerSGDState(None, matrix_approximation_rank=2)   # torch's PowerSGDState's fields
    ddp.register_comm_hook(state, comm_hooks.powerSGD_hook)

A hook's `state` is a process group (None: the world) or a state object whose `process_group`
and `dist` say where to communicate (`where`). Lesson 10b writes the hooks themselves
(`compress_hook`, `compress_with_feedback`, `powersgd_step`) in `course_lib.comm_hooks`, which
re-exports every name here; this module imports nothing from it.
"""

from __future__ import annotations

from typing import Any, Callable

import numpy as np
import torch

from course_lib.backend import default_dist
from course_lib.i18n import _

__all__ = ["DefaultState", "TopKState", "PowerSGDState", "where", "floating_buffer", "done",
           "allreduce_hook", "orthogonalize_", "split_compressible", "hook_bytes"]


class DefaultState:
    """Where a stateless hook communicates: `process_group` (None: the world) over `dist`."""

    def __init__(self, process_group: Any = None, *, dist: Any = None):
        self.process_group, self.dist = process_group, dist


def where(state: Any) -> tuple[Any, Any, int]:
    """(dist, group, world size) for a hook's `state`: a state object, a group, or None."""
    if hasattr(state, "process_group"):
        dist, group = default_dist(getattr(state, "dist", None)), state.process_group
    else:
        dist, group = default_dist(None), state
    return dist, group, dist.get_world_size(group)


def floating_buffer(bucket: Any, hook: str) -> torch.Tensor:
    """The bucket's flat buffer; a clear error if its gradients are not floating point."""
    buffer = bucket.buffer()
    if not buffer.is_floating_point():
        raise TypeError(_("{hook}: gradients must be floating point, got {dtype} (bucket "
                          "{index})", hook=hook, dtype=buffer.dtype, index=bucket.index()))
    return buffer


def done(value: Any) -> torch.futures.Future:
    """A future that is already complete with `value` (a hook that reduced synchronously)."""
    future = torch.futures.Future()
    future.set_result(value)
    return future


def allreduce_hook(state: Any, bucket: Any) -> torch.futures.Future:
    """What DDP does without a hook: divide by the world size, all_reduce (torch's
    allreduce_hook)."""
    buffer = floating_buffer(bucket, "allreduce_hook")
    dist, group, world = where(state)
    buffer.div_(world)
    return dist.all_reduce(buffer, group=group, async_op=True).get_future().then(
        lambda fut: fut.value()[0])


class TopKState:
    """State of `topk_hook`: the fraction of entries sent, and each bucket's residual."""

    def __init__(self, process_group: Any = None, *, ratio: float = 0.01,
                 use_error_feedback: bool = True, dist: Any = None):
        if not 0 < ratio <= 1:
            raise ValueError(_("TopKState: ratio must be in (0, 1], got {ratio}",
                               ratio=repr(ratio)))
        self.process_group, self.dist = process_group, dist
        self.ratio, self.use_error_feedback = ratio, use_error_feedback
        self.errors: dict[int, torch.Tensor] = {}


def orthogonalize_(matrices: torch.Tensor, epsilon: float = 0.0) -> None:
    """Gram-Schmidt on the columns of each matrix of a (batch, n, r) tensor, in place (torch's
    PowerSGD uses it up to rank 2 and QR above; so do we, to match it step for step)."""
    if matrices.shape[2] > 2 and matrices.dtype not in (torch.float16, torch.bfloat16):
        torch.linalg.qr(matrices, out=(matrices, torch.empty(
            matrices.shape[0], matrices.shape[2], matrices.shape[2], dtype=matrices.dtype,
            device=matrices.device)))
        return
    for i in range(matrices.shape[2]):
        col = matrices[:, :, i:i + 1]
        col /= torch.norm(col, dim=1, keepdim=True) + epsilon
        if i + 1 < matrices.shape[2]:
            rest = matrices[:, :, i + 1:]
            rest -= torch.sum(col * rest, dim=1, keepdim=True) * col


class PowerSGDState:
    """PowerSGD's settings and memory (torch's PowerSGDState's names and defaults): vanilla
    all_reduce for the first `start_powerSGD_iter` steps, then rank-r compression of every
    matrix where it saves `min_compression_rate`, with error feedback and warm-started Qs."""

    def __init__(self, process_group: Any = None, matrix_approximation_rank: int = 1,
                 start_powerSGD_iter: int = 1_000, min_compression_rate: float = 2,
                 use_error_feedback: bool = True, warm_start: bool = True,
                 orthogonalization_epsilon: float = 0.0, random_seed: int = 0, *,
                 dist: Any = None):
        if not isinstance(matrix_approximation_rank, int) or matrix_approximation_rank < 1:
            raise ValueError(_("PowerSGDState: matrix_approximation_rank must be an int >= 1, "
                               "got {rank}", rank=repr(matrix_approximation_rank)))
        if (use_error_feedback or warm_start) and start_powerSGD_iter <= 1:
            raise ValueError(_("PowerSGDState: start_powerSGD_iter must be > 1 with error "
                               "feedback or warm start (the first step's buckets are not final "
                               "yet)"))
        self.process_group, self.dist = process_group, dist
        self.matrix_approximation_rank = matrix_approximation_rank
        self.start_powerSGD_iter = start_powerSGD_iter
        self.min_compression_rate = min_compression_rate
        self.use_error_feedback, self.warm_start = use_error_feedback, warm_start
        self.orthogonalization_epsilon = orthogonalization_epsilon
        self.rng = np.random.RandomState(random_seed)
        self.iter = 0
        self.errors: dict[int, torch.Tensor] = {}
        self.qs: dict[int, list[torch.Tensor]] = {}

    def count_step(self, bucket: Any) -> None:
        """One more training step once the step's last bucket has been reduced."""
        if bucket.is_last():
            self.iter += 1

    def qs_for(self, index: int, matrices: list[torch.Tensor], ranks: list[int],
               dtype: torch.dtype) -> list[torch.Tensor]:
        """Bucket `index`'s Qs, orthogonalized: last step's (warm start) or new random ones,
        drawn from the same seeded generator, in the same order, as torch's hook draws them."""
        if self.warm_start and index in self.qs:
            qs = self.qs[index]
        else:
            # A private CPU generator (torch's hook draws on the CPU too, then moves Q): seeding
            # the global one would also reseed the training's CUDA generators.
            g = torch.Generator(device="cpu").manual_seed(self.rng.randint(1_000_000_000))
            qs = [torch.randn(1, m.shape[2], r, dtype=dtype, generator=g, device="cpu"
                              ).to(m.device) for m, r in zip(matrices, ranks)]
            if self.warm_start:
                self.qs[index] = qs
        for q in qs:
            orthogonalize_(q, self.orthogonalization_epsilon)
        return qs


def split_compressible(state: PowerSGDState, grads: list[torch.Tensor]
                       ) -> tuple[list[torch.Tensor], list[int], list[torch.Tensor]]:
    """(matrices to compress as (1, n, m) views, their ranks, the tensors sent as they are)."""
    compress, ranks, plain = [], [], []
    for g in grads:
        m = g.view(g.shape[0], -1) if g.dim() > 0 else g.view(1, 1)
        n, cols = m.shape
        r = min(n, cols, state.matrix_approximation_rank)
        if (n + cols) * r * state.min_compression_rate < n * cols:
            if state.matrix_approximation_rank > min(n, cols):
                raise ValueError(_("powerSGD_hook: matrix_approximation_rank {rank} is larger "
                                   "than a {n}x{cols} gradient it would compress",
                                   rank=state.matrix_approximation_rank, n=n, cols=cols))
            compress.append(m.unsqueeze(0))
            ranks.append(r)
        else:
            plain.append(g)
    # Matrices of one shape together, in order of first appearance, as torch's hook draws its
    # random Qs: the same random values give the same steps.
    shapes = list(dict.fromkeys(m.shape for m in compress))
    order = sorted(range(len(compress)), key=lambda i: shapes.index(compress[i].shape))
    return [compress[i] for i in order], [ranks[i] for i in order], plain


def hook_bytes(hook: Callable, shapes: list[tuple[int, ...]], world_size: int, *,
               element_size: int = 4, ratio: float = 0.01, rank: int = 1,
               min_compression_rate: float = 2) -> int:
    """The payload bytes a hook (known by its name) puts into collectives for one bucket of
    gradients of these shapes: what a counting `dist` must see (the model the tests compare
    against)."""
    numel = sum(int(np.prod(s)) for s in shapes)
    name = getattr(hook, "__name__", "")
    if name in ("fp16_compress_hook", "bf16_compress_hook"):
        return 2 * numel
    if name == "topk_hook":
        return world_size * max(1, int(ratio * numel)) * (4 + element_size)
    if name == "powerSGD_hook":
        total = 0
        for s in shapes:
            n = s[0] if s else 1
            cols = int(np.prod(s[1:])) if len(s) > 1 else 1
            r = min(n, cols, rank)
            compressed = (n + cols) * r * min_compression_rate < n * cols
            total += (n + cols) * r if compressed else n * cols
        return total * element_size
    return numel * element_size
