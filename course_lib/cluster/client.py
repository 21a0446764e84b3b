"""The client side of a cluster: `start()` and the `Cluster` a notebook (or test) holds.

It launches the engines, gives them ranks, runs the backend's rendezvous through
`course_lib.cluster.engine`, and gathers per-rank results within a limit, interrupting or
restarting ranks that hang. Every process it started is ended by PID (`course_lib.processes`).

Giving the engines their ranks and their process group is `RankedEngines`'s, its base class
(`course_lib.cluster.ranks`).
"""

from __future__ import annotations

import atexit
import logging
from typing import Any, Callable

from course_lib import backend as backends
from course_lib.cluster import calls, launch
from course_lib.cluster.errors import ClusterError, EngineDied
from course_lib.cluster.ranks import STARTUP, RankedEngines
from course_lib.processes import ProcessSet
from course_lib.i18n import _

__all__ = ["POLL_SECONDS", "STARTUP", "PROBE_SECONDS", "start", "Cluster"]

POLL_SECONDS = 0.05

log = logging.getLogger(__name__)

_LIVE: set["Cluster"] = set()


def _stop_all_at_exit() -> None:
    for cluster in list(_LIVE):
        cluster.stop()


atexit.register(_stop_all_at_exit)


PROBE_SECONDS = 1.0  # how often a rank on another host is checked for a live listener


def start(n: int = 4, *, backend: str | None = None, engines: str = "local",
          timeout: float = 60.0, run_timeout: float = 300.0, joining: int = 0,
          **ipp_kwargs: Any) -> "Cluster":
    """Start `n` engines with ranks 0..n-1 and the `backend` process group on each.

    `timeout` bounds start-up and the process group's blocking operations; `run_timeout` is
    the default limit of `Cluster.run`. `engines` picks the ipyparallel launcher ("local",
    "mpi", "ssh", "slurm", ...); extra keyword arguments go to `ipyparallel.Cluster`. The
    default backend is "scratch" (`course_lib.backend.default_backend`). With `joining=k`,
    only n-k engines start here and k join from other machines (`python3 course.py engines`,
    see docs/multihost.md); `controller_ip` must then be an address they reach.
    """
    backend = backends.default_backend() if backend is None else backend
    cluster = Cluster(n, backend=backend, engines=engines, timeout=timeout,
                      run_timeout=run_timeout, joining=joining, **ipp_kwargs)
    cluster._start()
    return cluster


class Cluster(RankedEngines):
    """A running set of ranked engines. Use as a context manager so it always stops."""

    def __init__(self, n: int, *, backend: str, engines: str, timeout: float,
                 run_timeout: float, joining: int = 0, **ipp_kwargs: Any):
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ValueError(_("n must be a positive number of engines, got {n!r}", n=n))
        launch.check_options(n, backend, engines, timeout, run_timeout, joining, ipp_kwargs)
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
        try:
            self._start_once()
        except launch.ControllerPortsTaken:  # a race with another process: new ports, once
            self._start_once()

    def _start_once(self) -> None:
        self._stopped = False
        _LIVE.add(self)
        try:
            self._ipp = launch.ipp_cluster(self.world_size - self.joining, self.engines,
                                           self._ipp_kwargs, self.joining)
            forked: list[tuple[int, str]] = []
            if self.engines == "local":  # forked from the zygote, torch already imported
                self._ipp.start_controller_sync()
                forked = launch.fork_engines(self._ipp, self.world_size - self.joining,
                                             self.timeout, self._procs)
            else:
                self._ipp.start_cluster_sync()
            for proc in launch.launched(self._ipp):
                self._procs.add(proc)
            self._client = self._ipp.connect_client_sync()
            if self.joining:
                print(self.join_instructions(), flush=True)
            launch.wait_for_engines(self._ipp, self._client, self.world_size, self.timeout,
                                    forked)
            self._assign_ranks()
            self._init_process_group()
        except BaseException:
            self.stop()
            raise

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
            raise ClusterError(_("shrink: this cluster is stopped"))
        if not self._dead:
            raise ClusterError(_("shrink: no rank has died, so there is nothing to drop"))
        if self.backend == "mpi":
            raise ClusterError(_("shrink: an MPI world cannot lose ranks; call .restart()"))
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
        for proc in launch.launched(self._ipp):
            self._procs.add(proc)
        if self._client is not None:
            try:
                launch.shut_down_remote(self._client, [self._ids[r] for r in self._remote()])
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

    def __enter__(self) -> "Cluster":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    def __repr__(self) -> str:
        state = "stopped" if self._stopped else f"engines {self._ids}"
        return f"<Cluster world_size={self.world_size} backend={self.backend!r} {state}>"

    # -- running code -------------------------------------------------------------------

    @property
    def view(self) -> Any:
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
            return calls.gather(self, futures, what, limit)
        except KeyboardInterrupt:
            calls.interrupt(self, [r for r, f in enumerate(futures) if not f.ready()], futures)
            raise

    def flight_records(self, timeout: float = 5.0) -> list[dict | None]:
        """Every rank's flight record (course_lib.dist's last collectives per group), in rank
        order, even while the engines are busy or stuck: each rank's listener answers, not its
        kernel. None for a rank that does not answer within `timeout`."""
        self._check_usable()
        return calls.flight_records(self, timeout)

    def _check_usable(self) -> None:
        if self._stopped:
            raise ClusterError(_("this cluster is stopped; start a new one with "
                                 "course_lib.cluster.start() or call .restart()"))
        if self._dead:
            raise EngineDied(_("cluster unusable"), self._dead,
                             _("call .restart() to start fresh engines with the same ranks"))

    def _reset_process_group(self) -> None:
        """Rebuild the process group: an interrupted collective leaves messages in flight."""
        try:
            self._init_process_group()
        except ClusterError:
            self.restart()
