"""A `dist`-like wrapper that counts the communication a component does, and can narrow the world.

    counting = CountingDist(default_dist())
    model = DistributedDataParallel(net, dist=counting)
    ...; counting.calls["all_reduce"], counting.sent_bytes()

Tests and graders use it to check that a component communicates the way it should (one
reduce_scatter and one all_gather per bucket, not an all_reduce per parameter), and, with
`group=`, to run a component on the first k ranks of a bigger world as if they were the world
(how one 4-engine cluster checks an exercise on 2, 3 and 4 ranks).
"""

from __future__ import annotations

from collections import Counter
from typing import Any, Sequence

import torch

def _nbytes(tensors: Any) -> int:
    if isinstance(tensors, torch.Tensor):
        return tensors.numel() * tensors.element_size()
    if isinstance(tensors, (list, tuple)):
        return sum(_nbytes(t) for t in tensors)
    return 0


def ring_sent_bytes(name: str, payload: int, world_size: int) -> float:
    """Bytes one rank sends for a collective of `payload` bytes (the full tensor's size) with
    the bandwidth-optimal ring algorithms: the alpha-beta model's beta term."""
    p = world_size
    if p == 1:
        return 0.0
    if name == "all_reduce":
        return 2 * (p - 1) / p * payload
    if name in ("reduce_scatter", "all_gather"):
        return (p - 1) / p * payload
    if name in ("broadcast", "reduce", "send", "isend"):
        return float(payload)
    return 0.0


def _a2a_sent(rows: int, nbytes: int, input_split_sizes: Any, world_size: int,
              rank: int) -> int:
    """Bytes all_to_all_single sends to other ranks: every block but the rank's own."""
    splits = list(input_split_sizes) if input_split_sizes else [rows // world_size] * world_size
    row_bytes = nbytes // rows if rows else 0
    return sum(n for j, n in enumerate(splits) if j != rank) * row_bytes


class CountingDist:
    """Forwards to a `dist` module, counting each call and its payload bytes per operation.

    With `group` (a sub-group this process belongs to), `group=None` in every call means that
    group: `get_rank()` and `get_world_size()` answer for it, and src/dst ranks given as
    global ranks stay global ranks, as in torch. Point-to-point calls are counted too.
    """

    def __init__(self, dist: Any, group: Any = None):
        self.dist, self.group = dist, group
        self.calls: Counter = Counter()
        self.payload: Counter = Counter()  # bytes of the full tensor each collective is about
        self.exact: Counter = Counter()  # bytes really sent to other ranks (all_to_all's)

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self.dist, name)
        if name == "shared_zeros":  # a collective allocation: on this wrapper's group too
            return lambda *args, group=None, **kwargs: attr(*args, group=self._group(group),
                                                            **kwargs)
        return attr

    def reset(self) -> None:
        self.calls.clear()
        self.payload.clear()
        self.exact.clear()

    def _group(self, group: Any) -> Any:
        return self.group if group is None else group

    def get_rank(self, group: Any = None) -> int:
        return self.dist.get_rank(self._group(group))

    def get_world_size(self, group: Any = None) -> int:
        return self.dist.get_world_size(self._group(group))

    def get_global_rank(self, group: Any, group_rank: int) -> int:
        group = self._group(group)
        return group_rank if group is None else self.dist.get_global_rank(group, group_rank)

    def _call(self, name: str, payload: int, args: Sequence, kwargs: dict) -> Any:
        self.calls[name] += 1
        self.payload[name] += payload
        kwargs["group"] = self._group(kwargs.get("group"))
        return getattr(self.dist, name)(*args, **kwargs)

    def all_reduce(self, tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        return self._call("all_reduce", _nbytes(tensor), (tensor, *args), kwargs)

    def broadcast(self, tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        return self._call("broadcast", _nbytes(tensor), (tensor, *args), kwargs)

    def reduce(self, tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        return self._call("reduce", _nbytes(tensor), (tensor, *args), kwargs)

    def reduce_scatter(self, output: torch.Tensor, input_list: list[torch.Tensor], *args: Any,
                       **kwargs: Any) -> Any:
        return self._call("reduce_scatter", _nbytes(input_list), (output, input_list, *args),
                          kwargs)

    def all_gather(self, tensor_list: list[torch.Tensor], tensor: torch.Tensor, *args: Any,
                   **kwargs: Any) -> Any:
        return self._call("all_gather", _nbytes(tensor_list), (tensor_list, tensor, *args),
                          kwargs)

    def gather(self, tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        return self._call("gather", _nbytes(tensor), (tensor, *args), kwargs)

    def scatter(self, tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        return self._call("scatter", _nbytes(tensor), (tensor, *args), kwargs)

    def send(self, tensor: torch.Tensor, dst: int, *args: Any, **kwargs: Any) -> Any:
        return self._call("send", _nbytes(tensor), (tensor, dst, *args), kwargs)

    def isend(self, tensor: torch.Tensor, dst: int, *args: Any, **kwargs: Any) -> Any:
        return self._call("isend", _nbytes(tensor), (tensor, dst, *args), kwargs)

    def recv(self, tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        return self._call("recv", _nbytes(tensor), (tensor, *args), kwargs)

    def irecv(self, tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        return self._call("irecv", _nbytes(tensor), (tensor, *args), kwargs)

    def barrier(self, *args: Any, **kwargs: Any) -> Any:
        return self._call("barrier", 0, args, kwargs)

    def all_to_all_single(self, output: torch.Tensor, input: torch.Tensor,
                          output_split_sizes: list[int] | None = None,
                          input_split_sizes: list[int] | None = None,
                          *args: Any, **kwargs: Any) -> Any:
        """Counted by the bytes it really sends: uneven splits are counted, not modelled."""
        self.exact["all_to_all_single"] += _a2a_sent(
            input.shape[0] if input.dim() else 1, _nbytes(input), input_split_sizes,
            self.get_world_size(kwargs.get("group")), self.get_rank(kwargs.get("group")))
        return self._call("all_to_all_single", _nbytes(input),
                          (output, input, output_split_sizes, input_split_sizes, *args), kwargs)

    def all_to_all(self, output_tensor_list: list[torch.Tensor],
                   input_tensor_list: list[torch.Tensor], *args: Any, **kwargs: Any) -> Any:
        rank = self.get_rank(kwargs.get("group"))
        self.exact["all_to_all"] += sum(_nbytes(t) for j, t in enumerate(input_tensor_list)
                                        if j != rank)
        return self._call("all_to_all", _nbytes(input_tensor_list),
                          (output_tensor_list, input_tensor_list, *args), kwargs)

    def sent_bytes(self) -> float:
        """Bytes this rank sent for the counted collectives, by the ring model (linear in the
        payload, so the sum over calls is the model of the summed payload)."""
        world = self.get_world_size()
        return (sum(ring_sent_bytes(name, self.payload[name], world) for name in self.calls)
                + sum(self.exact.values()))  # all_to_all's, as sent
