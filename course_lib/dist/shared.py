"""`shared_zeros`: a buffer every rank of a group allocates together, in shared memory when
they all share this machine (`symmetric`), so that all_reduce reads the peers' copies in place
(lesson 10). The allocation is a collective: every rank's part is announced by an all_gather."""

from __future__ import annotations

import operator
import weakref

import torch

from course_lib.dist.collectives import all_gather
from course_lib.dist.group import ProcessGroup, resolve
from course_lib.dist.symmetric import allocate
from course_lib.dist.wire import DTYPE_CODE
from course_lib.i18n import _


def shared_zeros(size: int, *, dtype: torch.dtype = torch.float32,
                 group: ProcessGroup | None = None) -> torch.Tensor:
    """A 1-D tensor of `size` zeros that every rank of `group` allocates in the same call,
    in shared memory when all of them are on this machine (an ordinary tensor otherwise, on
    every rank alike); all_reduce(algorithm="auto") on it then reads the peers' copies in
    place. Collective: every rank must pass the same size and dtype."""
    g = resolve(group, "shared_zeros")
    if isinstance(size, bool) or not hasattr(size, "__index__"):
        raise TypeError(_("shared_zeros: size is a number of elements (the buffer is 1-D), "
                          "got {size!r}", size=size))
    size = operator.index(size)
    if size < 0 or dtype not in DTYPE_CODE:
        raise ValueError(_("shared_zeros: needs a size >= 0 and a dtype of the wire's, got "
                           "{size} and {dtype}", size=size, dtype=dtype))
    buf = allocate(g, size, dtype, "shared_zeros", lambda t: _all_gather(g, t))
    if buf is None:
        return torch.zeros(size, dtype=dtype)
    tensor = buf.data[g.rank].view(size)  # another object: when the caller drops it, we forget
    g.shared[tensor.data_ptr()] = buf
    weakref.finalize(tensor, g.shared.pop, tensor.data_ptr(), None)
    return tensor


def _all_gather(g: ProcessGroup, t: torch.Tensor) -> list[torch.Tensor]:
    out = [torch.empty_like(t) for _ in range(g.size)]
    all_gather(out, t, group=g)
    return out
