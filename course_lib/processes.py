"""Processes this project starts, ended by PID on every path, and the error for failed ranks.

`cluster` (engines, controller), `spawn` (one process per rank) and the batch grader (a kernel
and whatever it started) all end their processes with `end_processes`, and all report ranks
that failed with `RankError`. A PID is only ever signalled together with the creation time
it was recorded with, so a recycled PID is left alone; nothing is killed by name or pattern.
"""

from __future__ import annotations

import os
import signal
import subprocess
import threading
import time
from typing import Iterable, Iterator

import psutil

from course_lib.i18n import _

Recorded = tuple[int, float]  # (pid, create_time): picklable, and safe against PID reuse


class RankError(RuntimeError):
    """An operation failed on some ranks: `failures` maps rank -> what went wrong there;
    `signals` maps each rank whose process a signal ended to that signal's number."""

    def __init__(self, what: str, failures: dict[int, str], note: str = "",
                 signals: dict[int, int] | None = None):
        self.failures = dict(sorted(failures.items()))
        self.note = note
        self.signals = dict(signals or {})
        lines = [_("{what}: {n} rank(s) failed", what=what, n=len(self.failures))]
        lines += ["  " + _("rank {rank}: {message}", rank=r, message=msg)
                  for r, msg in self.failures.items()]
        if note:
            lines.append(note)
        super().__init__("\n".join(lines))


def record(proc: psutil.Process | int, *, descendants: bool = True) -> list[Recorded]:
    """`proc` (a PID or psutil.Process) and, by default, all its descendants, as (pid, created);
    empty for a process that is already gone."""
    try:
        p = proc if isinstance(proc, psutil.Process) else psutil.Process(proc)
        found = [p] + (p.children(recursive=True) if descendants else [])
    except psutil.Error:
        return []
    out = []
    for q in found:
        try:
            out.append((q.pid, q.create_time()))
        except psutil.Error:
            pass
    return out


class ProcessSet:
    """Every process one owner started, noted as it appears, ended together by `end()`."""

    def __init__(self) -> None:
        self.recorded: list[Recorded] = []
        self._lock = threading.Lock()  # a watcher thread may add while the owner ends

    def __iter__(self) -> Iterator[Recorded]:
        return iter(list(self.recorded))

    def add(self, proc: psutil.Process | int | None, *, descendants: bool = True) -> None:
        """Note `proc` (and its descendants while they still have it as parent)."""
        if proc is None:
            return
        found = record(proc, descendants=descendants)
        with self._lock:
            self.recorded += [entry for entry in found if entry not in self.recorded]

    def end(self, grace: float = 3.0) -> list[int]:
        """End every noted process (see `end_processes`) and forget them; returns the killed."""
        with self._lock:
            recorded, self.recorded = self.recorded, []
        return end_processes(recorded, grace)


def running(pid: int) -> bool:
    """True while `pid` runs; a zombie (exited, not yet reaped) has died."""
    try:
        return alive(psutil.Process(pid))
    except psutil.NoSuchProcess:
        return False


def end_processes(procs: Iterable[Recorded], grace: float = 3.0, *, reap: bool = True) -> list[int]:
    """TERM each (pid, created) that still runs, KILL what is left after `grace` seconds.

    Never signals this process or a recycled PID. With `reap=False` a zombie counts as ended
    and is left for its parent to reap (multiprocessing tracks its own children and must do
    it itself). Returns the PIDs that had to be killed.
    """
    alive = []
    for pid, created in procs:
        if pid == os.getpid():
            continue
        try:
            p = psutil.Process(pid)
            if p.create_time() == created:
                p.terminate()
                alive.append(p)
        except psutil.Error:
            pass
    still = _wait(alive, grace, reap)
    for p in still:
        try:
            p.kill()
        except psutil.Error:
            pass
    _wait(still, grace, reap)
    return [p.pid for p in still]


def _wait(procs: list[psutil.Process], timeout: float, reap: bool) -> list[psutil.Process]:
    """The processes still running after up to `timeout` seconds. A zombie has ended: this
    process reaps its own children (unless `reap` is False); another's zombie is for its parent
    to reap, or for init, which in some containers never does (waiting for it to vanish cost a
    whole `grace` per cluster stop there)."""
    deadline = time.monotonic() + timeout
    while (still := [p for p in procs if alive(p)]) and time.monotonic() < deadline:
        time.sleep(0.02)
    for p in procs if reap else []:
        try:
            if p not in still and p.status() == psutil.STATUS_ZOMBIE and p.ppid() == os.getpid():
                os.waitpid(p.pid, os.WNOHANG)
        except (psutil.Error, ChildProcessError):
            pass
    return still


def alive(p: psutil.Process) -> bool:
    """Whether `p` (the very process noted, not a recycled PID) runs and is not a zombie."""
    try:
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def run_session(cmd: list[str], timeout: float, what: str,
                env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """Run a launcher (mpiexec, torchrun) in its own session and return its output. The whole
    process group, the workers it started too, is ended by the group's id if it outlives
    `timeout` or on any exception (an interrupt too); a non-zero exit raises with the end of
    its stderr. `what` names it in those errors."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True, env={**os.environ, **(env or {})})
    try:
        out, err = proc.communicate(timeout=timeout)
    except BaseException as exc:
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # the group we created, by its id
        except ProcessLookupError:
            pass  # it had just ended by itself
        proc.communicate()
        if isinstance(exc, subprocess.TimeoutExpired):
            raise RuntimeError(_("{what} did not finish within {timeout:g}s", what=what,
                                 timeout=timeout)) from None
        raise
    if proc.returncode != 0:
        raise RuntimeError(_("{what} exited with {code}:\n{err}", what=what,
                             code=proc.returncode, err=err[-3000:]))
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)
