"""A condition variable that counts who waits on it, so waking nobody costs nothing.

A link's reader and writer release their flag after every message, and almost always nobody
is waiting for it; `threading.Condition.notify_all` is Python code that would run each time.
"""

from __future__ import annotations

import threading


class CountedCondition(threading.Condition):
    """`threading.Condition` whose `wake()` notifies only when a thread is waiting."""

    def __init__(self, lock: threading.Lock):
        super().__init__(lock)
        self.waiters = 0  # changed only with the lock held

    def wait(self, timeout: float | None = None) -> bool:
        self.waiters += 1
        try:
            return super().wait(timeout)
        finally:
            self.waiters -= 1

    def wake(self) -> None:
        """notify_all, for a caller holding the lock, if anyone waits."""
        if self.waiters:
            self.notify_all()
