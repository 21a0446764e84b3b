"""Ending processes by PID: TERM, then KILL after the grace; a recycled PID is never signalled;
a ProcessSet notes descendants as well."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import psutil
import pytest

from course_lib.processes import ProcessSet, end_processes, record, running

SLEEP = [sys.executable, "-c", "import time; time.sleep(60)"]
STUBBORN = [sys.executable, "-c",
            "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
            "print('ready', flush=True); time.sleep(60)"]


def test_term_then_kill_and_report_the_killed():
    polite = subprocess.Popen(SLEEP)
    stubborn = subprocess.Popen(STUBBORN, stdout=subprocess.PIPE, text=True)
    assert stubborn.stdout.readline().strip() == "ready"  # its SIGTERM handler is in place
    start = time.monotonic()
    killed = end_processes(record(polite.pid) + record(stubborn.pid), grace=0.5)
    assert killed == [stubborn.pid]  # the polite one ended on TERM
    assert time.monotonic() - start < 5
    assert polite.wait(5) is not None and stubborn.wait(5) is not None


def test_a_recycled_pid_is_left_alone():
    proc = subprocess.Popen(SLEEP)
    try:
        pid, created = record(proc.pid)[0]
        assert end_processes([(pid, created - 1.0)], grace=0.2) == []  # another process's pid
        assert running(pid)
    finally:
        end_processes(record(proc.pid))
        proc.wait(5)
    assert not running(pid)


def test_process_set_notes_descendants_and_ends_them():
    parent = subprocess.Popen([sys.executable, "-c",
                               "import subprocess, sys, time; "
                               f"subprocess.Popen({SLEEP!r}); print('ready', flush=True); "
                               "time.sleep(60)"], stdout=subprocess.PIPE, text=True)
    assert parent.stdout.readline().strip() == "ready"
    procs = ProcessSet()
    procs.add(parent.pid)
    pids = [pid for pid, _ in procs]
    assert len(pids) == 2 and pids[0] == parent.pid
    procs.end(grace=1.0)
    parent.wait(5)
    assert not any(running(pid) for pid in pids) and list(procs) == []


def test_a_child_is_reaped_and_anothers_zombie_is_not_waited_for():
    """Our own child ends reaped (no zombie left); a process whose parent never reaps it (as
    init does not in some containers) counts as ended at once, not after the grace."""
    child = subprocess.Popen(SLEEP)
    end_processes(record(child.pid), grace=2.0)
    with pytest.raises(ChildProcessError):  # reaped already: no zombie left behind
        os.waitpid(child.pid, os.WNOHANG)
    child.returncode = -15  # Popen must not wait for it again
    # A parent that never reaps its child: the child exits at once and stays a zombie.
    parent = subprocess.Popen([sys.executable, "-c",
                               "import subprocess, sys, time; "
                               "p = subprocess.Popen([sys.executable, '-c', 'import time; "
                               "time.sleep(0.5)']); print(p.pid, flush=True); time.sleep(60)"],
                              stdout=subprocess.PIPE, text=True)
    try:
        grandchild = int(parent.stdout.readline())
        noted = record(grandchild)
        while psutil.Process(grandchild).status() != psutil.STATUS_ZOMBIE:
            time.sleep(0.05)
        start = time.monotonic()
        assert end_processes(noted, grace=3.0) == []
        assert time.monotonic() - start < 1.0
    finally:
        end_processes(record(parent.pid), grace=1.0)
        parent.wait(5)
