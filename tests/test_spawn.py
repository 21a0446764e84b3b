"""course_lib.spawn ends its ranks by PID on every path, here the one where its caller is
terminated: the caller's SIGTERM unwinds spawn, which ends the ranks and removes its files, and
the caller still ends by SIGTERM."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from course_lib.processes import end_processes, record, running

ROOT = Path(__file__).resolve().parent.parent
CALLER = """
import os, sys, time
from course_lib.spawn import spawn

def sleeper(rank, world, outdir):
    path = os.path.join(outdir, f"rank{rank}.pid")
    with open(path + ".tmp", "w") as f:
        f.write(str(os.getpid()))
    os.replace(path + ".tmp", path)  # whole or absent
    time.sleep(300)

if __name__ == "__main__":
    spawn(sleeper, 2, sys.argv[1], timeout=600)
"""


def test_a_terminated_caller_ends_its_ranks_and_removes_their_files(tmp_path, short_tmp):
    scratch = short_tmp  # the callers' TMPDIR: the forkserver's Unix socket lives in it
    (tmp_path / "caller.py").write_text(CALLER)
    env = dict(os.environ, TMPDIR=str(scratch), PYTHONPATH=str(ROOT))
    caller = subprocess.Popen([sys.executable, str(tmp_path / "caller.py"), str(tmp_path)],
                              env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    pid_files = [tmp_path / f"rank{r}.pid" for r in range(2)]
    try:
        deadline = time.monotonic() + 90
        while not all(p.exists() for p in pid_files):
            assert caller.poll() is None, caller.stderr.read().decode()
            assert time.monotonic() < deadline, "the ranks did not start within 90 s"
            time.sleep(0.1)
        ranks = [int(p.read_text()) for p in pid_files]
        started = [entry for pid in ranks for entry in record(pid)]
        assert len(list(scratch.glob("course-spawn-*"))) == 1  # the ranks' fault files
        caller.send_signal(signal.SIGTERM)
        assert caller.wait(timeout=30) == -signal.SIGTERM
    finally:
        if caller.poll() is None:  # failed before the signal: end the caller and its ranks
            end_processes(record(caller.pid))
    deadline = time.monotonic() + 10
    while any(running(pid) for pid in ranks) and time.monotonic() < deadline:
        time.sleep(0.1)
    left = [pid for pid in ranks if running(pid)]
    end_processes(started, reap=False)  # whatever the outcome, none outlives the test
    assert left == [], "ranks still running 10 s after their caller was terminated"
    assert list(scratch.glob("course-spawn-*")) == []  # removed by spawn, before its caller ended


QUICK = """
import sys
from course_lib.spawn import spawn

def rank_of(rank, world):
    return rank

if __name__ == "__main__":
    try:
        spawn(rank_of, 2, timeout=60)
    except OSError as exc:
        print(exc)
        sys.exit(3)
"""


def test_a_temporary_folder_too_long_for_the_ranks_socket_is_named(tmp_path, short_tmp):
    """The forkserver listens on a Unix socket in TMPDIR (a path of at most 107 bytes): too
    long a TMPDIR is an error that names it, with nothing left behind."""
    deep = short_tmp / ("d" * 90)
    deep.mkdir()
    (tmp_path / "quick.py").write_text(QUICK)
    done = subprocess.run([sys.executable, str(tmp_path / "quick.py")], timeout=120,
                          env=dict(os.environ, TMPDIR=str(deep), PYTHONPATH=str(ROOT)),
                          capture_output=True, text=True)
    assert done.returncode == 3, done.stdout + done.stderr
    assert str(deep) in done.stdout and "set TMPDIR to a shorter folder" in done.stdout
    assert list(deep.glob("course-spawn-*")) == []


def test_a_kernel_that_used_spawn_shuts_down_at_once(tmp_path, short_tmp):
    """ipykernel SIGTERMs its children at shutdown, and multiprocessing's resource tracker
    ignores SIGTERM: without spawn's hook the kernel outlives jupyter_client's 5 s wait and is
    killed, its fork server's folder left in the kernel's TMPDIR."""
    from jupyter_client.manager import KernelManager

    scratch = short_tmp  # the kernel's TMPDIR
    km = KernelManager(kernel_name="python3", connection_file=str(tmp_path / "kernel.json"))
    km.start_kernel(env=dict(os.environ, TMPDIR=str(scratch), PYTHONPATH=str(ROOT)))
    try:
        kc = km.client()
        kc.start_channels()
        kc.wait_for_ready(timeout=60)
        reply = kc.execute_interactive("import operator\nfrom course_lib.spawn import spawn\n"
                                       "assert spawn(operator.add, 2) == [2, 3]", timeout=120)
        kc.stop_channels()
        assert reply["content"]["status"] == "ok", reply["content"]
        assert list(scratch.glob("pymp-*")), "the fork server did not start in the kernel"
        kernel = km.provisioner.process
        km.request_shutdown()
        deadline = time.monotonic() + 4  # jupyter_client waits 5 s before it kills
        while kernel.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        code, leftovers = kernel.poll(), list(scratch.glob("pymp-*"))
    finally:
        km.shutdown_kernel(now=True)
    assert code == 0, "the kernel did not exit by itself within 4 s of its shutdown request"
    assert leftovers == [], leftovers
