"""Local engines (and Jupyter kernels) forked from one process that has already imported torch,
ipyparallel and ipykernel.

An engine started from scratch imports torch again: about 3 s of CPU on a laptop, four engines
per cluster, a cluster in every lesson and a new one at every restart. The client starts one
zygote per process, the first time it needs local engines; each request is a JSON line on the
zygote's stdin (the engine's arguments, environment, folder and log file) and the reply is the
new engine's PID, a JSON line on its stdout. Nothing is unpickled. The zygote imports no
course_lib module (those read the environment, which each engine takes from its request) and
exits when its parent closes the pipe (the client exited, even by SIGKILL); the engines it
forks belong to the cluster that asked, which ends them by PID.

One zygote can also serve many processes (`start_shared`): it listens on a Unix socket in a
private folder, named to its clients by `SOCKET_ENV`, and serves any process of this user that
runs the same Python. `python3 course.py lab` starts one for the lab, and the test suite one per
worker: the kernels themselves are forked from it (`course_lib.course.kernels`), and their clusters'
engines, so neither imports torch again. A client whose shared zygote is gone or refuses starts
its own, as above. A forked process takes its environment, folder and PYTHONPATH from the
request, as a new process would; what the preloaded modules read at import (ipyparallel's
default folder, ipykernel's parent) is given again in its arguments.

Each engine's nanny (ipyparallel's process that relays signals to the engine and tells the
controller at once when it dies) is forked too, from the engine before it runs anything, and
handed its arguments as JSON when the engine asks for it: ipyparallel would start a fresh
Python for it, 0.7 s of CPU per engine.

The zygote's own side (its loops, and what a forked process runs to become an engine, a
controller or a kernel) is `zygote_server.py`, which this module runs as a script; its names are
importable from here too, where this module is imported as part of the package.
"""

from __future__ import annotations

import atexit
import json
import os
import select
import shutil
import socket
import subprocess
import sys

START_TIMEOUT = 60.0  # seconds for the zygote to import PRELOAD and answer its first request
SOCKET_ENV = "COURSE_ZYGOTE_SOCKET"  # a shared zygote's socket, for the processes it serves
SERVER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "zygote_server.py")

if __package__:  # course.py loads this file alone, by its path, where the server is not needed
    from course_lib.cluster.zygote_server import (NAMESPACES, PRELOAD, REQUEST_SECONDS, serve,
                                                  serve_shared)

_zygote: subprocess.Popen | None = None


def start_shared(python: str = sys.executable,
                 env: dict[str, str] | None = None) -> tuple[subprocess.Popen, str]:
    """Start a shared zygote owned by this process (it exits when this process does, or when its
    stdin is closed) under `python`; returns it and its socket, for `SOCKET_ENV` in the clients'
    environment. Standard library only, so that course.py can load this file before any
    dependency is installed."""
    proc = subprocess.Popen([str(python), SERVER, "--shared"],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env,
                            start_new_session=True, text=True)
    line = proc.stdout.readline()
    if not line:
        proc.wait(5)
        raise RuntimeError(f"the shared engine zygote exited at its start ({proc.returncode})")
    said = json.loads(line)
    if "error" in said:
        proc.wait(5)
        hint = ("; set TMPDIR to a shorter folder (a Unix socket's path may have 107 bytes on "
                "Linux, 103 on macOS)" if "path too long" in said["error"] else "")
        raise RuntimeError(f"the shared engine zygote {said['error']}{hint}")
    proc.socket = said["socket"]  # `end` removes its folder if the zygote could not
    return proc, proc.socket


def stop() -> None:
    """At the client's exit: end this process's own zygote."""
    global _zygote
    proc, _zygote = _zygote, None
    if proc is not None:
        end(proc)


def end(proc: subprocess.Popen) -> None:
    """Close a zygote's pipe (it exits), then end it by PID if it has not."""
    # Not at the top: course.py loads this file by path with the system's Python, which has
    # neither psutil nor the package.
    from course_lib.processes import end_processes, record

    try:
        proc.stdin.close()
        proc.wait(2.0)
    except (OSError, subprocess.TimeoutExpired):
        end_processes(record(proc.pid, descendants=False), grace=1.0)
    folder = os.path.dirname(getattr(proc, "socket", "") or "")
    if os.path.basename(folder).startswith("course-zygote-"):  # a shared one's, if it was killed
        shutil.rmtree(folder, ignore_errors=True)


def _started() -> subprocess.Popen:
    global _zygote
    if _zygote is None or _zygote.poll() is not None:
        # run as a script, not with -m: that would import course_lib.cluster (and read the
        # environment of the moment) into every engine
        _zygote = subprocess.Popen([sys.executable, SERVER],
                                   stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                   start_new_session=True, text=True)
    return _zygote


def request(argv: list[str], log: str | None, *, app: str = "engine",
            env: dict[str, str] | None = None, cwd: str | None = None,
            executable: str = sys.executable) -> dict:
    """What a zygote is asked to fork: `app` ("engine", "controller" or "kernel") with `argv`,
    `env` and `cwd` (this process's by default), its output appended to `log` (None: the
    zygote's stderr), for the Python `executable`."""
    return {"argv": argv, "env": dict(os.environ if env is None else env),
            "cwd": cwd or os.getcwd(), "log": log, "app": app, "executable": executable}


def fork(argv: list[str], log: str, timeout: float = START_TIMEOUT, *,
         app: str = "engine", env: dict[str, str] | None = None, cwd: str | None = None) -> int:
    """Fork an ipyparallel engine with `argv` (ipengine's arguments), or its controller (`app`
    "controller", ipcontroller's), with `env` and `cwd` (this process's by default), its output
    appended to `log`; from the shared zygote if there is one, else this process's own.
    Returns its PID."""
    from course_lib.i18n import _  # here, not at the top: course.py loads this file alone

    req = request(argv, log, app=app, env=env, cwd=cwd)
    pid = ask_shared(req, timeout)
    if pid is not None:
        return pid
    proc = _started()
    try:
        proc.stdin.write(json.dumps(req) + "\n")
        proc.stdin.flush()
    except OSError as exc:
        raise RuntimeError(_("the engine zygote (pid {pid}) is gone: {exc}", pid=proc.pid,
                             exc=exc)) from None
    ready = select.select([proc.stdout], [], [], timeout)[0]
    line = proc.stdout.readline() if ready else ""
    if not line:
        stop()
        raise RuntimeError(_("the engine zygote (pid {pid}) did not fork an engine within "
                             "{timeout:g}s", pid=proc.pid, timeout=timeout))
    return int(json.loads(line)["pid"])


def ask_shared(request: dict, timeout: float = START_TIMEOUT,
               path: str | None = None) -> int | None:
    """The PID the shared zygote at `path` (default: `SOCKET_ENV` here) forked for `request`;
    None if there is none, or it is gone or refuses."""
    path = path or os.environ.get(SOCKET_ENV)
    if not path:
        return None
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.settimeout(timeout)
            s.connect(path)
            s.sendall((json.dumps(request) + "\n").encode())
            reply = json.loads(s.makefile("rb").readline() or "{}")
    except (OSError, ValueError):
        return None
    return int(reply["pid"]) if "pid" in reply else None


atexit.register(stop)
