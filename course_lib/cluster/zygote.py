"""Local engines forked from one process that has already imported torch and ipyparallel.

An engine started from scratch imports torch again: about 3 s of CPU on a laptop, four engines
per cluster, a cluster in every lesson and a new one at every restart. The client starts one
zygote per process, the first time it needs local engines; each request is a JSON line on the
zygote's stdin (the engine's arguments, environment, folder and log file) and the reply is the
new engine's PID, a JSON line on its stdout. Nothing is unpickled. The zygote imports no
course_lib module (those read the environment, which each engine takes from its request) and
exits when its parent closes the pipe (the client exited, even by SIGKILL); the engines it
forks belong to the cluster that asked, which ends them by PID.

Each engine's nanny (ipyparallel's process that relays signals to the engine and tells the
controller at once when it dies) is forked too, from the engine before it runs anything, and
handed its arguments as JSON when the engine asks for it: ipyparallel would start a fresh
Python for it, 0.7 s of CPU per engine.
"""

from __future__ import annotations

import atexit
import base64
import json
import os
import select
import signal
import subprocess
import sys
import traceback

PRELOAD = ("torch", "torch._dynamo", "ipyparallel.engine.app",  # _dynamo: see course_lib.spawn
           "ipyparallel.controller.app")
START_TIMEOUT = 60.0  # seconds for the zygote to import PRELOAD and answer its first request

_zygote: subprocess.Popen | None = None


def _become(request: dict) -> None:
    """In the forked child: detach, take the request's stdio, environment and folder, and run
    ipyparallel's engine (or, if the request says so, its controller); never returns."""
    code = 1
    try:
        os.setsid()  # like ipyparallel's launcher: the client's terminal signals are not ours
        signal.signal(signal.SIGINT, signal.default_int_handler)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
        log = os.open(request["log"], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        os.dup2(log, 1)
        os.dup2(log, 2)
        os.environ.clear()
        os.environ.update(request["env"])
        os.chdir(request["cwd"])
        if request.get("app") == "controller":
            from ipyparallel.controller.app import IPController as App
        else:
            _fork_nanny()
            from ipyparallel.engine.app import IPEngine as App
        App.launch_instance(request["argv"])
        code = 0
    except BaseException:  # noqa: BLE001 - the engine's own end; said in its log
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def _plain(value):
    """The nanny's arguments as JSON data: bytes tagged, dicts (its Session config) as dicts."""
    if isinstance(value, bytes):
        return {"__bytes__": base64.b64encode(value).decode("ascii")}
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    raise TypeError(f"a {type(value).__name__} in the nanny's arguments")


def _unplain(value):
    if isinstance(value, dict):
        if set(value) == {"__bytes__"}:
            return base64.b64decode(value["__bytes__"])
        return {k: _unplain(v) for k, v in value.items()}
    return value


def _fork_nanny() -> None:
    """Fork this engine's nanny now, while this process is a clean copy of the zygote, and make
    ipyparallel's engine hand it its arguments instead of starting a new Python."""
    import ipyparallel.engine.app as app

    args_r, args_w = os.pipe()
    url_r, url_w = os.pipe()
    pid = os.fork()
    if pid == 0:
        _become_nanny(args_r, url_w, (args_w, url_r))
    os.close(args_r)
    os.close(url_w)
    fallback = app.start_nanny

    def start_nanny(**kwargs):
        kwargs["pid"] = os.getpid()
        try:
            data = json.dumps({k: _plain(v) for k, v in kwargs.items()}).encode()
        except TypeError:  # an argument a later ipyparallel added: its own way, then
            os.close(args_w)
            return fallback(**{k: v for k, v in kwargs.items() if k != "pid"})
        with os.fdopen(args_w, "wb") as f:
            f.write(data)
        pipe = os.fdopen(url_r, "r")  # held open by the engine: the nanny ends when it closes
        url = pipe.readline().strip()
        if not url:
            raise RuntimeError("nanny failed")
        return url, pipe

    app.start_nanny = start_nanny


def _become_nanny(args_r: int, url_w: int, parents: tuple[int, int]) -> None:
    """In the nanny: wait for the engine's arguments (none if it exits first), then run
    ipyparallel's KernelNanny, writing its address to `url_w`; never returns."""
    code = 1
    try:
        for fd in parents:
            os.close(fd)
        os.setsid()  # as ipyparallel starts it: signals to the engine's group are not ours
        with os.fdopen(args_r, "rb") as f:
            data = f.read()
        if data:
            from ipyparallel.engine.nanny import KernelNanny
            from traitlets.config import Config

            kwargs = {k: _unplain(v) for k, v in json.loads(data).items()}
            kwargs["config"] = Config(kwargs["config"])
            kwargs["pipe"] = os.fdopen(url_w, "w", buffering=1)
            KernelNanny.main(**kwargs)
        code = 0
    except BaseException:  # noqa: BLE001 - said in the engine's log, which it shares
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def serve() -> None:
    """The zygote's loop: one process forked per request line, until stdin closes."""
    for name in PRELOAD:
        __import__(name)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the client's Ctrl-C is not for us
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # exited engines are reaped by the kernel
    for line in sys.stdin:
        request = json.loads(line)
        pid = os.fork()
        if pid == 0:
            _become(request)
        sys.stdout.write(json.dumps({"pid": pid}) + "\n")
        sys.stdout.flush()


def stop() -> None:
    """At the client's exit: close the zygote's pipe (it exits), then end it by PID."""
    global _zygote
    proc, _zygote = _zygote, None
    if proc is None:
        return
    from course_lib.processes import end_processes, record

    try:
        proc.stdin.close()
        proc.wait(2.0)
    except (OSError, subprocess.TimeoutExpired):
        end_processes(record(proc.pid, descendants=False), grace=1.0)


def _started() -> subprocess.Popen:
    global _zygote
    if _zygote is None or _zygote.poll() is not None:
        # run as a script, not with -m: that would import course_lib.cluster (and read the
        # environment of the moment) into every engine
        _zygote = subprocess.Popen([sys.executable, os.path.abspath(__file__)],
                                   stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                   start_new_session=True, text=True)
    return _zygote


def fork(argv: list[str], log: str, timeout: float = START_TIMEOUT, *,
                app: str = "engine", env: dict[str, str] | None = None,
                cwd: str | None = None) -> int:
    """Fork an ipyparallel engine with `argv` (ipengine's arguments), or its controller (`app`
    "controller", ipcontroller's), with `env` and `cwd` (this process's by default), its output
    appended to `log`; returns its PID."""
    proc = _started()
    request = {"argv": argv, "env": dict(os.environ if env is None else env),
               "cwd": cwd or os.getcwd(), "log": log, "app": app}
    try:
        proc.stdin.write(json.dumps(request) + "\n")
        proc.stdin.flush()
    except OSError as exc:
        raise RuntimeError(f"the engine zygote (pid {proc.pid}) is gone: {exc}") from None
    ready, _, _ = select.select([proc.stdout], [], [], timeout)
    line = proc.stdout.readline() if ready else ""
    if not line:
        stop()
        raise RuntimeError(f"the engine zygote (pid {proc.pid}) did not fork an engine within "
                           f"{timeout:g}s")
    return int(json.loads(line)["pid"])


atexit.register(stop)

if __name__ == "__main__":
    sys.path[0] = os.getcwd()  # as `python -m` would have it, not this file's folder
    serve()
