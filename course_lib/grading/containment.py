"""Keeping a submission's kernel in bounds: resource limits, escaped processes found again,
and a ledger of the run's token so that a grader killed outright leaves nothing running after
its next start.

A kernel gets an address-space and a file-size limit (inherited by everything it starts), so
exhausting memory or writing a huge file fails inside the submission. The grader makes itself
a child subreaper (Linux), so a process that double-forks away from the kernel is re-parented
to the grader, which notes and ends it with the kernel. The run's token, in every kernel's
environment, is on disk in the grades folder before the first kernel starts; a later
`course-grade` ends every process that still carries that token (a child started just before
the grader was killed included), and nothing else: the ledger names no process.
"""

from __future__ import annotations

import ctypes
import json
import os
import resource
import secrets
from pathlib import Path
from typing import Callable

import psutil

from course_lib.processes import end_processes

PR_SET_CHILD_SUBREAPER = 36
TOKEN_ENV = "COURSE_GRADE_RUN"  # in every kernel's environment: which run started it
LEDGER = ".course-grade-pids.json"


def limits(memory_bytes: int, file_bytes: int) -> Callable[[], None]:
    """A `preexec_fn` setting a kernel's address-space and file-size limits (no core files)."""
    def apply() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (memory_bytes, memory_bytes))
        resource.setrlimit(resource.RLIMIT_FSIZE, (file_bytes, file_bytes))
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    return apply


def adopt_orphans() -> bool:
    """Make this process a child subreaper (Linux only; False elsewhere)."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def adopted_since(created: float) -> list[psutil.Process]:
    """This process's children started at or after `created` (the kernel, orphans adopted)."""
    found = []
    for child in psutil.Process().children():
        try:
            if child.create_time() >= created:
                found.append(child)
        except psutil.Error:
            pass
    return found


class Ledger:
    """One grading run's token, on disk in the grades folder while the run lasts."""

    def __init__(self, folder: Path):
        self.path = Path(folder) / LEDGER
        self.token = secrets.token_hex(16)

    def write(self) -> None:
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps({"token": self.token}))
        os.replace(tmp, self.path)

    def clear(self) -> None:
        self.path.unlink(missing_ok=True)

    def end_leftovers(self) -> list[int]:
        """End every process that still runs with an earlier run's token; returns the PIDs."""
        try:
            token = str(json.loads(self.path.read_text())["token"])
        except (OSError, ValueError, KeyError, TypeError):
            return []
        ours = []
        for process in psutil.process_iter() if token else ():
            try:
                if process.environ().get(TOKEN_ENV) == token:
                    ours.append((process.pid, process.create_time()))
            except psutil.Error:
                pass
        end_processes(ours, grace=2.0, reap=False)
        self.clear()
        return [pid for pid, _ in ours]
