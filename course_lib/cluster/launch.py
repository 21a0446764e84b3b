"""Launching a cluster's processes: ipyparallel's controller, engines forked from the zygote,
and what every local engine's watchdog needs to end itself with its client."""

from __future__ import annotations

import json
import logging
import os
import re
import sys
import time
import uuid
from typing import Any

import psutil

from course_lib import backend as backends
from course_lib.cluster import zygote
from course_lib.cluster.errors import ClusterError
from course_lib.i18n import _
from course_lib.processes import ProcessSet, running

POLL_SECONDS = 0.05
STALLED_SECONDS = 8.0  # engines not all registered by then: check the controller's ports
_ERROR = re.compile(r"CRITICAL|ERROR|Fatal|\w+(Error|Exception|Exit)\b")


def check_options(n: int, backend: str, engines: str, timeout: float, run_timeout: float,
                  joining: int, ipp_kwargs: dict) -> None:
    """ValueError for a cluster that cannot be started as asked, before anything starts."""
    backends.check_backend(backend, engines)
    if not (timeout > 0 and run_timeout > 0):
        raise ValueError(_("timeout and run_timeout must be positive seconds"))
    if isinstance(joining, bool) or not isinstance(joining, int) or not 0 <= joining <= n:
        raise ValueError(_("joining must be a number of engines from 0 to n={n}, got "
                           "{joining!r}", n=n, joining=joining))
    if joining and ipp_kwargs.get("controller_ip", "127.0.0.1").startswith("127."):
        raise ValueError(_("engines joining from other machines need controller_ip: an "
                           "address of this machine that they reach (or \"0.0.0.0\" with "
                           "controller_location)"))


def launched(ipp_cluster: Any) -> list:
    """The controller's and engine launchers' processes (their descendants are noted too)."""
    if ipp_cluster is None:
        return []
    roots = [ipp_cluster.controller] + list(ipp_cluster.engines.values())
    return [getattr(sub, "process", None) for launcher in roots if launcher is not None
            for sub in getattr(launcher, "launchers", {}).values() or [launcher]]


def ipp_cluster(n: int, engines: str, ipp_kwargs: dict, joining: int = 0) -> Any:
    """An ipyparallel Cluster of `n` engines (not started): quiet, loopback for local engines
    unless others join from other hosts, stopped at exit; `ipp_kwargs` override."""
    import ipyparallel as ipp

    if engines == "mpi":  # the mpich wheel's mpiexec sits next to this Python
        os.environ["PATH"] = os.path.dirname(sys.executable) + os.pathsep + os.environ["PATH"]
    kwargs = dict(n=n, engines=engines, log_level=logging.ERROR,
                  cluster_id=f"course-{uuid.uuid4().hex[:8]}", shutdown_atexit=True,
                  # An engine counts as registered at its first heartbeats: at ipyparallel's
                  # 3 s period that is most of a start; at 0.25 s (an echo the engine's zmq
                  # thread answers), a start takes 2 s instead of 5, and with 120 misses
                  # allowed a silent engine is still given 30 s.
                  controller_args=["--HeartMonitor.period=250",
                                   "--HeartMonitor.max_heartmonitor_misses=120"])
    if engines == "local":  # forked from the zygote, as the engines are
        # launchers subclasses ipyparallel's launchers: imported when a cluster starts
        from course_lib.cluster.launchers import ForkedControllerLauncher

        kwargs["controller_launcher_class"] = ForkedControllerLauncher
        if not joining:
            kwargs["controller_ip"] = "127.0.0.1"
    extra = list(ipp_kwargs.get("controller_args", []))  # e.g. "--IPController.ports=..."
    return ipp.Cluster(**{**kwargs, **ipp_kwargs,
                          "controller_args": kwargs["controller_args"] + extra})


def connection_file(ipp: Any, kind: str = "engine") -> str:
    """The connection file the controller writes for its engines, or for its clients
    (`kind="client"`): its addresses and key."""
    return os.path.join(ipp.profile_dir, "security",
                        f"ipcontroller-{ipp.cluster_id}-{kind}.json")


class ControllerPortsTaken(ClusterError):
    """The controller does not listen on every port its connection files name."""


def check_controller_ports(ipp: Any) -> None:
    """ControllerPortsTaken unless the controller's processes listen on every port its
    connection files give engines and clients. ipyparallel picks those ports free, frees them
    and binds them later, most in child processes: another process can take one in between,
    and that child then dies while the controller runs on, so engines register and are never
    heard (they give up 37 s later) or never given work."""
    root = getattr(getattr(ipp, "controller", None), "process", None)
    if not isinstance(root, psutil.Process):  # not a local process: nothing to look at
        return
    wanted = _ports(connection_file(ipp)) | _ports(connection_file(ipp, "client"))
    missing = wanted - _listening(root)
    if missing:
        raise ControllerPortsTaken(_(
            "the controller does not listen on ports {ports} that it gave its engines and "
            "clients: another process took them, or a process of the controller failed",
            ports=sorted(missing)))


def _ports(path: str) -> set[int]:
    """The TCP ports a connection file names (registration, hb_ping, broadcast, ...)."""
    with open(path, encoding="utf-8") as f:
        info = json.load(f)
    values = [v for value in info.values()
              for v in (value if isinstance(value, list) else [value])]
    return {v for v in values if isinstance(v, int) and not isinstance(v, bool)}


def _listening(root: psutil.Process) -> set[int]:
    """The TCP ports that `root` or one of its descendants listens on."""
    try:
        procs = [root, *root.children(recursive=True)]
    except psutil.Error:
        return set()
    ports = set()
    for proc in procs:
        try:
            ports |= {c.laddr.port for c in proc.net_connections(kind="tcp")
                      if c.status == psutil.CONN_LISTEN}
        except psutil.Error:
            pass
    return ports


def _connection_file_ready(path: str) -> bool:
    """Whether the controller has written its engine connection file in full."""
    try:
        with open(path, encoding="utf-8") as f:
            return "key" in json.load(f)
    except (OSError, ValueError):
        return False


def fork_engines(ipp: Any, n: int, timeout: float, procs: ProcessSet) -> list[tuple[int, str]]:
    """Start `n` local engines from the zygote, once the controller has written where to
    register; each one's output goes to the profile's log folder, as ipyparallel's own.
    Returns each engine's (PID, log file)."""
    path, deadline = connection_file(ipp), time.monotonic() + timeout
    while not _connection_file_ready(path):
        if time.monotonic() > deadline or not ipp.controller.running:
            raise ClusterError(_("the controller did not start within {limit}s",
                                 limit=f"{timeout:g}"))
        time.sleep(POLL_SECONDS)
    os.makedirs(os.path.join(ipp.profile_dir, "log"), exist_ok=True)
    argv = [f"--file={path}", f"--profile-dir={ipp.profile_dir}",
            f"--cluster-id={ipp.cluster_id}", "--log-level=ERROR"]
    forked = []
    for i in range(n):
        log_file = os.path.join(ipp.profile_dir, "log", f"ipengine-{ipp.cluster_id}-{i}.log")
        pid = zygote.fork(argv, log_file)
        procs.add(pid)
        forked.append((pid, log_file))
    return forked


def wait_for_engines(ipp: Any, client: Any, n: int, timeout: float,
                     forked: list[tuple[int, str]]) -> None:
    """Return once `n` engines have registered. Else a ClusterError: at once when a forked
    engine or the controller exits first, or after `timeout` seconds; it says how each forked
    engine stands and the end of its log. A start stalled past STALLED_SECONDS with the
    controller not listening where it said: ControllerPortsTaken (`check_controller_ports`)."""
    began = time.monotonic()
    deadline = began + timeout
    while True:
        try:
            client.wait_for_engines(n, timeout=min(1.0, max(0.0, deadline - time.monotonic())),
                                    interactive=False)
            return
        except TimeoutError:
            pass
        exited = [pid for pid, _log in forked if not running(pid)]
        controller = getattr(ipp, "controller", None)
        gone = controller is not None and not controller.running
        if exited or gone or time.monotonic() >= deadline:
            break
        if time.monotonic() - began > STALLED_SECONDS:  # a start takes 1-2 s: a lost port?
            check_controller_ports(ipp)
    what = [_("only {started} of {n} engines started within {limit}s", started=len(client.ids),
              n=n, limit=f"{timeout:g}") if not (exited or gone) else
            _("only {started} of {n} engines started: a process of the cluster exited first",
              started=len(client.ids), n=n)]
    if gone:
        what.append(_("the controller has exited"))
    for i, (pid, log) in enumerate(forked):
        what.append(_("engine {i} (pid {pid}) exited before it registered", i=i, pid=pid)
                    if pid in exited else
                    _("engine {i} (pid {pid}) runs", i=i, pid=pid))
        what += ["    " + line for line in _log_tail(log)]
    raise ClusterError("\n".join(what))


def _log_tail(path: str, lines: int = 4) -> list[str]:
    """What a log file ends with: its last error lines (a traceback's frames say less than
    its message), else its last lines; none if it is missing or empty."""
    try:
        with open(path, errors="replace") as f:
            text = f.read()[-20000:].splitlines()
    except OSError:
        return []
    errors = [line for line in text if _ERROR.search(line)]
    return (errors or text)[-lines:]


def watchdog(recorded: list) -> dict:
    """What each local engine's watchdog needs: this client process, and what to end."""
    me = psutil.Process()
    return dict(client_pid=me.pid, client_created=me.create_time(), pids=recorded)


def shut_down_remote(client: Any, remote_ids: list[int], wait: float = 3.0) -> None:
    """Ask the live engines on other hosts to exit (their `course.py engines` then exits too),
    and wait until they unregister: ending the controller sooner would drop the request."""
    remote = set(remote_ids) & set(client.ids)
    if not remote:
        return
    client.shutdown(targets=sorted(remote), block=False)
    deadline = time.monotonic() + wait
    while remote & set(client.ids) and time.monotonic() < deadline:
        time.sleep(POLL_SECONDS)
