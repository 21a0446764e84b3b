"""Communication hooks for `DistributedDataParallel`: send less than the gradients, lose little.

    ddp.register_comm_hook(None, comm_hooks.fp16_compress_hook)
    ddp.register_comm_hook(comm_hooks.PowerSGDState(None, matrix_approximation_rank=2),
                           comm_hooks.powerSGD_hook)

Each hook has torch's signature, `hook(state, bucket) -> torch.futures.Future` whose value is
the averaged bucket; the bucket's buffer holds this rank's gradients, not yet divided by the
world size. `state` is a process group (or None for the world), or a state object whose
`process_group` and `dist` say where to communicate. fp16/bf16 halve the bytes; top-k sends
a fraction of the entries and keeps the rest as error feedback; PowerSGD sends a rank-r
factorization P Q^T of each gradient matrix, (n + m) r numbers instead of n m.
"""

from __future__ import annotations

from typing import Any, Callable

import numpy as np
import torch

from course_lib.backend import default_dist

__all__ = ["DefaultState", "allreduce_hook", "compress_hook", "fp16_compress_hook", "bf16_compress_hook",
           "compress_with_feedback", "TopKState", "topk_hook", "orthogonalize_", "PowerSGDState",
           "powersgd_step", "powerSGD_hook", "hook_bytes"]


class DefaultState:
    """Where a stateless hook communicates: `process_group` (None: the world) over `dist`."""

    def __init__(self, process_group: Any = None, *, dist: Any = None):
        self.process_group, self.dist = process_group, dist


def _where(state: Any) -> tuple[Any, Any, int]:
    """(dist, group, world size) for a hook's `state`: a state object, a group, or None."""
    if hasattr(state, "process_group"):
        dist, group = default_dist(getattr(state, "dist", None)), state.process_group
    else:
        dist, group = default_dist(None), state
    return dist, group, dist.get_world_size(group)


def _floating_buffer(bucket: Any, hook: str) -> torch.Tensor:
    buffer = bucket.buffer()
    if not buffer.is_floating_point():
        raise TypeError(f"{hook}: gradients must be floating point, got {buffer.dtype} "
                        f"(bucket {bucket.index()})")
    return buffer


def _done(value: Any) -> torch.futures.Future:
    future = torch.futures.Future()
    future.set_result(value)
    return future


def allreduce_hook(state: Any, bucket: Any) -> torch.futures.Future:
    """What DDP does without a hook: divide by the world size, all_reduce (torch's allreduce_hook)."""
    buffer = _floating_buffer(bucket, "allreduce_hook")
    dist, group, world = _where(state)
    buffer.div_(world)
    return dist.all_reduce(buffer, group=group, async_op=True).get_future().then(
        lambda fut: fut.value()[0])


def compress_hook(dtype: torch.dtype, state: Any, bucket: Any) -> torch.futures.Future:
    """All-reduce the bucket cast to `dtype`, averaged, and cast the result back into it."""
    buffer = _floating_buffer(bucket, f"{str(dtype)[6:]}_compress_hook")
    dist, group, world = _where(state)
    # Cast, then divide in the narrow type before the sum, exactly as torch's hook does: the
    # sum of p values near the type's maximum would overflow where the average does not.
    compressed = buffer.to(dtype).div_(world)

    def decompress(fut: torch.futures.Future) -> torch.Tensor:
        buffer.copy_(fut.value()[0])
        return buffer

    return dist.all_reduce(compressed, group=group, async_op=True).get_future().then(decompress)


def fp16_compress_hook(state: Any, bucket: Any) -> torch.futures.Future:
    """All-reduce the bucket in float16 (half the bytes), then cast back (torch's hook)."""
    return compress_hook(torch.float16, state, bucket)


def bf16_compress_hook(state: Any, bucket: Any) -> torch.futures.Future:
    """All-reduce the bucket in bfloat16: float32's range, 8 bits of mantissa."""
    return compress_hook(torch.bfloat16, state, bucket)


def compress_with_feedback(grad: torch.Tensor, error: torch.Tensor | None,
                           k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Top-k with error feedback: of `grad + error`, the k entries largest in magnitude are
    sent (indices, values); everything not sent is the residual, added to the next step's."""
    acc = grad if error is None else grad + error
    indices = acc.abs().topk(k, sorted=False).indices
    values = acc[indices]
    residual = acc.clone()
    residual[indices] = 0
    return indices, values, residual


class TopKState:
    """State of `topk_hook`: the fraction of entries sent, and each bucket's residual."""

    def __init__(self, process_group: Any = None, *, ratio: float = 0.01,
                 use_error_feedback: bool = True, dist: Any = None):
        if not 0 < ratio <= 1:
            raise ValueError(f"TopKState: ratio must be in (0, 1], got {ratio!r}")
        self.process_group, self.dist = process_group, dist
        self.ratio, self.use_error_feedback = ratio, use_error_feedback
        self.errors: dict[int, torch.Tensor] = {}


def topk_hook(state: TopKState, bucket: Any) -> torch.futures.Future:
    """Every rank sends its k largest entries (values and int32 indices, all_gather); each rank
    adds up everyone's and divides by the world size."""
    buffer = _floating_buffer(bucket, "topk_hook")
    dist, group, world = _where(state)
    k = max(1, int(state.ratio * buffer.numel()))
    error = state.errors.get(bucket.index()) if state.use_error_feedback else None
    indices, values, residual = compress_with_feedback(buffer, error, k)
    if state.use_error_feedback:
        state.errors[bucket.index()] = residual
    indices = indices.to(torch.int32)
    all_indices = [torch.empty_like(indices) for _ in range(world)]
    all_values = [torch.empty_like(values) for _ in range(world)]
    works = [dist.all_gather(all_indices, indices, group=group, async_op=True),
             dist.all_gather(all_values, values, group=group, async_op=True)]

    def decompress(_: torch.futures.Future) -> torch.Tensor:
        buffer.zero_()
        for idx, val in zip(all_indices, all_values):
            buffer.index_add_(0, idx.long(), val)
        return buffer.div_(world)

    return torch.futures.collect_all([w.get_future() for w in works]).then(decompress)


def orthogonalize_(matrices: torch.Tensor, epsilon: float = 0.0) -> None:
    """Gram-Schmidt on the columns of each matrix of a (batch, n, r) tensor, in place (torch's
    PowerSGD uses it up to rank 2 and QR above; so do we, to match it step for step)."""
    if matrices.shape[2] > 2 and matrices.dtype not in (torch.float16, torch.bfloat16):
        torch.linalg.qr(matrices, out=(matrices, torch.empty(
            matrices.shape[0], matrices.shape[2], matrices.shape[2], dtype=matrices.dtype)))
        return
    for i in range(matrices.shape[2]):
        col = matrices[:, :, i:i + 1]
        col /= torch.norm(col, dim=1, keepdim=True) + epsilon
        if i + 1 < matrices.shape[2]:
            rest = matrices[:, :, i + 1:]
            rest -= torch.sum(col * rest, dim=1, keepdim=True) * col


def powersgd_step(matrices: list[torch.Tensor], qs: list[torch.Tensor], *, dist: Any = None,
                  group: Any = None, epsilon: float = 0.0) -> None:
    """One power iteration over a bucket's (1, n, m) gradient matrices, each approximated by
    P Q^T with Q (1, m, r) given: P = M Q, summed over ranks in one all_reduce and
    orthogonalized; Q = M^T P, summed in one all_reduce and divided by the world size; each M
    becomes the average's approximation P Q^T. `qs` keep the new Q (PowerSGD's warm start)."""
    for m, q in zip(matrices, qs):
        if q.shape[2] > min(m.shape[1], m.shape[2]):
            raise ValueError(f"powersgd_step: rank {q.shape[2]} is larger than a "
                             f"{m.shape[1]}x{m.shape[2]} matrix")
    dist = default_dist(dist)
    ps = [torch.bmm(m, q) for m, q in zip(matrices, qs)]
    flat_p = torch.cat([p.reshape(-1) for p in ps])
    dist.all_reduce(flat_p, group=group)
    for p, new in zip(ps, flat_p.split([p.numel() for p in ps])):
        p.copy_(new.view_as(p))
        orthogonalize_(p, epsilon)
    for m, p, q in zip(matrices, ps, qs):
        torch.bmm(m.transpose(1, 2), p, out=q)
    flat_q = torch.cat([q.reshape(-1) for q in qs])
    dist.all_reduce(flat_q, group=group)
    flat_q.div_(dist.get_world_size(group))
    for m, p, q, new in zip(matrices, ps, qs, flat_q.split([q.numel() for q in qs])):
        q.copy_(new.view_as(q))
        torch.bmm(p, q.transpose(1, 2), out=m)


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
            raise ValueError("PowerSGDState: matrix_approximation_rank must be an int >= 1, "
                             f"got {matrix_approximation_rank!r}")
        if (use_error_feedback or warm_start) and start_powerSGD_iter <= 1:
            raise ValueError("PowerSGDState: start_powerSGD_iter must be > 1 with error feedback "
                             "or warm start (the first step's buckets are not final yet)")
        self.process_group, self.dist = process_group, dist
        self.matrix_approximation_rank = matrix_approximation_rank
        self.start_powerSGD_iter, self.min_compression_rate = start_powerSGD_iter, min_compression_rate
        self.use_error_feedback, self.warm_start = use_error_feedback, warm_start
        self.orthogonalization_epsilon = orthogonalization_epsilon
        self.rng = np.random.RandomState(random_seed)
        self.iter = 0
        self.errors: dict[int, torch.Tensor] = {}
        self.qs: dict[int, list[torch.Tensor]] = {}


def _split_compressible(state: PowerSGDState, grads: list[torch.Tensor]):
    """(matrices to compress as (1, n, m) views, their ranks, the tensors sent as they are)."""
    compress, ranks, plain = [], [], []
    for g in grads:
        m = g.view(g.shape[0], -1) if g.dim() > 0 else g.view(1, 1)
        n, cols = m.shape
        r = min(n, cols, state.matrix_approximation_rank)
        if (n + cols) * r * state.min_compression_rate < n * cols:
            if state.matrix_approximation_rank > min(n, cols):
                raise ValueError(f"powerSGD_hook: matrix_approximation_rank "
                                 f"{state.matrix_approximation_rank} is larger than a {n}x{cols} "
                                 "gradient it would compress")
            compress.append(m.unsqueeze(0))
            ranks.append(r)
        else:
            plain.append(g)
    # Matrices of one shape together, in order of first appearance, as torch's hook draws its
    # random Qs: the same draws give the same steps.
    shapes = list(dict.fromkeys(m.shape for m in compress))
    order = sorted(range(len(compress)), key=lambda i: shapes.index(compress[i].shape))
    return [compress[i] for i in order], [ranks[i] for i in order], plain


def powerSGD_hook(state: PowerSGDState, bucket: Any) -> torch.futures.Future:
    """PowerSGD (Vogels et al., 2019) as torch's `powerSGD_hook` computes it, step for step.

    Its two dependent all_reduces (P, then Q) run inside the hook, on the thread that runs
    backward: started from a future's callback they would run on the communication thread,
    in an order that can differ between ranks while other buckets are launched. The
    uncompressed tensors' all_reduce overlaps them."""
    buffer = _floating_buffer(bucket, "powerSGD_hook")
    dist, group, world = _where(state)
    if state.iter < state.start_powerSGD_iter:
        if bucket.is_last():
            state.iter += 1
        return allreduce_hook(state, bucket)
    index = bucket.index()
    if state.use_error_feedback:
        if index in state.errors:
            buffer.add_(state.errors[index])
        before = buffer.clone()
    matrices, ranks, plain = _split_compressible(state, bucket.gradients())
    plain_flat = torch.cat([t.reshape(-1) for t in plain]) if plain else buffer.new_empty(0)
    plain_work = dist.all_reduce(plain_flat, group=group, async_op=True)
    if not state.warm_start or index not in state.qs:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(state.rng.randint(1_000_000_000))
            state.qs[index] = [torch.randn(1, m.shape[2], r, dtype=buffer.dtype)
                               for m, r in zip(matrices, ranks)]
            for q in state.qs[index]:
                orthogonalize_(q, state.orthogonalization_epsilon)
    else:
        for q in state.qs[index]:
            orthogonalize_(q, state.orthogonalization_epsilon)
    if matrices:
        powersgd_step(matrices, state.qs[index], dist=dist, group=group,
                      epsilon=state.orthogonalization_epsilon)
    plain_work.wait()
    plain_flat.div_(world)
    for t, new in zip(plain, plain_flat.split([t.numel() for t in plain])):
        t.copy_(new.view_as(t))
    if state.use_error_feedback:
        state.errors[index] = before - buffer
    if not state.warm_start:
        state.qs.pop(index)
    if bucket.is_last():
        state.iter += 1
    return _done(buffer)


def hook_bytes(hook: Callable, shapes: list[tuple[int, ...]], world_size: int, *,
               element_size: int = 4, ratio: float = 0.01, rank: int = 1,
               min_compression_rate: float = 2) -> int:
    """The payload bytes a hook puts into collectives for one bucket of gradients of these
    shapes: what a counting `dist` must see (the model the tests compare against)."""
    numel = sum(int(np.prod(s)) for s in shapes)
    if hook in (fp16_compress_hook, bf16_compress_hook):
        return 2 * numel
    if hook is topk_hook:
        return world_size * max(1, int(ratio * numel)) * (4 + element_size)
    if hook is powerSGD_hook:
        total = 0
        for s in shapes:
            n = s[0] if s else 1
            cols = int(np.prod(s[1:])) if len(s) > 1 else 1
            r = min(n, cols, rank)
            compressed = (n + cols) * r * min_compression_rate < n * cols
            total += (n + cols) * r if compressed else n * cols
        return total * element_size
    return numel * element_size
