"""Data parallelism: every rank holds the whole model, sees its own batch, and averages gradients.

Built in the lesson's steps: one all_reduce per parameter, one flat buffer, buckets, and finally
`DistributedDataParallel`, which reduces each bucket from autograd hooks while backward goes on.
"""

from __future__ import annotations

import contextlib
import time
from typing import Any, Iterator, Sequence

import torch
from torch import nn

from course_lib.data import default_dist

MiB = 1024 * 1024


def src_rank(dist: Any, group: Any = None) -> int:
    """The global rank of the group's first member (broadcasts take global ranks, as in torch)."""
    if group is None:
        return 0
    if hasattr(dist, "get_global_rank"):
        return dist.get_global_rank(group, 0)
    return list(group.ranks)[0]


def grads_of(params: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Each parameter's gradient, with zeros for one that got none (so every rank sends the same)."""
    return [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]


def flatten_into(flat: torch.Tensor, tensors: Sequence[torch.Tensor]) -> None:
    """Copy `tensors` one after another into the 1-D buffer `flat`."""
    offset = 0
    for t in tensors:
        flat[offset:offset + t.numel()].copy_(t.reshape(-1))
        offset += t.numel()


def unflatten_to_grads(flat: torch.Tensor, params: Sequence[torch.Tensor]) -> None:
    """Copy slices of `flat` back into each parameter's `.grad`."""
    offset = 0
    for p in params:
        chunk = flat[offset:offset + p.numel()].view_as(p)
        if p.grad is None:
            p.grad = chunk.clone()
        else:
            p.grad.copy_(chunk)
        offset += p.numel()


def broadcast_coalesced(tensors: Sequence[torch.Tensor], src: int, *, dist: Any,
                        group: Any = None) -> None:
    """Broadcast `tensors` from `src` in one message per dtype, in place."""
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for t in tensors:
        by_dtype.setdefault(t.dtype, []).append(t)
    with torch.no_grad():
        for dtype, group_tensors in by_dtype.items():
            flat = torch.empty(sum(t.numel() for t in group_tensors), dtype=dtype)
            flatten_into(flat, group_tensors)
            dist.broadcast(flat, src, group=group)
            offset = 0
            for t in group_tensors:
                t.copy_(flat[offset:offset + t.numel()].view_as(t))
                offset += t.numel()


# Step 1-3 of the lesson: synchronize after backward, without overlap.

def allreduce_grads_per_param(params: Sequence[torch.Tensor], *, dist: Any = None,
                              group: Any = None) -> None:
    """Average gradients with one blocking all_reduce per parameter (many small messages)."""
    dist = default_dist(dist)
    world = dist.get_world_size(group)
    for p, g in zip(params, grads_of(params)):
        dist.all_reduce(g, group=group)
        p.grad = g.div_(world)


def allreduce_grads_flat(params: Sequence[torch.Tensor], *, dist: Any = None,
                         group: Any = None) -> None:
    """Average gradients with a single all_reduce of one flat buffer (one large message)."""
    dist = default_dist(dist)
    grads = grads_of(params)
    flat = torch.empty(sum(g.numel() for g in grads), dtype=grads[0].dtype)
    flatten_into(flat, grads)
    dist.all_reduce(flat, group=group)
    unflatten_to_grads(flat.div_(dist.get_world_size(group)), params)


def make_buckets(params: Sequence[torch.Tensor], bucket_cap_mb: float = 25.0,
                 first_bucket_cap_mb: float | None = 1.0) -> list[list[torch.Tensor]]:
    """Group parameters into buckets in reverse registration order (the order backward
    produces gradients); a bucket closes once it holds at least its cap, or at a dtype change."""
    if bucket_cap_mb <= 0:
        raise ValueError(f"bucket_cap_mb must be positive, got {bucket_cap_mb}")
    cap = (first_bucket_cap_mb if first_bucket_cap_mb is not None else bucket_cap_mb) * MiB
    buckets: list[list[torch.Tensor]] = []
    current: list[torch.Tensor] = []
    size = 0
    for p in reversed(list(params)):
        if current and p.dtype != current[0].dtype:
            buckets.append(current)
            current, size = [], 0
        current.append(p)
        size += p.numel() * p.element_size()
        if size >= cap:
            buckets.append(current)
            current, size, cap = [], 0, bucket_cap_mb * MiB
    if current:
        buckets.append(current)
    return buckets


def allreduce_grads_bucketed(params: Sequence[torch.Tensor], bucket_cap_mb: float = 25.0, *,
                             dist: Any = None, group: Any = None) -> None:
    """Average gradients bucket by bucket, after backward (medium messages, still no overlap)."""
    for bucket in make_buckets(params, bucket_cap_mb, first_bucket_cap_mb=None):
        allreduce_grads_flat(bucket, dist=dist, group=group)


# Step 4: DistributedDataParallel, buckets reduced from autograd hooks during backward.

def buckets_to_launch(next_bucket: int, complete: Sequence[bool]) -> list[int]:
    """The buckets that may start now: the run of complete buckets from `next_bucket` on.
    Launching strictly in bucket order makes every rank issue the same collectives in order."""
    end = next_bucket
    while end < len(complete) and complete[end]:
        end += 1
    return list(range(next_bucket, end))


class _Bucket:
    """Parameters whose gradients travel together in one flat buffer and one all_reduce."""

    def __init__(self, params: list[torch.Tensor], with_flags: bool):
        self.params = params
        self.numel = sum(p.numel() for p in params)
        # With find_unused_parameters, one slot per parameter counts the ranks that used it.
        self.flat = torch.zeros(self.numel + (len(params) if with_flags else 0),
                                dtype=params[0].dtype)
        self.ready: set[int] = set()
        self.work: Any = None
        self.launched_at = 0.0


class DistributedDataParallel(nn.Module):
    """Wraps `module` so that `loss.backward()` leaves the gradients averaged over all ranks.

    Parameters and buffers are broadcast from the group's first rank at construction; buffers
    again before each synchronized forward (`broadcast_buffers`, like torch). Gradients are
    averaged in buckets of about `bucket_cap_mb` MiB, each launched asynchronously from an
    autograd hook as soon as its last gradient is accumulated, in the same order on every rank,
    and all are waited for when backward ends, so the optimizer step sees averaged gradients.
    """

    def __init__(self, module: nn.Module, *, bucket_cap_mb: float = 25.0,
                 first_bucket_cap_mb: float | None = 1.0, broadcast_buffers: bool = True,
                 find_unused_parameters: bool = False, group: Any = None,
                 dist: Any = None) -> None:
        super().__init__()
        self.module = module
        self.dist = default_dist(dist)
        self.group = group
        self.world_size = self.dist.get_world_size(group)
        self.src = src_rank(self.dist, group)
        self.broadcast_buffers = broadcast_buffers
        self.find_unused_parameters = find_unused_parameters
        self.require_backward_grad_sync = True
        self._sync_buffers_next_forward = True
        named = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
        if not named:
            raise ValueError("DistributedDataParallel: the module has no parameter that "
                             "requires grad")
        self._names = {id(p): n for n, p in named}
        self._buffers_to_sync = [b for b in module.buffers()]
        self.buckets = [_Bucket(b, find_unused_parameters)
                        for b in make_buckets([p for _, p in named], bucket_cap_mb,
                                              first_bucket_cap_mb)]
        self._bucket_of = {id(p): i for i, b in enumerate(self.buckets) for p in b.params}
        self._check_same_layout()
        broadcast_coalesced([p.detach() for p in module.parameters()] + self._buffers_to_sync,
                            self.src, dist=self.dist, group=group)
        self._expect_hooks = False
        self._in_backward = False
        self._next_bucket = 0
        self.timeline: list[tuple[str, float, float]] = []
        self._handles = [p.register_post_accumulate_grad_hook(self._on_grad_ready)
                         for _, p in named]

    def _check_same_layout(self) -> None:
        """Fail on every rank, not hang, if ranks would reduce different buckets."""
        sizes = [p.numel() for b in self.buckets for p in b.params]
        sig = torch.tensor([len(self.buckets), len(sizes), sum(sizes),
                            sum((i + 1) * n for i, n in enumerate(sizes)),
                            sum((i + 1) * b.numel for i, b in enumerate(self.buckets))],
                           dtype=torch.float64)
        theirs = sig.clone()
        self.dist.broadcast(theirs, self.src, group=self.group)
        bad = torch.tensor([0.0 if torch.equal(sig, theirs) else 1.0], dtype=torch.float64)
        self.dist.all_reduce(bad, group=self.group)
        if bad.item() > 0:
            raise RuntimeError(
                f"DistributedDataParallel: rank {self.dist.get_rank()} found {int(bad.item())} "
                "rank(s) whose parameters (count, shapes or bucket layout) differ from the "
                "first rank's; every rank must wrap the same model with the same bucket_cap_mb")

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if self._in_backward:
            raise RuntimeError("DistributedDataParallel: the previous backward did not finish "
                               "its gradient reduction (did it raise?); rebuild the wrapper")
        start = time.perf_counter()
        if self._sync_buffers_next_forward and self.broadcast_buffers and self._buffers_to_sync:
            broadcast_coalesced(self._buffers_to_sync, self.src, dist=self.dist, group=self.group)
        self._expect_hooks = torch.is_grad_enabled() and self.require_backward_grad_sync
        self._sync_buffers_next_forward = self._expect_hooks
        if self._expect_hooks:
            self.timeline = []
        out = self.module(*args, **kwargs)
        if self._expect_hooks:
            self.timeline.append(("forward", start, time.perf_counter()))
        return out

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backward passes of forwards run inside this block only accumulate local gradients."""
        previous = self.require_backward_grad_sync
        self.require_backward_grad_sync = False
        try:
            yield
        finally:
            self.require_backward_grad_sync = previous

    def _on_grad_ready(self, p: torch.Tensor) -> None:
        if not self._expect_hooks:
            return
        if not self._in_backward:
            self._in_backward = True
            self._next_bucket = 0
            for b in self.buckets:
                b.ready.clear()
            self._backward_start = time.perf_counter()
            torch.autograd.Variable._execution_engine.queue_callback(self._finish)
        bucket = self.buckets[self._bucket_of[id(p)]]
        if id(p) in bucket.ready:
            raise RuntimeError(f"DistributedDataParallel: parameter {self._names[id(p)]!r} got "
                               "its gradient twice in one backward (reentrant backward or "
                               "checkpointing is not supported)")
        bucket.ready.add(id(p))
        complete = [len(b.ready) == len(b.params) for b in self.buckets]
        for i in buckets_to_launch(self._next_bucket, complete):
            self._launch(self.buckets[i])
            self._next_bucket = i + 1

    def _launch(self, bucket: _Bucket) -> None:
        with torch.no_grad():
            flatten_into(bucket.flat, grads_of(bucket.params))
            bucket.flat[:bucket.numel].div_(self.world_size)
            if self.find_unused_parameters:
                bucket.flat[bucket.numel:] = torch.tensor(
                    [1.0 if id(p) in bucket.ready else 0.0 for p in bucket.params])
        bucket.launched_at = time.perf_counter()
        bucket.work = self.dist.all_reduce(bucket.flat, group=self.group, async_op=True)

    def _finish(self) -> None:
        """End of backward: launch what is left, wait for every bucket, write the averages."""
        end_of_backward = time.perf_counter()
        self.timeline.append(("backward", self._backward_start, end_of_backward))
        try:
            missing = [self._names[id(p)] for b in self.buckets[self._next_bucket:]
                       for p in b.params if id(p) not in b.ready]
            if missing and not self.find_unused_parameters:
                raise RuntimeError(
                    f"DistributedDataParallel: rank {self.dist.get_rank()}: parameters "
                    f"{missing} got no gradient in this backward; pass "
                    "find_unused_parameters=True if the model skips them on purpose")
            for b in self.buckets[self._next_bucket:]:
                self._launch(b)
            self._next_bucket = len(self.buckets)
            for i, b in enumerate(self.buckets):
                b.work.wait()
                self.timeline.append((f"bucket {i}", b.launched_at, time.perf_counter()))
                self._write_back(b)
            self.timeline.append(("wait", end_of_backward, time.perf_counter()))
        finally:
            self._in_backward = False

    def _write_back(self, bucket: _Bucket) -> None:
        with torch.no_grad():
            if not self.find_unused_parameters:
                unflatten_to_grads(bucket.flat, bucket.params)
                return
            users = bucket.flat[bucket.numel:]
            offset = 0
            for p, n_users in zip(bucket.params, users.tolist()):
                chunk = bucket.flat[offset:offset + p.numel()]
                offset += p.numel()
                if n_users > 0:  # unused on every rank: leave .grad as it was, as torch does
                    unflatten_to_grads(chunk, [p])

    def exposed_comm_seconds(self) -> float:
        """How long the last synchronized backward waited for communication after it ended."""
        return sum(end - start for name, start, end in self.timeline if name == "wait")
