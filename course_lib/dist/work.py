"""`Work`: an operation in flight, what `isend`, `irecv` and `async_op=True` return.

`wait()` blocks until the operation is done, bounded by its deadline, and raises its error, or
a `DistTimeoutError` naming this rank, the operation and the peer. The event a waiter sleeps on
is made only when someone has to wait, so most operations never allocate one. `get_future()`
gives the torch Future that communication hooks chain on, as torch's Work does.
"""

from __future__ import annotations

import threading
import time
from datetime import timedelta
from typing import NamedTuple, Sequence

import torch

from course_lib.dist.errors import DistTimeoutError, describe
from course_lib.i18n import _

# Taken last, for an instant, by whoever finishes or waits on a Work: it never nests the
# other way around, so it cannot take part in a deadlock (see the lock order in peer.py).
_EVENT_LOCK = threading.Lock()


def seconds(timeout: float | timedelta) -> float:
    """A timeout given as seconds or as a timedelta (torch's convention), in seconds."""
    return timeout.total_seconds() if isinstance(timeout, timedelta) else float(timeout)


class What(NamedTuple):
    """What an operation is, for its error messages: 'rank 1: all_reduce(ring) recv from
    rank 0 failed: ...' (direction "" and peer_rank None for a whole collective)."""

    rank: int
    name: str
    direction: str = ""
    peer_rank: int | None = None


class Work:
    """An operation in flight; `wait()` blocks until it is done, bounded by its deadline."""

    def __init__(self, deadline: float, what: What, result: Sequence[torch.Tensor] = ()):
        self.deadline, self.started, self.what = deadline, time.monotonic(), what
        self.result = list(result)  # the tensors the operation writes: its future's value
        self._done = False
        self._event: threading.Event | None = None
        self._future: torch.futures.Future | None = None
        self._error: BaseException | None = None

    def finish(self, error: BaseException | None = None) -> None:
        """Mark the operation done (with `error` if it failed) and wake its waiter."""
        self._error = error
        with _EVENT_LOCK:
            self._done, event, future = True, self._event, self._future
        if event is not None:
            event.set()
        if future is not None:
            self._complete(future)

    def get_future(self) -> torch.futures.Future:
        """A torch Future whose value is the list of tensors this operation writes, set when it
        finishes (its error if it fails). Callbacks chained with `then` run on the thread that
        finishes the operation (the group's worker for async collectives): they may compute
        and start further async work, but must not wait on this group's work."""
        with _EVENT_LOCK:
            fresh = self._future is None
            if fresh:
                self._future = torch.futures.Future()
            future, done = self._future, self._done
        if fresh and done:  # finish() ran before the future existed: complete it here
            self._complete(future)
        return future

    def _complete(self, future: torch.futures.Future) -> None:
        if self._error is not None:
            future.set_exception(self._error)
        else:
            future.set_result(self.result)

    def timeout_error(self) -> DistTimeoutError:
        rank, name, direction, peer_rank = self.what
        reason = _("timed out after {seconds}s", seconds=f"{time.monotonic() - self.started:.1f}")
        message = (describe(rank, name, direction, peer_rank, reason) if peer_rank is not None
                   else _("rank {rank}: {name} failed: {reason}", rank=rank, name=name,
                          reason=reason))
        return DistTimeoutError(message, rank=rank, peer_rank=peer_rank, operation=name)

    def is_completed(self) -> bool:
        return self._done

    def exception(self) -> BaseException | None:
        return self._error

    def wait(self, timeout: float | timedelta | None = None) -> bool:
        """Block until done; raise the operation's error, or DistTimeoutError on expiry."""
        deadline = self.deadline if timeout is None else time.monotonic() + seconds(timeout)
        with _EVENT_LOCK:
            if not self._done and self._event is None:
                self._event = threading.Event()
            event = None if self._done else self._event
        if event is not None and not event.wait(max(0.0, deadline - time.monotonic())):
            raise self.timeout_error()
        if self._error is not None:
            raise self._error
        return True
