"""Distributed checks on the first 2, 3 and 4 ranks of the grader's 4-rank cluster.

One cluster serves every world size: `on_first_ranks(k, ...)` makes a group of the first k
ranks and hands the learner's code a counting `dist` bound to it, so `get_world_size()` says k
and every collective is counted (a non-power of two catches algorithms that only work on
powers of two; the counts catch the right answer reached with the wrong communication).
Learner code that calls the module `course_lib.dist` itself (lessons 01-02) is narrowed and
counted by patching that module for the duration of a block instead.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Callable, Iterator

import torch

from course_lib.counting import CountingDist
from course_lib.course.grading import Exercise, register
from course_lib.backend import default_dist
from course_lib import dist

SUB_WORLDS = (2, 3, 4)


def on_first_ranks(k: int, body: Callable, fn: Callable, *args: Any) -> Any:
    """Run `body(dist, rank, fn, *args)` on global ranks 0..k-1 as a world of k ranks (a
    `LateDist` bound to that sub-group); the other ranks only take part in creating the group."""
    real = default_dist()
    group = real.new_group(list(range(k)))  # every rank must create it, members or not
    if real.get_rank() >= k:
        return None
    counting = LateDist(real, group=group)
    return body(counting, counting.get_rank(), fn, *args)


def harness(body: Callable, *leading: Any) -> Callable:
    """A check's harness for cases (RANK, WORLD_SIZE, k, *args): `body(dist, rank, fn,
    *leading, *args)` on the first k ranks (`on_first_ranks`); `leading` is e.g. which of a
    class's methods the learner's `fn` replaces."""
    def run(fn: Callable, rank: int, world_size: int, k: int, *args: Any) -> Any:
        return on_first_ranks(k, body, fn, *leading, *args)
    return run


def counted_passes(dist: Any, forward: Callable[[], Any], weights: torch.Tensor,
                   describe: Callable[[dict, dict], str]) -> dict:
    """Run `forward()`, then backward of the loss `(output * weights).sum()`, counting each
    pass's collectives on the counting `dist`: {"comm": describe(forward's, backward's),
    "out": the output}. An output of the wrong shape still runs backward (with a zero loss), so
    a table row shows the output and the collectives rather than a shape error."""
    dist.reset()
    y = forward()
    ahead = dict(dist.calls)
    dist.reset()
    if isinstance(y, torch.Tensor) and y.shape == weights.shape:
        (y * weights).sum().backward()
    elif isinstance(y, torch.Tensor) and y.requires_grad:
        (y * 0).sum().backward()
    return {"comm": describe(ahead, dict(dist.calls)),
            "out": y.detach() if isinstance(y, torch.Tensor) else y}


def register_on_sub_worlds(name: str, notebook: str, **fields: Any) -> None:
    """An exercise whose cases run on sub-worlds of the grader's 4-rank scratch cluster."""
    register(Exercise(name=name, notebook=notebook, distributed=True, world_size=4, **fields))


P2P = {"send": "sent", "isend": "sent", "recv": "received", "irecv": "received"}
# Each case of a check talks in tags of its own: a message a case leaves behind can never be
# received by the next one (it stays that case's fault, named by `strays`).
CASE_TAGS, CASE_SPAN, CASES = 2 ** 30, 2 ** 16, 2 ** 14
_case: dict = {"serial": 0, "links": None}


def begin_case(serial: int) -> None:
    """Engine side, before a case's call on every rank: its tag space, and an empty record of
    who sent what to whom."""
    _case["serial"], _case["links"] = serial % CASES, None


def case_links() -> dict | None:
    """This rank's messages in the case so far, as plain lists: {"sent": [[dst, tag, n]],
    "received": [[src, tag, n]]} by global rank and the tag the learner's code used; None
    when it sent and received nothing through `counting_messages`."""
    links = _case["links"]
    if links is None:
        return None
    return {kind: [[peer, tag, n] for (peer, tag), n in sorted(links[kind].items())]
            for kind in ("sent", "received")}


def _case_tag(tag: int) -> int:
    """The wire tag of a learner's tag inside this case (tags past the case span stay shared)."""
    return CASE_TAGS + _case["serial"] * CASE_SPAN + tag if 0 <= tag < CASE_SPAN else tag


@contextmanager
def counting_messages() -> Iterator[dict]:
    """Count calls of course_lib.dist's send/isend/recv/irecv made inside the block, and the
    elements sent: for learner code that calls the module `dist` itself, not a given `dist=`.
    Messages travel in the current case's own tags, and each is noted per peer and tag."""
    counts = {"sent": 0, "received": 0, "elements sent": 0}
    saved = {name: getattr(dist, name) for name in P2P}
    if _case["links"] is None:
        _case["links"] = {"sent": {}, "received": {}}
    links = _case["links"]

    def counted(name):
        kind = P2P[name]
        params = ("dst" if kind == "sent" else "src", "group", "tag")

        def call(tensor, *args, **kwargs):
            counts[kind] += 1
            if kind == "sent":
                counts["elements sent"] += tensor.numel()
            bound = dict(zip(params, args), **kwargs)  # torch's names, as the learner may
            peer, tag = bound.get(params[0]), bound.get("tag", 0)
            if isinstance(peer, int) and isinstance(tag, int):
                links[kind][(peer, tag)] = links[kind].get((peer, tag), 0) + 1
                bound["tag"] = _case_tag(tag)
            return saved[name](tensor, **bound)
        return call

    for name in P2P:
        setattr(dist, name, counted(name))
    try:
        yield counts
    finally:
        for name, fn in saved.items():
            setattr(dist, name, fn)


LIBRARY = ("all_reduce", "broadcast", "reduce", "reduce_scatter", "all_gather", "scatter",
           "gather", "barrier", "all_to_all", "all_to_all_single")


@contextmanager
def first_ranks_as_world(k: int) -> Iterator[None]:
    """Inside the block, course_lib.dist's world is global ranks 0..k-1: get_world_size()
    says k (their ranks and send/recv peers are the same numbers), and the library's
    collectives, which would wait for the ranks left out, raise instead."""
    saved = {name: getattr(dist, name) for name in ("get_world_size", *LIBRARY)}

    def refuse(name):
        def call(*args, **kwargs):
            raise RuntimeError(f"dist.{name} is the library's; build this one from send/recv")
        return call

    dist.get_world_size = lambda group=None: k if group is None else saved["get_world_size"](group)
    for name in LIBRARY:
        setattr(dist, name, refuse(name))
    try:
        yield
    finally:
        for name, fn in saved.items():
            setattr(dist, name, fn)


class LateDist(CountingDist):
    """A counting dist whose async all_reduce and reduce_scatter write their output only in
    `wait()`, as a real one may: code that reads the result before waiting is caught every
    time. `log` lists each collective as (name, numel of its output, async_op)."""

    def __init__(self, dist: Any, group: Any = None):
        super().__init__(dist, group)
        self.log: list[tuple[str, int, bool]] = []

    def reset(self) -> None:
        super().reset()
        self.log.clear()

    def all_reduce(self, tensor, *args, async_op=False, **kwargs):
        self.log.append(("all_reduce", tensor.numel(), async_op))
        if not async_op:
            return super().all_reduce(tensor, *args, **kwargs)
        landed = tensor.clone()
        super().all_reduce(landed, *args, **kwargs)
        return _Landing(tensor, landed)

    def reduce_scatter(self, output, input_list, *args, async_op=False, **kwargs):
        self.log.append(("reduce_scatter", output.numel(), async_op))
        if not async_op:
            return super().reduce_scatter(output, input_list, *args, **kwargs)
        landed = torch.empty_like(output)
        super().reduce_scatter(landed, input_list, *args, **kwargs)
        return _Landing(output, landed)


class _Landing:
    """The work of a LateDist collective: the result lands when it is waited for."""

    def __init__(self, output: torch.Tensor, landed: torch.Tensor):
        self.output, self.landed, self.done = output, landed, False

    def wait(self, timeout: Any = None) -> bool:
        if not self.done:
            self.output.copy_(self.landed)
            self.done = True
        return True

    def is_completed(self) -> bool:
        return self.done

    def get_future(self) -> torch.futures.Future:
        """Lands the result now and returns a completed future of [output] (torch's value)."""
        self.wait()
        future = torch.futures.Future()
        future.set_result([self.output])
        return future
