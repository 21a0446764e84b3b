"""The zygote itself (`course_lib.cluster.zygote` starts it and asks it to fork): run as a script,
it imports PRELOAD once, then forks one process per request, a JSON line on its stdin (`serve`)
or on a connection to its Unix socket (`serve_shared`, `--shared`), and replies with the PID.

A forked process becomes what the request names (`_become`): an ipyparallel engine (its nanny
forked too, `_fork_nanny`), the controller, or a Jupyter kernel, with the request's environment,
folder, PYTHONPATH and log. A shared zygote serves only this user's processes that run the same
Python in the same namespaces, and gives what it forks the client's resource limits.

Standard library only, and no course_lib module at the top: those read the environment, which
each forked process takes from its request.
"""

from __future__ import annotations

import atexit
import base64
import importlib
import importlib.machinery
import json
import os
import resource
import select
import shutil
import signal
import socket
import struct
import sys
import tempfile
import traceback
from typing import Callable

PRELOAD = ("torch", "torch._dynamo", "ipyparallel.engine.app",  # _dynamo: see course_lib.spawn
           "ipyparallel.controller.app", "ipykernel.kernelapp")
REQUEST_SECONDS = 5.0  # a shared zygote's wait for a connected client's request line
NAMESPACES = ("net", "mnt", "pid", "ipc", "uts", "user", "cgroup")  # a client's must be ours

_OWN_PYTHONPATH = [os.path.abspath(p) for p in os.environ.get("PYTHONPATH", "").split(os.pathsep)
                   if p]


def _become(request: dict) -> None:
    """In the forked child: detach, take the request's stdio, environment and folder, and run
    ipyparallel's engine (or, if the request says so, its controller, or a Jupyter kernel);
    never returns."""
    code = 1
    try:
        os.setsid()  # like ipyparallel's launcher: the client's terminal signals are not ours
        signal.signal(signal.SIGINT, signal.default_int_handler)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)  # a shared zygote's handler is its own
        os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
        if request["log"]:
            log = os.open(request["log"], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
            os.dup2(log, 1)
            os.dup2(log, 2)
        else:  # the zygote's own stderr (a shared one's stdout is its owner's pipe)
            os.dup2(2, 1)
        os.environ.clear()
        os.environ.update(request["env"])
        tempfile.tempdir = None  # the request's TMPDIR, not the one the zygote read and cached
        os.chdir(request["cwd"])
        _fresh_path(request["cwd"], request["env"].get("PYTHONPATH", ""))
        _own_package_from_path()
        app = request.get("app")
        if app == "kernel":  # as ipykernel_launcher: the folder off sys.path while it loads
            del sys.path[0]
            contain = request.get("contain") or {}
            _limit(contain.get("limits", {}))
            if contain.get("namespace"):  # the parent's watch goes to the namespace's keeper
                _enter_namespace(_still_running(request["parent"]))
            else:
                _exit_with(request["parent"])
            from ipykernel.kernelapp import IPKernelApp as App
        elif app == "controller":
            from ipyparallel.controller.app import IPController as App
        else:
            _fork_nanny()
            from ipyparallel.engine.app import IPEngine as App
        argv = request["argv"]
        if app != "kernel":  # ipyparallel took its default folder from the zygote's at import
            argv = [f"--work-dir={request['cwd']}"] + argv
        sys.argv = [sys.modules[App.__module__].__file__, *argv]  # not the zygote's
        App.launch_instance(argv)
        if app == "kernel":  # a kernel's exit hooks, as its own Python would run them at exit
            atexit._run_exitfuncs()  # (the cluster client's stop, multiprocessing's cleanup)
        code = 0
    except BaseException:  # noqa: BLE001 - the engine's own end; said in its log
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def _limit(limits: dict[str, int]) -> None:
    """Set each named resource limit (soft and hard), as course-grade's kernels get them."""
    for name, value in limits.items():
        resource.setrlimit(getattr(resource, name), (value, value))


CLONE_NEWNS, CLONE_NEWPID, CLONE_NEWUSER = 0x00020000, 0x20000000, 0x10000000
MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_REC, MS_PRIVATE = 0x2, 0x4, 0x8, 0x4000, 0x40000
PR_SET_PDEATHSIG = 1


def _enter_namespace(running: Callable[[], bool]) -> None:
    """`unshare --pid --fork --kill-child --mount-proc` in this process: a new PID namespace
    with its own /proc. This process stays outside as its keeper, which exits with its child's
    status, or at once when `running()` (its manager) turns false; the child returns here as the
    namespace's first process, killed with everything in the namespace when the keeper ends."""
    import ctypes
    import time

    libc = ctypes.CDLL(None, use_errno=True)
    uid, gid = os.getuid(), os.getgid()
    if libc.unshare(CLONE_NEWPID | (CLONE_NEWUSER if uid else 0)) != 0:
        raise OSError(ctypes.get_errno(), "unshare: no PID namespace for this kernel")
    if uid:  # unprivileged: root inside the user namespace, as --map-root-user
        for name, text in (("setgroups", "deny"), ("uid_map", f"0 {uid} 1"),
                           ("gid_map", f"0 {gid} 1")):
            with open(f"/proc/self/{name}", "w") as f:
                f.write(text)
    pid = os.fork()
    if pid:  # no thread can start here (a PID namespace for children, not for us): a poll
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # an interrupt is for the kernel alone
        while True:
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                os._exit(os.waitstatus_to_exitcode(status) & 0xFF)
            if not running():
                os._exit(1)
            time.sleep(0.2)
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    # Its own mount namespace: the keeper still reads the grader's /proc to watch it.
    if (libc.unshare(CLONE_NEWNS) != 0
            or libc.mount(None, b"/", None, MS_REC | MS_PRIVATE, None) != 0
            or libc.mount(b"proc", b"/proc", b"proc", MS_NOSUID | MS_NODEV | MS_NOEXEC, None)):
        raise OSError(ctypes.get_errno(), "mount: no /proc of this kernel's own")


def _still_running(parent: int) -> Callable[[], bool]:
    """Whether `parent` (a kernel's manager, not its parent here) still runs: the very process,
    not a recycled PID. Ends this process at once if it is already gone."""
    import psutil

    # Not at the top: the zygote imports no course_lib module (see above), and only its own
    # children get here.
    from course_lib.processes import alive

    try:
        manager = psutil.Process(parent)
    except psutil.NoSuchProcess:
        os._exit(1)
    return lambda: alive(manager)


def _exit_with(parent: int) -> None:
    """End this process when `parent` ends, as ipykernel's parent poller does for the kernels
    a manager starts itself."""
    import threading
    import time

    running = _still_running(parent)

    def watch() -> None:
        while running():
            time.sleep(1.0)
        os._exit(1)

    threading.Thread(target=watch, daemon=True, name="course-parent-watch").start()


def _fresh_path(cwd: str, pythonpath: str) -> None:
    """sys.path as a new `python -m` in `cwd` with this PYTHONPATH would have it (a learner's
    bundle on PYTHONPATH must be the course_lib its engines import)."""
    wanted = [os.path.abspath(os.path.join(cwd, p)) for p in pythonpath.split(os.pathsep) if p]
    sys.path[:] = [cwd] + wanted + [p for p in sys.path[1:]
                                    if p not in wanted and p not in _OWN_PYTHONPATH]


def _own_package_from_path() -> None:
    """Forget the course_lib this zygote's startup imported when the request's sys.path finds
    another (a learner's bundle), and start that one as the zygote's was started."""
    loaded = sys.modules.get("course_lib")
    spec = importlib.machinery.PathFinder.find_spec("course_lib", sys.path)
    if loaded is None or spec is None or spec.origin == getattr(loaded, "__file__", None):
        return
    for name in [n for n in sys.modules if n == "course_lib" or n.startswith("course_lib.")]:
        del sys.modules[name]
    sys.meta_path[:] = [f for f in sys.meta_path
                        if not type(f).__module__.startswith("course_lib")]
    _startup()


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
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
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


STARTUP_ENV = "COURSE_LIB_STARTUP"  # "module:function" to call before anything is imported


def _startup() -> None:
    module, _, function = os.environ.get(STARTUP_ENV, "").partition(":")
    if module and function:
        getattr(importlib.import_module(module), function)()


def _preload() -> None:
    """Import PRELOAD once for every process forked from here; first, what the process that
    started this zygote asked for (a lesson's: the learner's components win from the start)."""
    _startup()
    for name in PRELOAD:
        __import__(name)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the client's Ctrl-C is not for us
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # exited engines are reaped by the kernel


def serve() -> None:
    """The zygote's loop: one process forked per request line, until stdin closes."""
    _preload()
    for line in sys.stdin:
        request = json.loads(line)
        pid = os.fork()
        if pid == 0:
            _become(request)
        sys.stdout.write(json.dumps({"pid": pid}) + "\n")
        sys.stdout.flush()


def serve_shared() -> None:
    """A shared zygote's loop: says its socket on stdout at once, then imports PRELOAD and forks
    one process per connection's request line, until stdin closes (its owner exited)."""
    folder = tempfile.mkdtemp(prefix="course-zygote-")  # 0700: only this user reaches the socket
    path = os.path.join(folder, "socket")
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))  # ended by PID: remove the folder too
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        try:
            server.bind(path)
        except OSError as exc:  # said on stdout: start_shared raises it
            sys.stdout.write(json.dumps({"error": f"cannot listen on {path}: {exc}"}) + "\n")
            return
        server.listen(16)  # requests made while PRELOAD imports wait here
        sys.stdout.write(json.dumps({"socket": path}) + "\n")
        sys.stdout.flush()
        _preload()
        while True:
            ready, _, _ = select.select([0, server], [], [])
            if 0 in ready and not os.read(0, 4096):
                return
            if server in ready:
                conn, _ = server.accept()
                with conn:
                    _answer(conn, server)
    finally:
        server.close()
        shutil.rmtree(folder, ignore_errors=True)


def _answer(conn: socket.socket, server: socket.socket) -> None:
    """Fork the process one connection asks for and reply with its PID, or say why not."""
    peer = None
    if hasattr(socket, "SO_PEERCRED"):
        peer, uid, _ = struct.unpack("3i", conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED,
                                                           struct.calcsize("3i")))
        if uid != os.getuid():
            return
    try:
        conn.settimeout(REQUEST_SECONDS)
        request = json.loads(conn.makefile("rb").readline(1 << 20))
        unlike = _unlike(peer) if peer else None
        if request.get("executable") != sys.executable:
            reply = {"error": f"this zygote runs {sys.executable}"}
        elif unlike:
            reply = {"error": f"the client runs in {unlike}"}
        else:
            limits = _limits_of(peer) if peer else {}
            pid = os.fork()
            if pid == 0:
                server.close()
                conn.close()
                for which, value in limits.items():
                    try:
                        resource.setrlimit(which, value)
                    except (ValueError, OSError):
                        pass  # above this process's hard limit: keep the zygote's
                _become(request)
            reply = {"pid": pid}
        conn.sendall((json.dumps(reply) + "\n").encode())
    except (OSError, ValueError, AttributeError):  # a client that went or sent nonsense
        pass


def _unlike(peer: int) -> str | None:
    """Why a process forked here would not be what `peer` would start itself: it runs in another
    namespace or cgroup (another network namespace, a container); None where alike."""
    for kind in NAMESPACES:
        try:
            if os.readlink(f"/proc/{peer}/ns/{kind}") != os.readlink(f"/proc/self/ns/{kind}"):
                return f"another {kind} namespace"
        except OSError:
            continue
    try:
        with open(f"/proc/{peer}/cgroup") as theirs, open("/proc/self/cgroup") as ours:
            return "another cgroup" if theirs.read() != ours.read() else None
    except OSError:
        return None


def _limits_of(peer: int) -> dict[int, tuple[int, int]]:
    """`peer`'s resource limits, which what it starts would inherit (a memory limit, say)."""
    found = {}
    for name in dir(resource):
        if name.startswith("RLIMIT_"):
            try:
                found[getattr(resource, name)] = resource.prlimit(peer, getattr(resource, name))
            except (OSError, ValueError, AttributeError):
                pass
    return found


if __name__ == "__main__":
    sys.path[0] = os.getcwd()  # as `python -m` would have it, not this file's folder
    serve_shared() if sys.argv[1:] == ["--shared"] else serve()
