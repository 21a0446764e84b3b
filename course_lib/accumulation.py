"""Gradient accumulation: a large batch as k micro-batches, communicating once per step."""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Sequence

import torch
from torch import nn


def accumulation_step(model: nn.Module, optimizer: torch.optim.Optimizer,
                      loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
                      micro_batches: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> float:
    """One optimizer step over equal-sized micro-batches; returns the loss of the whole batch.

    `loss_fn` averages over its micro-batch, so dividing each loss by k makes the accumulated
    gradient the mean over the whole batch. A DDP `model` syncs only on the last micro-batch.
    """
    k = len(micro_batches)
    if k == 0:
        raise ValueError("accumulation_step needs at least one micro-batch")
    sizes = {len(x) for x, _ in micro_batches}
    if len(sizes) != 1:
        raise ValueError(f"micro-batches must have equal sizes for 1/k scaling, got {sizes}")
    total = 0.0
    for i, (x, y) in enumerate(micro_batches):
        last = i == k - 1
        skip_sync = model.no_sync() if hasattr(model, "no_sync") and not last else None
        with skip_sync or contextlib.nullcontext():
            loss = loss_fn(model(x), y) / k
            loss.backward()
        total += loss.item()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return total


def saved_activation_bytes(model: nn.Module, *inputs: Any) -> int:
    """Bytes autograd keeps for backward during one forward of `model`: the memory a bigger
    batch costs, and what micro-batches save. Parameters (saved by reference) are not counted."""
    params = {p.data_ptr() for p in model.parameters()}
    seen: set[int] = set()
    total = 0

    def pack(t: torch.Tensor) -> torch.Tensor:
        nonlocal total
        ptr = t.untyped_storage().data_ptr()
        if ptr not in params and ptr not in seen:
            seen.add(ptr)
            total += t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(*inputs)
    return total
