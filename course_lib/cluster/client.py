"""The client side of a cluster: `start()` and the `Cluster` a notebook (or test) holds.

It launches the engines, gives them ranks, runs the backend's rendezvous through
`course_lib.cluster.engine`, and gathers per-rank results within a limit, interrupting or
restarting ranks that hang. Every process it started is ended by PID (`course_lib.processes`).
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import signal
import socket
import sys
import time
import uuid
from typing import Any, Callable

import psutil

from course_lib import backend as backends
from course_lib.cluster import engine, zygote
from course_lib.cluster.errors import ClusterError, EngineDied, RankError, RankTimeout
from course_lib.processes import ProcessSet, running
from course_lib.i18n import _, current

POLL_SECONDS = 0.05
INTERRUPT_GRACE = 10.0  # seconds a rank gets to unwind after SIGINT before its engines restart

log = logging.getLogger(__name__)


def _in_ipython() -> bool:
    try:
        from IPython import get_ipython
    except ImportError:
        return False
    return get_ipython() is not None


_LIVE: set["Cluster"] = set()


def _stop_all_at_exit() -> None:
    for cluster in list(_LIVE):
        cluster.stop()


atexit.register(_stop_all_at_exit)


def _launched(ipp_cluster: Any) -> list:
    """The controller's and engine launchers' processes (their descendants are noted too)."""
    if ipp_cluster is None:
        return []
    roots = [ipp_cluster.controller] + list(ipp_cluster.engines.values())
    return [getattr(sub, "process", None) for launcher in roots if launcher is not None
            for sub in getattr(launcher, "launchers", {}).values() or [launcher]]


def _ipp_cluster(n: int, engines: str, ipp_kwargs: dict, joining: int = 0) -> Any:
    """An ipyparallel Cluster of `n` engines (not started): quiet, loopback for local engines
    unless others join from other hosts, stopped at exit; `ipp_kwargs` override."""
    import ipyparallel as ipp

    if engines == "mpi":  # the mpich wheel's mpiexec sits next to this Python
        os.environ["PATH"] = os.path.dirname(sys.executable) + os.pathsep + os.environ["PATH"]
    kwargs = dict(n=n, engines=engines, log_level=logging.ERROR,
                  cluster_id=f"course-{uuid.uuid4().hex[:8]}", shutdown_atexit=True,
                  # An engine counts as registered at its first heartbeat: at ipyparallel's
                  # 3 s period that is most of a start; at 1 s, with 3x the misses allowed,
                  # a start is 3 s shorter and a silent engine is still given 30 s.
                  controller_args=["--HeartMonitor.period=1000",
                                   "--HeartMonitor.max_heartmonitor_misses=30"])
    if engines == "local":  # forked from the zygote, as the engines are
        from course_lib.cluster.launchers import ForkedControllerLauncher

        kwargs["controller_launcher_class"] = ForkedControllerLauncher
        if not joining:
            kwargs["controller_ip"] = "127.0.0.1"
    extra = list(ipp_kwargs.get("controller_args", []))  # e.g. "--IPController.ports=..."
    return ipp.Cluster(**{**kwargs, **ipp_kwargs,
                          "controller_args": kwargs["controller_args"] + extra})


def _connection_file_ready(path: str) -> bool:
    """Whether the controller has written its engine connection file in full."""
    try:
        with open(path, encoding="utf-8") as f:
            return "key" in json.load(f)
    except (OSError, ValueError):
        return False


PROBE_SECONDS = 1.0  # how often a rank on another host is checked for a live listener


def _watchdog(recorded: list) -> dict:
    """What each local engine's watchdog needs: this client process, and what to end."""
    me = psutil.Process()
    return dict(client_pid=me.pid, client_created=me.create_time(), pids=recorded)


def _describe(exc: BaseException) -> str:
    """'Name: message' of an exception, or of ipyparallel's RemoteError standing for one."""
    ename = getattr(exc, "ename", type(exc).__name__)
    evalue = getattr(exc, "evalue", str(exc))
    return f"{ename}: {evalue}"


def _dead_ranks(futures: list, infos: list[dict],
                probe: dict[int, tuple[str, int]] | None = None) -> dict[int, str]:
    """Ranks whose engine died: reported so by ipyparallel, its local process gone, or (ranks of
    `probe`, on other hosts, while their call is pending) its listening port refusing."""
    if probe:
        from course_lib.dist.transport import is_listening  # scratch ranks only
    dead = {}
    local = socket.gethostname()
    for rank, info in enumerate(infos):
        f = futures[rank] if rank < len(futures) else None
        exc = f.exception() if f is not None and f.ready() else None
        if exc is not None and "EngineError" in (type(exc).__name__, getattr(exc, "ename", "")):
            dead[rank] = f"engine {info['pid']} on {info['host']} died ({_describe(exc)})"
        elif info["host"] == local and not running(info["pid"]):
            dead[rank] = f"engine process {info['pid']} died"
        elif (probe and rank in probe and f is not None and not f.ready()
              and not is_listening(probe[rank], PROBE_SECONDS)):
            dead[rank] = (f"engine {info['pid']} on {info['host']} is gone (its port "
                          f"{probe[rank][1]} refuses connections)")
    return dead


def start(n: int = 4, *, backend: str | None = None, engines: str = "local",
          timeout: float = 60.0, run_timeout: float = 300.0, joining: int = 0,
          **ipp_kwargs: Any) -> "Cluster":
    """Start `n` engines with ranks 0..n-1 and the `backend` process group on each.

    `timeout` bounds start-up and the process group's blocking operations; `run_timeout` is
    the default limit of `Cluster.run`. `engines` picks the ipyparallel launcher ("local",
    "mpi", "ssh", "slurm", ...); extra keyword arguments go to `ipyparallel.Cluster`. The
    default backend is "scratch" (`course_lib.backend.default_backend`). With `joining=k`,
    only n-k engines start here and k join from other machines (`python3 course.py engines`,
    see the README); `controller_ip` must then be an address they reach.
    """
    backend = backends.default_backend() if backend is None else backend
    cluster = Cluster(n, backend=backend, engines=engines, timeout=timeout,
                      run_timeout=run_timeout, joining=joining, **ipp_kwargs)
    cluster._start()
    return cluster


class Cluster:
    """A running set of ranked engines. Use as a context manager so it always stops."""

    def __init__(self, n: int, *, backend: str, engines: str, timeout: float,
                 run_timeout: float, joining: int = 0, **ipp_kwargs: Any):
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ValueError(f"n must be a positive number of engines, got {n!r}")
        backends.check_backend(backend, engines)
        if not (timeout > 0 and run_timeout > 0):
            raise ValueError("timeout and run_timeout must be positive seconds")
        if isinstance(joining, bool) or not isinstance(joining, int) or not 0 <= joining <= n:
            raise ValueError(f"joining must be a number of engines from 0 to n={n}, "
                             f"got {joining!r}")
        if joining and ipp_kwargs.get("controller_ip", "127.0.0.1").startswith("127."):
            raise ValueError("engines joining from other machines need controller_ip: an "
                             "address of this machine that they reach (or \"0.0.0.0\" with "
                             "controller_location)")
        self.world_size, self.backend, self.engines = n, backend, engines
        self.joining = joining
        self.timeout, self.run_timeout = float(timeout), float(run_timeout)
        self._ipp_kwargs = ipp_kwargs
        self._ipp = self._client = self._view = None
        self._ids: list[int] = []          # engine id of each rank
        self._info: list[dict] = []        # pid/host of each rank's engine
        self._procs = ProcessSet()         # every process we started
        self._dead: dict[int, str] = {}
        self._stopped = True
        self._rendezvous: dict[str, Any] = {}  # what every rank's init got (scratch: addresses)

    # -- life cycle ---------------------------------------------------------------------

    def _start(self) -> None:
        self._stopped = False
        _LIVE.add(self)
        try:
            self._ipp = _ipp_cluster(self.world_size - self.joining, self.engines,
                                     self._ipp_kwargs, self.joining)
            if self.engines == "local":  # forked from the zygote, torch already imported
                self._ipp.start_controller_sync()
                self._fork_engines(self.world_size - self.joining)
            else:
                self._ipp.start_cluster_sync()
            for proc in _launched(self._ipp):
                self._procs.add(proc)
            self._client = self._ipp.connect_client_sync()
            if self.joining:
                print(self.join_instructions(), flush=True)
            try:
                self._client.wait_for_engines(self.world_size, timeout=self.timeout,
                                              interactive=False)
            except TimeoutError:
                raise ClusterError(_("only {started} of {n} engines started within {limit}s",
                                     started=len(self._client.ids), n=self.world_size,
                                     limit=f"{self.timeout:g}")) from None
            self._assign_ranks()
            self._init_process_group()
        except BaseException:
            self.stop()
            raise

    def _assign_ranks(self) -> None:
        ids = sorted(self._client.ids)[: self.world_size]
        infos = self._client.direct_view(ids).apply_async(engine.info).get(self.timeout)
        order = sorted(range(len(ids)), key=lambda i: (infos[i]["mpi_rank"] or 0, ids[i]))
        self._ids = [ids[i] for i in order]
        self._info = [infos[i] for i in order]
        local = socket.gethostname()
        for info in self._info:
            if info["host"] == local:
                self._procs.add(info["pid"])
        self._give_ranks(_watchdog(self._procs.recorded))

    def _give_ranks(self, watch: dict | None) -> None:
        """Tell each engine of `self._ids` its rank and the world size (and, once, to watch
        this client); `%%px` then runs on them in rank order."""
        local = socket.gethostname()
        self._view = self._client.direct_view(self._ids)
        self._view.block = True  # `%%px` waits for its cell and shows the output
        self._view.use_cloudpickle()
        futures = [self._client[eid].apply_async(
                       engine.setup, rank, self.world_size, self.backend,
                       watch if self._info[rank]["host"] == local else None, current())
                   for rank, eid in enumerate(self._ids)]
        self._gather(futures, "setting up engines", self.timeout)
        if _in_ipython():
            self._view.activate()  # %%px now runs on these ranks

    def _engine_file(self) -> str:
        """The engine connection file the controller writes (its addresses and key)."""
        return os.path.join(self._ipp.profile_dir, "security",
                            f"ipcontroller-{self._ipp.cluster_id}-engine.json")

    def _fork_engines(self, n: int) -> None:
        """Start `n` local engines from the zygote, once the controller has written where to
        register; each one's output goes to the profile's log folder, as ipyparallel's own."""
        path, deadline = self._engine_file(), time.monotonic() + self.timeout
        while not _connection_file_ready(path):
            if time.monotonic() > deadline or not self._ipp.controller.running:
                raise ClusterError(_("the controller did not start within {limit}s",
                                     limit=f"{self.timeout:g}"))
            time.sleep(POLL_SECONDS)
        os.makedirs(os.path.join(self._ipp.profile_dir, "log"), exist_ok=True)
        argv = [f"--file={path}", f"--profile-dir={self._ipp.profile_dir}",
                f"--cluster-id={self._ipp.cluster_id}", "--log-level=ERROR"]
        for i in range(n):
            log_file = os.path.join(self._ipp.profile_dir, "log",
                                    f"ipengine-{self._ipp.cluster_id}-{i}.log")
            self._procs.add(zygote.fork(argv, log_file))

    def join_instructions(self) -> str:
        """What to run on the other machines so that the joining engines arrive."""
        path = self._engine_file()
        return _("waiting {limit}s for {k} engine(s) from other machines: copy {path} to each "
                 "(scp: it holds the cluster's key) and run there: python3 course.py engines "
                 "COUNT --file ipcontroller-engine.json", limit=f"{self.timeout:g}",
                 k=self.joining, path=path)

    def _location(self) -> str | None:
        """The controller's address as other hosts see it; None when every engine is local
        (ranks then talk over loopback)."""
        if self.engines == "local" and not self.joining:
            return None
        where = self._ipp_kwargs.get("controller_location") or self._ipp_kwargs.get(
            "controller_ip", "")
        return "" if where in ("0.0.0.0", "*") else where

    def _remote(self) -> list[int]:
        """Ranks whose engine runs on another host."""
        local = socket.gethostname()
        return [r for r, info in enumerate(self._info) if info["host"] != local]

    def _on_all(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> list:
        """Start `fn` on every rank's engine; one future per rank."""
        return [self._client[eid].apply_async(fn, *args, **kwargs) for eid in self._ids]

    def _init_process_group(self) -> None:
        """The rendezvous of `course_lib.backend`: addresses from the ranks, then init."""
        timeout = self.timeout
        addresses = self._gather(self._on_all(engine.prepare_backend, self.backend,
                                              self._location()),
                                 "opening listening sockets", timeout)
        kwargs = backends.rendezvous(self.backend, addresses)
        self._rendezvous, sent = kwargs, kwargs
        key = self._client.session.key
        if "secret" in kwargs and key:
            nonce = os.urandom(16)
            self._rendezvous = {**kwargs, "secret": backends.derive_secret(key, nonce)}
            sent = {**kwargs, "secret": None, "nonce": nonce}
        self._gather(self._on_all(engine.init_backend, self.backend, timeout, **sent),
                     f"initializing the {self.backend!r} process group", timeout + 10)

    def restart(self) -> "Cluster":
        """Stop every engine and start fresh ones with the same world size, ranks and backend."""
        self.stop()
        self._dead.clear()
        self._start()
        return self

    def shrink(self) -> "Cluster":
        """Go on with the engines still alive (elastic): drop the dead ranks, renumber the
        survivors 0..m-1 in their old order and build a new process group among them. Their
        Python state is kept; the world size is now m."""
        if self._stopped:
            raise ClusterError("shrink: this cluster is stopped")
        if not self._dead:
            raise ClusterError(_("shrink: no rank has died, so there is nothing to drop"))
        if self.backend == "mpi":
            raise ClusterError("shrink: an MPI world cannot lose ranks; call .restart()")
        live = [r for r in range(self.world_size) if r not in self._dead]
        if not live:
            raise ClusterError(_("shrink: every rank has died; call .restart()"))
        self._ids = [self._ids[r] for r in live]
        self._info = [self._info[r] for r in live]
        self.world_size = len(live)
        self._dead.clear()
        self._give_ranks(None)  # the survivors already watch this client
        self._init_process_group()
        return self

    def stop(self) -> None:
        """End every process this cluster started, by PID. Safe to call twice."""
        if self._stopped:
            return
        self._stopped = True
        _LIVE.discard(self)
        for proc in _launched(self._ipp):
            self._procs.add(proc)
        if self._client is not None:
            try:
                self._shut_down_remote()
            except Exception as exc:  # noqa: BLE001 - they also leave when heartbeats stop
                log.debug("shutting down remote engines: %s", exc)
            try:
                self._client.close()
            except Exception:  # noqa: BLE001 - closing sockets only
                pass
        # By PID first (ipyparallel's own stop waits 5 s per process). Local engines hold nothing
        # that needs a graceful exit, so half a second after TERM the rest are killed; MPI
        # engines get longer, to remove their shared-memory segments from /dev/shm.
        self._procs.end(grace=3.0 if self.engines == "mpi" else 0.5)
        if self._ipp is not None:
            try:
                self._ipp.stop_cluster_sync()  # tidies its launchers and cluster file
            except Exception as exc:  # noqa: BLE001 - the processes are already gone
                log.debug("ipyparallel stop: %s", exc)
        self._client = self._view = self._ipp = None

    def _shut_down_remote(self, wait: float = 3.0) -> None:
        """Ask the live engines on other hosts to exit (their `course.py engines` then exits
        too), and wait until they unregister: ending the controller sooner would drop the
        request."""
        remote = {self._ids[r] for r in self._remote()} & set(self._client.ids)
        if not remote:
            return
        self._client.shutdown(targets=sorted(remote), block=False)
        deadline = time.monotonic() + wait
        while remote & set(self._client.ids) and time.monotonic() < deadline:
            time.sleep(POLL_SECONDS)

    def __enter__(self) -> "Cluster":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    def __repr__(self) -> str:
        state = "stopped" if self._stopped else f"engines {self._ids}"
        return f"<Cluster world_size={self.world_size} backend={self.backend!r} {state}>"

    # -- running code -------------------------------------------------------------------

    @property
    def view(self):
        """The ipyparallel DirectView over all ranks, ordered by rank."""
        self._check_usable()
        return self._view

    @property
    def pids(self) -> list[int]:
        """The engine process ID of each rank."""
        return [info["pid"] for info in self._info]

    def run(self, fn: Callable[..., Any], *args: Any, timeout: float | None = None,
            **kwargs: Any) -> list[Any]:
        """Run `fn(*args, **kwargs)` on every rank; return the results in rank order.

        Raises `RankError` naming every failing rank, `RankTimeout` (after interrupting the
        stuck ranks, or restarting the engines if that fails) and `EngineDied`.
        """
        if not callable(fn):
            raise TypeError(_("run() needs a function, got {type}", type=type(fn).__name__))
        self._check_usable()
        limit = self.run_timeout if timeout is None else float(timeout)
        futures = self._on_all(fn, *args, **kwargs)
        what = f"run({getattr(fn, '__name__', 'fn')})"
        try:
            return self._gather(futures, what, limit)
        except KeyboardInterrupt:
            self._interrupt([r for r, f in enumerate(futures) if not f.ready()], futures)
            raise

    def flight_records(self, timeout: float = 5.0) -> list[dict | None]:
        """Every rank's flight record (course_lib.dist's last collectives per group), in rank
        order, even while the engines are busy or stuck: each rank's listener answers, not its
        kernel. None for a rank that does not answer within `timeout`."""
        self._check_usable()
        if self.backend != "scratch":
            raise ClusterError(f"flight records come from the scratch backend; this cluster "
                               f"runs {self.backend!r}")
        from course_lib.dist.transport import query_record

        addresses, secret = self._rendezvous["addresses"], self._rendezvous["secret"]
        n = self.world_size
        return [query_record(addresses[r], secret, (r + 1) % n, r, timeout) if n > 1 else
                self.run(_own_flight_record)[0] for r in range(n)]

    def _check_usable(self) -> None:
        if self._stopped:
            raise ClusterError(_("this cluster is stopped; start a new one with "
                                 "course_lib.cluster.start() or call .restart()"))
        if self._dead:
            raise EngineDied(_("cluster unusable"), self._dead,
                             _("call .restart() to start fresh engines with the same ranks"))

    def _gather(self, futures: list, what: str, limit: float) -> list[Any]:
        """Wait for one future per rank within `limit` seconds; raise naming failing ranks."""
        deadline = time.monotonic() + limit
        addresses = self._rendezvous.get("addresses")
        probe = {r: addresses[r] for r in self._remote()} if addresses else {}
        next_probe = time.monotonic() + PROBE_SECONDS
        while (pending := [f for f in futures if not f.ready()]):
            now = time.monotonic()
            if now > deadline or _dead_ranks(futures, self._info,
                                              probe if now >= next_probe else None):
                break
            next_probe = now + PROBE_SECONDS if now >= next_probe else next_probe
            pending[0].wait(POLL_SECONDS)
        dead = _dead_ranks(futures, self._info, probe)
        if dead:
            self._dead.update(dead)
            self._interrupt([r for r, f in enumerate(futures) if not f.ready()], futures)
            raise EngineDied(what, dead, _("call .restart() to start fresh engines with the "
                                           "same ranks"))
        stuck = [r for r, f in enumerate(futures) if not f.ready()]
        if stuck:
            note = self._interrupt(stuck, futures)
            late = _("still running after {limit}s (a hang or deadlock?)", limit=f"{limit:g}")
            raise RankTimeout(what, dict.fromkeys(stuck, late), note)
        failures = {r: _describe(f.exception()) for r, f in enumerate(futures)
                    if f.exception() is not None}
        if failures:
            raise RankError(what, failures)
        return [f.get() for f in futures]

    def _interrupt(self, ranks: list[int], futures: list) -> str:
        """SIGINT the given ranks; if they do not unwind, restart all engines. Says which."""
        if not ranks:
            return ""
        live = [r for r in ranks if r not in self._dead]
        try:
            self._client.send_signal(signal.SIGINT, targets=[self._ids[r] for r in live],
                                     block=True)
        except Exception as exc:  # noqa: BLE001 - fall through to the restart below
            log.warning("interrupting ranks %s failed: %s", live, exc)
        deadline = time.monotonic() + INTERRUPT_GRACE
        while time.monotonic() < deadline and not all(futures[r].ready() for r in live):
            time.sleep(POLL_SECONDS)
        if self._dead:
            return _("the surviving ranks were interrupted")
        if all(futures[r].ready() for r in live):
            if self.backend in ("scratch", "gloo"):
                self._reset_process_group()
                return _("the stuck ranks were interrupted and the process group rebuilt; "
                         "the cluster is ready")
            return _("the stuck ranks were interrupted; the cluster is ready")
        self.restart()
        return _("interrupting did not stop them, so the engines were restarted "
                 "(engine-side state is lost) and the process group rebuilt")

    def _reset_process_group(self) -> None:
        """Rebuild the process group: an interrupted collective leaves messages in flight."""
        try:
            self._init_process_group()
        except ClusterError:
            self.restart()


def _own_flight_record() -> dict:
    from course_lib import dist

    return dist.flight_record()
