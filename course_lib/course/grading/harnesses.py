"""Pieces the checks of more than one lesson build their harnesses from: a seeded batch, and a
library class (DDP, ZeRO) with the learner's function in place of one of its own, logging each
bucket launch. Run on the engines, so no reference lives here."""

from __future__ import annotations

import torch


def seeded_batch(seed: int, size: int, n_in: int, n_out: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(inputs, targets): `size` rows of float64 noise, the same for every rank given `seed`."""
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(size, n_in, generator=g, dtype=torch.float64),
            torch.randn(size, n_out, generator=g, dtype=torch.float64))


def graded_class(base: type, which: str, fn, *, count_ready: bool = False) -> type:
    """`base` (the library's DistributedDataParallel or ZeroRedundancyOptimizer) with the
    learner's `fn` as `which` ("launch_bucket": start_all_reduce, "on_grad_ready": grad_ready,
    otherwise finish), logging every bucket launch in `launches` as (bucket index, when): when
    is "after backward", else the gradients ready so far (`count_ready`) or "from a hook"."""

    class Graded(base):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.launches, self.ready_so_far, self.ending = [], 0, False

        if count_ready:
            def _hook(self, p):
                if not self.in_backward:
                    self.ready_so_far = 0
                self.ready_so_far += 1
                super()._hook(p)

        def launch(self, bucket):
            if self.ending:
                when = "after backward"
            else:
                when = self.ready_so_far if count_ready else "from a hook"
            self.launches.append((self.buckets.index(bucket), when))
            super().launch(bucket)

        def end_of_backward(self):
            self.ending = True
            try:
                super().end_of_backward()
            finally:
                self.ending = False

        if which == "launch_bucket":
            def start_all_reduce(self, bucket):
                return fn(self, bucket)
        elif which == "on_grad_ready":
            def grad_ready(self, p):
                fn(self, p)
        else:
            def finish(self):
                fn(self)

    return Graded
