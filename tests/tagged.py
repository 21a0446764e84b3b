"""Finding the processes a test started through a child it does not own (a grader's kernels,
their children): the test gives them an environment variable, and looks for it."""

from __future__ import annotations

import psutil


def tagged_processes(tag: str, value: str) -> list[psutil.Process]:
    """Live processes (zombies left out: their parent reaps them) whose environment sets `tag`
    to `value`: a run's own, not those of the same test on another worker."""
    found = []
    for p in psutil.process_iter():
        try:
            if p.environ().get(tag) == value and p.status() != psutil.STATUS_ZOMBIE:
                found.append(p)
        except psutil.Error:
            pass
    return found
