"""Keeping a submission's kernel in bounds: a PID namespace of its own, resource limits,
escaped processes found again, and a ledger of the run's token so that a grader killed outright
leaves nothing running after its next start.

Where Linux allows it (root, or unprivileged user namespaces), the kernel runs as the first
process of a PID namespace of its own, with its own /proc: a run's kernels are forked from its
own zygote (`kernel_session.kernel_zygote`: torch imported once, no course_lib module), whose
child enters the namespace as `unshare --pid --fork --kill-child --mount-proc` would
(`zygote_server._enter_namespace`). Everything the submission starts, double-forked daemons
that ignore or answer signals included, lives in that namespace; when the kernel ends, or its
keeper outside the namespace does (at once when the grader is gone, even killed outright), the
Linux kernel kills every process in it. No process of a submission can outlive its grading.
Elsewhere the weaker means below are all there is, and `course-grade` says so.

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
import functools
import json
import os
import secrets
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import psutil

from course_lib.processes import end_processes

PR_SET_CHILD_SUBREAPER = 36
NAMESPACE = ("--pid", "--fork", "--kill-child", "--mount-proc")
AS_USER = ("--user", "--map-root-user")  # unprivileged: a user namespace first
SUBMISSION_ENV = "COURSE_GRADE_SUBMISSION"  # in every process of one submission
TOKEN_ENV = "COURSE_GRADE_RUN"  # in every kernel's environment: which run started it
LEDGER = ".course-grade-pids.json"
SCRATCH_PREFIX = "course-grade-"  # a run's scratch folder, in the temporary folder


def rlimits(memory_bytes: int, file_bytes: int) -> dict[str, int]:
    """A kernel's resource limits by `resource` name (the zygote sets each, soft and hard):
    address space, file size, and no core files."""
    return {"RLIMIT_AS": memory_bytes, "RLIMIT_FSIZE": file_bytes, "RLIMIT_CORE": 0}


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
    """One grading run's token and scratch folder (its submissions' work folders), on disk in
    the grades folder while the run lasts: a run killed outright is cleaned up by the next."""

    def __init__(self, folder: Path):
        self.path = Path(folder) / LEDGER
        self.token = secrets.token_hex(16)
        self.scratch: Path | None = None

    def write(self) -> None:
        self.scratch = self.scratch or Path(tempfile.mkdtemp(prefix=SCRATCH_PREFIX))
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps({"token": self.token, "scratch": str(self.scratch)}))
        os.replace(tmp, self.path)

    def clear(self) -> None:
        self._remove(None if self.scratch is None else str(self.scratch))

    def _remove(self, scratch: object) -> None:
        """Remove the ledger and the scratch folder it recorded (`_remove_scratch`)."""
        _remove_scratch(scratch)
        self.path.unlink(missing_ok=True)

    def end_leftovers(self) -> list[int]:
        """End every process that still runs with an earlier run's token, and remove its
        scratch folder; returns the PIDs."""
        try:
            earlier = json.loads(self.path.read_text())
            token = str(earlier["token"])
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
        self._remove(earlier.get("scratch"))
        return [pid for pid, _ in ours]


def _remove_scratch(recorded: object) -> None:
    """Remove an earlier run's scratch folder: only one of ours (a course-grade folder of
    this user in the temporary folder), whatever the ledger, which a submission could have
    rewritten, says."""
    if not isinstance(recorded, str):
        return
    folder = Path(recorded)
    try:
        ours = (folder.parent == Path(tempfile.gettempdir())
                and folder.name.startswith(SCRATCH_PREFIX) and not folder.is_symlink()
                and folder.is_dir() and folder.stat().st_uid == os.getuid())
    except OSError:
        return
    if ours:
        shutil.rmtree(folder, ignore_errors=True)


@functools.lru_cache(maxsize=1)
def namespace_command() -> tuple[str, ...] | None:
    """The command prefix that runs a program as the first process of a new PID namespace
    (with its own /proc), or None where this machine allows none."""
    unshare = shutil.which("unshare")
    if unshare is None or not sys.platform.startswith("linux"):
        return None
    for extra in ((), AS_USER):
        command = (unshare, *extra, *NAMESPACE)
        try:
            if subprocess.run([*command, "true"], capture_output=True, timeout=10).returncode == 0:
                return command
        except (OSError, subprocess.TimeoutExpired):
            continue
    return None


def marked(token: str, key: str = SUBMISSION_ENV) -> list[psutil.Process]:
    """Every process whose environment carries `key` = `token` (one submission's processes)."""
    found = []
    for process in psutil.process_iter():
        try:
            if process.pid != os.getpid() and process.environ().get(key) == token:
                found.append(process)
        except psutil.Error:
            pass
    return found


def end_marked(token: str, key: str = SUBMISSION_ENV, grace: float = 2.0) -> list[int]:
    """End every process that carries the submission's token; returns their PIDs."""
    found = [(p.pid, p.create_time()) for p in marked(token, key) if _alive(p)]
    end_processes(found, grace=grace, reap=True)
    return [pid for pid, _ in found]


def _alive(process: psutil.Process) -> bool:
    try:
        return process.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False
