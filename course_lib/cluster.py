"""A cluster of ipyparallel engines with ranks, a process group, and bounded waits.

`start(4)` launches 4 engines on this machine, gives them ranks 0..3 and initializes the
process group on each; `Cluster.run(fn)` runs `fn` on every rank and returns the results in
rank order. Nothing waits forever: a rank that hangs is interrupted (or its engines restarted)
and the error names it. Every process started here is ended by PID when the cluster stops, on
errors, on KeyboardInterrupt and at interpreter exit.
"""

from __future__ import annotations

import atexit
import logging
import os
import secrets
import signal
import socket
import sys
import threading
import time
import uuid
from typing import Any, Callable

import psutil

BACKENDS = ("scratch", "gloo", "mpi", "none")
DEFAULT_BACKEND = "scratch"
POLL_SECONDS = 0.05
INTERRUPT_GRACE = 3.0  # seconds a rank gets to unwind after SIGINT before its engines restart

log = logging.getLogger(__name__)


class ClusterError(RuntimeError):
    """The cluster could not do what was asked (start, a stopped cluster, a dead engine...)."""


class RankError(ClusterError):
    """`run` failed on some ranks: `failures` maps rank -> what went wrong there."""

    def __init__(self, what: str, failures: dict[int, str], note: str = ""):
        self.failures = dict(sorted(failures.items()))
        self.note = note
        lines = [f"{what}: {len(self.failures)} rank(s) failed"]
        lines += [f"  rank {r}: {msg}" for r, msg in self.failures.items()]
        if note:
            lines.append(note)
        super().__init__("\n".join(lines))


class RankTimeout(RankError):
    """Some ranks did not finish within the timeout; they were interrupted or restarted."""


class EngineDied(RankError):
    """A rank's engine process died; call `Cluster.restart()` to bring the world back."""


# ----------------------------------------------------------------------------- engine side

_ENGINE: dict[str, Any] = {}


def get_rank() -> int:
    """This engine's rank (engine side)."""
    return _ENGINE["rank"]


def get_world_size() -> int:
    """The number of ranks in this cluster (engine side)."""
    return _ENGINE["world_size"]


def _engine_info() -> dict:
    info = {"pid": os.getpid(), "ppid": os.getppid(), "host": socket.gethostname(),
            "mpi_rank": None}
    if "mpi4py" in sys.modules or os.environ.get("PMI_RANK") is not None:
        from mpi4py import MPI

        info["mpi_rank"] = MPI.COMM_WORLD.Get_rank()
    return info


def _engine_setup(rank: int, world_size: int, backend: str, watch: dict | None) -> None:
    import torch

    torch.set_num_threads(1)
    _ENGINE.update(rank=rank, world_size=world_size, backend=backend)
    if watch is not None:
        threading.Thread(target=_watch_client, kwargs=watch, daemon=True,
                         name="course-lib-watch-client").start()


def _watch_client(client_pid: int, client_created: float, pids: list) -> None:
    """End this engine (and the controller) if the client process is gone (e.g. SIGKILLed)."""
    while True:
        time.sleep(1.0)
        try:
            alive = psutil.Process(client_pid).create_time() == client_created
        except psutil.NoSuchProcess:
            alive = False
        if not alive:
            _kill_pids([(pid, created) for pid, created in pids if pid != os.getpid()])
            os._exit(1)


def _engine_listen(host: str) -> tuple[str, int]:
    from course_lib import dist
    from course_lib.spawn import shutdown_backend

    shutdown_backend("scratch")  # a rebuild: close the old group before opening a new socket
    return dist.listen(host)


def _engine_free_port(host: str) -> int:
    from course_lib.spawn import free_port

    return free_port(host)


def _engine_init(backend: str, timeout: float, **kwargs: Any) -> None:
    from course_lib.spawn import init_backend, shutdown_backend

    shutdown_backend(backend)
    if backend == "mpi":
        from mpi4py import MPI

        if MPI.COMM_WORLD.Get_rank() != _ENGINE["rank"]:
            raise ClusterError("MPI rank and cluster rank disagree")
        return
    init_backend(backend, _ENGINE["rank"], _ENGINE["world_size"], timeout=timeout, **kwargs)


def _engine_namespace(backend: str) -> str:
    """Code run on each engine so `%%px` cells see `rank`, `world_size` and `dist`."""
    imports = {"scratch": "from course_lib import dist",
               "gloo": "import torch.distributed as dist",
               "mpi": "from mpi4py import MPI; comm = MPI.COMM_WORLD",
               "none": ""}[backend]
    return ("import torch\nfrom course_lib.cluster import get_rank as _gr, get_world_size as _gw\n"
            f"rank, world_size = _gr(), _gw()\n{imports}\n")


# ----------------------------------------------------------------------------- client side

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


def _running(pid: int) -> bool:
    """True while `pid` runs; a zombie (exited, not yet reaped) has died."""
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _kill_pids(procs: list[tuple[int, float]], grace: float = 3.0) -> None:
    """TERM, then KILL after `grace`, each (pid, create_time); a recycled PID is left alone."""
    alive = []
    for pid, created in procs:
        try:
            p = psutil.Process(pid)
            if p.create_time() == created:
                p.terminate()
                alive.append(p)
        except psutil.Error:
            pass
    _, still = psutil.wait_procs(alive, timeout=grace)
    for p in still:
        try:
            p.kill()
        except psutil.Error:
            pass
    psutil.wait_procs(still, timeout=grace)


def start(n: int = 4, *, backend: str = DEFAULT_BACKEND, engines: str = "local",
          timeout: float = 60.0, run_timeout: float = 300.0, **ipp_kwargs: Any) -> "Cluster":
    """Start `n` engines with ranks 0..n-1 and the `backend` process group on each.

    `timeout` bounds start-up and the process group's blocking operations; `run_timeout` is
    the default limit of `Cluster.run`. `engines` picks the ipyparallel launcher ("local",
    "mpi", "ssh", "slurm", ...); extra keyword arguments go to `ipyparallel.Cluster`.
    """
    cluster = Cluster(n, backend=backend, engines=engines, timeout=timeout,
                      run_timeout=run_timeout, **ipp_kwargs)
    cluster._start()
    return cluster


class Cluster:
    """A running set of ranked engines. Use as a context manager so it always stops."""

    def __init__(self, n: int, *, backend: str, engines: str, timeout: float,
                 run_timeout: float, **ipp_kwargs: Any):
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ValueError(f"n must be a positive number of engines, got {n!r}")
        if backend not in BACKENDS:
            raise ValueError(f"unknown backend {backend!r}; choose one of {', '.join(BACKENDS)}")
        if backend == "mpi" and engines != "mpi":
            raise ValueError('backend="mpi" needs engines="mpi" (engines started by mpiexec)')
        if not (timeout > 0 and run_timeout > 0):
            raise ValueError("timeout and run_timeout must be positive seconds")
        self.world_size, self.backend, self.engines = n, backend, engines
        self.timeout, self.run_timeout = float(timeout), float(run_timeout)
        self._ipp_kwargs = ipp_kwargs
        self._ipp = self._client = self._view = None
        self._ids: list[int] = []          # engine id of each rank
        self._info: list[dict] = []        # pid/host of each rank's engine
        self._procs: list[tuple[int, float]] = []  # every process we started: (pid, created)
        self._dead: dict[int, str] = {}
        self._stopped = True

    # -- life cycle ---------------------------------------------------------------------

    def _start(self) -> None:
        import ipyparallel as ipp

        if self.engines == "mpi":  # the mpich wheel's mpiexec sits next to this Python
            os.environ["PATH"] = os.path.dirname(sys.executable) + os.pathsep + os.environ["PATH"]
        kwargs = dict(n=self.world_size, engines=self.engines, log_level=logging.ERROR,
                      cluster_id=f"course-{uuid.uuid4().hex[:8]}", shutdown_atexit=True)
        if self.engines == "local":
            kwargs["controller_ip"] = "127.0.0.1"
        kwargs.update(self._ipp_kwargs)
        self._stopped = False
        _LIVE.add(self)
        try:
            self._ipp = ipp.Cluster(**kwargs)
            self._ipp.start_cluster_sync()
            self._record_launched()
            self._client = self._ipp.connect_client_sync()
            try:
                self._client.wait_for_engines(self.world_size, timeout=self.timeout,
                                              interactive=False)
            except TimeoutError:
                raise ClusterError(f"only {len(self._client.ids)} of {self.world_size} engines "
                                   f"started within {self.timeout:g}s") from None
            self._assign_ranks()
            self._init_process_group()
        except BaseException:
            self.stop()
            raise

    def _record_launched(self) -> None:
        """Remember the controller and engine launcher processes and all their descendants."""
        roots = [self._ipp.controller] + list(self._ipp.engines.values())
        for launcher in roots:
            for sub in getattr(launcher, "launchers", {}).values() or [launcher]:
                proc = getattr(sub, "process", None)
                if proc is not None:
                    self._remember(proc)

    def _remember(self, proc: psutil.Process) -> None:
        try:
            for p in [proc] + proc.children(recursive=True):
                entry = (p.pid, p.create_time())
                if entry not in self._procs:
                    self._procs.append(entry)
        except psutil.Error:
            pass

    def _assign_ranks(self) -> None:
        ids = sorted(self._client.ids)[: self.world_size]
        infos = self._client.direct_view(ids).apply_async(_engine_info).get(self.timeout)
        order = sorted(range(len(ids)), key=lambda i: (infos[i]["mpi_rank"] or 0, ids[i]))
        self._ids = [ids[i] for i in order]
        self._info = [infos[i] for i in order]
        local = socket.gethostname()
        for info in self._info:
            if info["host"] == local:
                self._remember(psutil.Process(info["pid"]))
        me = psutil.Process()
        watch = dict(client_pid=me.pid, client_created=me.create_time(), pids=self._procs)
        self._view = self._client.direct_view(self._ids)
        self._view.block = True  # `%%px` waits for its cell and shows the output
        self._view.use_cloudpickle()
        futures = [self._client[eid].apply_async(
                       _engine_setup, rank, self.world_size, self.backend,
                       watch if self._info[rank]["host"] == local else None)
                   for rank, eid in enumerate(self._ids)]
        self._gather(futures, "setting up engines", self.timeout)
        self._view.execute(_engine_namespace("none"), block=True)
        if _in_ipython():
            self._view.activate()  # %%px now runs on these ranks

    def _init_process_group(self) -> None:
        timeout, host = self.timeout, "127.0.0.1" if self.engines == "local" else None
        if self.backend == "gloo":
            rank0 = self._client[self._ids[0]]
            master = host or self._info[0]["host"]
            port = rank0.apply_async(_engine_free_port, master).get(timeout)
            kwargs = {"gloo_port": port, "master_addr": master}
        elif self.backend == "scratch":
            addrs = [self._client[eid].apply_async(
                         _engine_listen, host or self._info[r]["host"])
                     for r, eid in enumerate(self._ids)]
            kwargs = {"addresses": self._gather(addrs, "opening listening sockets", timeout),
                      "secret": secrets.token_bytes(32)}
        else:
            kwargs = {}
        futures = [self._client[eid].apply_async(_engine_init, self.backend, timeout, **kwargs)
                   for eid in self._ids]
        self._gather(futures, f"initializing the {self.backend!r} process group", timeout + 10)
        self._view.execute(_engine_namespace(self.backend), block=True)

    def restart(self) -> "Cluster":
        """Stop every engine and start fresh ones with the same world size, ranks and backend."""
        self.stop()
        self._dead.clear()
        self._start()
        return self

    def stop(self) -> None:
        """End every process this cluster started, by PID. Safe to call twice."""
        if self._stopped:
            return
        self._stopped = True
        _LIVE.discard(self)
        if self._ipp is not None:
            for launcher in [self._ipp.controller] + list(self._ipp.engines.values()):
                if launcher is not None and getattr(launcher, "process", None) is not None:
                    self._remember(launcher.process)
        if self._client is not None:
            try:
                self._client.close()
            except Exception:  # noqa: BLE001 - closing sockets only
                pass
        _kill_pids(self._procs)  # by PID first: ipyparallel's own stop waits 5 s per process
        if self._ipp is not None:
            try:
                self._ipp.stop_cluster_sync()  # tidies its launchers and cluster file
            except Exception as exc:  # noqa: BLE001 - the processes are already gone
                log.debug("ipyparallel stop: %s", exc)
        self._procs = []
        self._client = self._view = self._ipp = None

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
            raise TypeError(f"run() needs a function, got {type(fn).__name__}")
        self._check_usable()
        limit = self.run_timeout if timeout is None else float(timeout)
        futures = [self._client[eid].apply_async(fn, *args, **kwargs) for eid in self._ids]
        what = f"run({getattr(fn, '__name__', 'fn')})"
        try:
            return self._gather(futures, what, limit)
        except KeyboardInterrupt:
            self._interrupt([r for r, f in enumerate(futures) if not f.ready()], futures)
            raise

    def _check_usable(self) -> None:
        if self._stopped:
            raise ClusterError("this cluster is stopped; start a new one with "
                               "course_lib.cluster.start() or call .restart()")
        if self._dead:
            raise EngineDied("cluster unusable", self._dead,
                             "call .restart() to start fresh engines with the same ranks")

    def _gather(self, futures: list, what: str, limit: float) -> list[Any]:
        """Wait for one future per rank within `limit` seconds; raise naming failing ranks."""
        deadline = time.monotonic() + limit
        while (pending := [f for f in futures if not f.ready()]):
            if time.monotonic() > deadline or self._find_dead(futures):
                break
            pending[0].wait(POLL_SECONDS)
        dead = self._find_dead(futures)
        if dead:
            self._dead.update(dead)
            self._interrupt([r for r, f in enumerate(futures) if not f.ready()], futures)
            raise EngineDied(what, dead, "call .restart() to start fresh engines with the "
                             "same ranks")
        stuck = [r for r, f in enumerate(futures) if not f.ready()]
        if stuck:
            note = self._interrupt(stuck, futures)
            raise RankTimeout(what, {r: f"still running after {limit:g}s (a hang or deadlock?)"
                                     for r in stuck}, note)
        failures = {r: self._describe(f.exception()) for r, f in enumerate(futures)
                    if f.exception() is not None}
        if failures:
            raise RankError(what, failures)
        return [f.get() for f in futures]

    def _find_dead(self, futures: list) -> dict[int, str]:
        dead = {}
        local = socket.gethostname()
        for rank, info in enumerate(self._info):
            f = futures[rank] if rank < len(futures) else None
            exc = f.exception() if f is not None and f.ready() else None
            if exc is not None and "EngineError" in (type(exc).__name__,
                                                     getattr(exc, "ename", "")):
                dead[rank] = f"engine died ({self._describe(exc)})"
            elif info["host"] == local and not _running(info["pid"]):
                dead[rank] = f"engine process {info['pid']} died"
        return dead

    @staticmethod
    def _describe(exc: BaseException) -> str:
        ename = getattr(exc, "ename", type(exc).__name__)
        evalue = getattr(exc, "evalue", str(exc))
        return f"{ename}: {evalue}"

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
            return "the surviving ranks were interrupted"
        if all(futures[r].ready() for r in live):
            if self.backend in ("scratch", "gloo"):
                self._reset_process_group()
                return ("the stuck ranks were interrupted and the process group rebuilt; "
                        "the cluster is ready")
            return "the stuck ranks were interrupted; the cluster is ready"
        self.restart()
        return ("interrupting did not stop them, so the engines were restarted "
                "(engine-side state is lost) and the process group rebuilt")

    def _reset_process_group(self) -> None:
        """Rebuild the process group: an interrupted collective leaves messages in flight."""
        try:
            self._init_process_group()
        except ClusterError:
            self.restart()
