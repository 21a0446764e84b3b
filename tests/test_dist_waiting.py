"""CountedCondition (course_lib/dist/waiting.py): `wake` reaches every waiter, and the count
of waiters is right after waits that end by notification, by timeout and by wait_for."""

from __future__ import annotations

import threading
import time

from course_lib.dist.waiting import CountedCondition


def test_wake_reaches_waiters_and_the_count_follows_them():
    lock = threading.Lock()
    cond = CountedCondition(lock)
    flag = {"go": False}
    woke = []

    def waiter():
        with lock:
            woke.append(cond.wait_for(lambda: flag["go"], timeout=5))

    threads = [threading.Thread(target=waiter) for _ in range(3)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 5
    while cond.waiters < 3 and time.monotonic() < deadline:
        time.sleep(0.001)
    with lock:
        assert cond.waiters == 3
        flag["go"] = True
        cond.wake()
    for t in threads:
        t.join(5)
    assert woke == [True] * 3 and cond.waiters == 0
    with lock:
        assert cond.wait(0.01) is False  # a timed-out wait leaves no count behind
        assert cond.waiters == 0
        cond.wake()  # nobody waits: nothing to do, and no error
