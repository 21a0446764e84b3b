"""What every collective of `course_lib.dist` is written with (`collectives`, `rooted`):

- `_run`: a call's tag taken in call order, its flight-recorder entry, and the body run now or
  on the group's worker (`async_op=True`);
- `check_op`, `reduce_`, `reducer`: a `ReduceOp` applied in place (AVG sums; `_average` divides
  at the end), also straight into a receive's destination;
- `_flat`, `_write_back`: a tensor as one contiguous row, and back;
- `_wait`, `check_list`: waiting for sends, and checking a list of one tensor per rank;
- `check_host`: the refusal of a tensor that is not in host memory (this backend reads and
  writes tensors through their host addresses: a CUDA tensor would crash the process).
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch

from course_lib.dist.group import ProcessGroup, ReduceOp, resolve
from course_lib.dist.work import Work
from course_lib.i18n import _


def _run(group: ProcessGroup | None, name: str, async_op: bool,
         body: Callable[[ProcessGroup, int], None],
         tensor: torch.Tensor | None = None,
         result: Sequence[torch.Tensor] | None = None,
         algorithm: str | None = None) -> Work | None:
    """Run `body(group, tag)` now, or on the group's worker thread when `async_op`. The
    group's flight recorder notes the call, described by `tensor`'s dtype and shape; the
    Work's future holds `result` (default: `tensor`) when it is done."""
    check_host([tensor, *(result or ())], name)
    g = resolve(group, name)
    call = g.collective(name, tensor)  # its tag is taken in call order: every rank agrees
    call.entry.algorithm = algorithm
    if async_op:
        if result is None:
            result = [] if tensor is None else [tensor]
        return g.submit(lambda: call.run(body), name, result)
    call.run(body)
    return None


def check_host(tensors: Sequence[torch.Tensor | None], name: str) -> None:
    """TypeError, naming the device, for any tensor not in host (CPU) memory: the scratch
    backend moves bytes through host pointers, where a CUDA address segfaults or fails with
    EFAULT deep in a link. GPU tensors travel over NCCL (or gloo, which stages them)."""
    for t in tensors:
        if isinstance(t, torch.Tensor) and t.device.type != "cpu":
            raise TypeError(_("{name}: course_lib.dist moves host memory, and this tensor is "
                              "on {device}: pass CPU tensors (t.cpu(), then copy the result "
                              'back), or use torch.distributed with backend "nccl" or '
                              '"cpu:gloo,cuda:nccl" for GPU tensors', name=name,
                              device=t.device))


def check_op(op: object) -> ReduceOp:
    """Our ReduceOp, also accepting torch.distributed.ReduceOp.SUM etc. by name."""
    if isinstance(op, ReduceOp):
        return op
    name = str(op).rsplit(".", 1)[-1].upper()
    if name in ReduceOp.__members__:
        return ReduceOp[name]
    raise TypeError(_("op must be a course_lib.dist.ReduceOp, got {op!r}", op=op))


# In place, by op. Tensor methods themselves where they fit: this runs for every message a
# reduction receives. On bool, add_ is logical or and mul_ logical and (as in NCCL).
_REDUCERS = {ReduceOp.SUM: torch.Tensor.add_, ReduceOp.AVG: torch.Tensor.add_,  # AVG divides last
             ReduceOp.PRODUCT: torch.Tensor.mul_,
             ReduceOp.MAX: lambda acc, other: torch.maximum(acc, other, out=acc),
             ReduceOp.MIN: lambda acc, other: torch.minimum(acc, other, out=acc)}


def reduce_(acc: torch.Tensor, other: torch.Tensor, op: ReduceOp) -> None:
    """acc = acc (op) other, in place (AVG sums; the caller divides at the end)."""
    _REDUCERS[op](acc, other)


def _average(t: torch.Tensor, n: int, op: ReduceOp) -> None:
    """AVG's final division; integers round down (floor), as `sum // n` does."""
    if op is ReduceOp.AVG and n > 1:
        if t.is_floating_point() or t.is_complex():
            t.div_(n)
        else:
            t.copy_(torch.div(t, n, rounding_mode="floor"))


def reducer(op: ReduceOp) -> Callable[[torch.Tensor, torch.Tensor], None]:
    """`combine(dst, src)` for a receive that reduces into `dst` instead of copying."""
    return _REDUCERS[op]


def _flat(t: torch.Tensor) -> torch.Tensor:
    """A 1-D contiguous view of `t` (a copy only if `t` is not contiguous; see `_write_back`)."""
    flat = t.detach() if t.requires_grad else t  # in-place ops on a leaf that needs grad fail
    if not flat.is_contiguous():
        flat = flat.contiguous()
    return flat if flat.dim() == 1 else flat.view(-1)


def _write_back(t: torch.Tensor, flat: torch.Tensor) -> None:
    if flat is not t and (flat.data_ptr() != t.data_ptr() or not t.is_contiguous()):
        t.copy_(flat.view(t.shape))

def _wait(works: Sequence[Work]) -> None:
    for w in works:
        w.wait()


def check_list(tensors: Sequence[torch.Tensor] | None, like: torch.Tensor, p: int,
                what: str) -> None:
    if tensors is None or len(tensors) != p:
        raise ValueError(_("{what} must hold one tensor per rank of the group ({p})", what=what,
                           p=p))
    check_host(tensors, what)
    for t in tensors:
        if t.shape != like.shape or t.dtype != like.dtype:
            raise ValueError(_("{what}: every tensor must be {dtype} {shape}, got {got_dtype} "
                               "{got_shape}", what=what, dtype=like.dtype,
                               shape=list(like.shape), got_dtype=t.dtype,
                               got_shape=list(t.shape)))
