"""Tag matching: which posted receive a message arriving from one peer fills.

MPI's rule, per peer: a message goes to the oldest receive posted with its tag; a message
nobody has asked for yet waits (unexpected) until a receive with its tag is posted. Not
thread-safe by itself: the receiver calls it with its lock held.
"""

from __future__ import annotations

import time
from collections import deque
from datetime import timedelta
from typing import Callable

import torch

from course_lib.dist.work import What, Work, seconds
from course_lib.i18n import _

POSTED, FILLING, DONE = range(3)


class RecvRequest(Work):
    """A posted receive: where the bytes go, and the tag they must carry.

    `buffer` is the target itself when it is contiguous, else a contiguous stand-in copied
    into the target when the message is complete. With `combine`, the message is not copied
    but combined into the (contiguous) target piece by piece, `combine(target_piece,
    message_piece)`: a reduction straight from shared memory, without a temporary.
    """

    def __init__(self, target: torch.Tensor, tag: int, what: What, deadline: float,
                 progress: Callable[["RecvRequest", float], None],
                 combine: Callable[[torch.Tensor, torch.Tensor], None] | None = None):
        super().__init__(deadline, what)
        if combine is not None and not target.is_contiguous():
            raise ValueError(_("a combining receive needs a contiguous target"))
        self.target, self.tag, self.combine = target, tag, combine
        self.buffer = target if target.is_contiguous() else torch.empty_like(
            target, memory_format=torch.contiguous_format)
        self.state = POSTED
        self._progress = progress  # reads the socket until this request is done

    def complete(self, error: BaseException | None = None) -> None:
        if error is None and self.buffer is not self.target:
            self.target.copy_(self.buffer)
        self.state = DONE
        self.finish(error)

    def wait(self, timeout: float | timedelta | None = None) -> bool:
        deadline = self.deadline if timeout is None else time.monotonic() + seconds(timeout)
        self._progress(self, deadline)
        return True


class TagMatcher:
    """Posted receives and unexpected messages of one peer, both in arrival order per tag."""

    def __init__(self) -> None:
        self._posted: dict[int, deque[RecvRequest]] = {}
        self._unexpected: dict[int, deque[torch.Tensor]] = {}

    def post(self, req: RecvRequest) -> torch.Tensor | None:
        """Register `req`; returns the message already waiting for its tag (then `req` is not
        registered: the caller completes it with that message)."""
        waiting = self._unexpected.get(req.tag)
        if waiting:
            msg = waiting.popleft()
            if not waiting:
                del self._unexpected[req.tag]
            return msg
        self._posted.setdefault(req.tag, deque()).append(req)
        return None

    def holds(self, tag: int) -> bool:
        """Whether a receive is posted for `tag` or a message for it is waiting."""
        return tag in self._posted or tag in self._unexpected

    def pop(self, tag: int) -> RecvRequest | None:
        """The oldest receive posted for `tag`, taken off the list (None if there is none)."""
        queue = self._posted.get(tag)
        if not queue:
            return None
        req = queue.popleft()
        if not queue:
            del self._posted[tag]
        return req

    def keep(self, tag: int, msg: torch.Tensor) -> None:
        """Hold a message that arrived before any receive for its tag."""
        self._unexpected.setdefault(tag, deque()).append(msg)

    def withdraw(self, req: RecvRequest) -> None:
        """Take a still-posted receive off the list (it timed out)."""
        queue = self._posted[req.tag]
        queue.remove(req)
        if not queue:
            del self._posted[req.tag]

    def drain(self) -> list[RecvRequest]:
        """Every posted receive, taken off the lists (the link died: they all fail)."""
        reqs = [req for queue in self._posted.values() for req in queue]
        self._posted.clear()
        return reqs
