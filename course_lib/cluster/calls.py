"""Calling every rank of a cluster within a limit: results in rank order, or an error that
names each failing rank; stuck ranks interrupted (or their engines restarted), dead engines
found by ipyparallel's word, their local PID, or a remote port that refuses."""

from __future__ import annotations

import logging
import signal
import socket
import time
from typing import TYPE_CHECKING, Any

from course_lib import dist
from course_lib.cluster.errors import ClusterError, EngineDied, RankError, RankTimeout
from course_lib.dist.transport import is_listening, query_record
from course_lib.i18n import _
from course_lib.processes import running

if TYPE_CHECKING:
    from course_lib.cluster.client import Cluster

POLL_SECONDS = 0.05
PROBE_SECONDS = 1.0  # how often a rank on another host is checked for a live listener
INTERRUPT_GRACE = 5.0  # seconds a rank gets to unwind after SIGINT before its engines restart

log = logging.getLogger(__name__)


def describe(exc: BaseException) -> str:
    """'Name: message' of an exception, or of ipyparallel's RemoteError standing for one."""
    ename = getattr(exc, "ename", type(exc).__name__)
    evalue = getattr(exc, "evalue", str(exc))
    return f"{ename}: {evalue}"


def dead_ranks(futures: list, infos: list[dict],
               probe: dict[int, tuple[str, int]] | None = None) -> dict[int, str]:
    """Ranks whose engine died: reported so by ipyparallel, its local process gone, or (ranks of
    `probe`, on other hosts, while their call is pending) its listening port refusing."""
    dead = {}
    local = socket.gethostname()
    for rank, info in enumerate(infos):
        f = futures[rank] if rank < len(futures) else None
        exc = f.exception() if f is not None and f.ready() else None
        if exc is not None and "EngineError" in (type(exc).__name__, getattr(exc, "ename", "")):
            dead[rank] = _("engine {pid} on {host} died ({error})", pid=info["pid"],
                           host=info["host"], error=describe(exc))
        elif info["host"] == local and not running(info["pid"]):
            dead[rank] = _("engine process {pid} died", pid=info["pid"])
        elif (probe and rank in probe and f is not None and not f.ready()
              and not is_listening(probe[rank], PROBE_SECONDS)):
            dead[rank] = _("engine {pid} on {host} is gone (its port {port} refuses "
                           "connections)", pid=info["pid"], host=info["host"],
                           port=probe[rank][1])
    return dead


def gather(cluster: "Cluster", futures: list, what: str, limit: float) -> list[Any]:
    """Wait for one future per rank within `limit` seconds; raise naming failing ranks."""
    deadline = time.monotonic() + limit
    addresses = cluster._rendezvous.get("addresses")
    probe = {r: addresses[r] for r in cluster._remote()} if addresses else {}
    next_probe = time.monotonic() + PROBE_SECONDS
    while (pending := [f for f in futures if not f.ready()]):
        now = time.monotonic()
        if now > deadline or dead_ranks(futures, cluster._info,
                                        probe if now >= next_probe else None):
            break
        next_probe = now + PROBE_SECONDS if now >= next_probe else next_probe
        pending[0].wait(POLL_SECONDS)
    dead = dead_ranks(futures, cluster._info, probe)
    if dead:
        cluster._dead.update(dead)
        interrupt(cluster, [r for r, f in enumerate(futures) if not f.ready()], futures)
        raise EngineDied(what, dead, _("call .restart() to start fresh engines with the "
                                       "same ranks"))
    stuck = [r for r, f in enumerate(futures) if not f.ready()]
    if stuck:
        note = interrupt(cluster, stuck, futures)
        late = _("still running after {limit}s (a hang or deadlock?)", limit=f"{limit:g}")
        raise RankTimeout(what, dict.fromkeys(stuck, late), note)
    failures = {r: describe(f.exception()) for r, f in enumerate(futures)
                if f.exception() is not None}
    if failures:
        raise RankError(what, failures)
    return [f.get() for f in futures]


def interrupt(cluster: "Cluster", ranks: list[int], futures: list) -> str:
    """SIGINT the given ranks; if they do not unwind, restart all engines. Says which."""
    if not ranks:
        return ""
    live = [r for r in ranks if r not in cluster._dead]
    try:
        cluster._client.send_signal(signal.SIGINT, targets=[cluster._ids[r] for r in live],
                                    block=True)
    except Exception as exc:  # noqa: BLE001 - fall through to the restart below
        log.warning("interrupting ranks %s failed: %s", live, exc)
    deadline = time.monotonic() + INTERRUPT_GRACE
    while time.monotonic() < deadline and not all(futures[r].ready() for r in live):
        time.sleep(POLL_SECONDS)
    if cluster._dead:
        return _("the surviving ranks were interrupted")
    if all(futures[r].ready() for r in live):
        if cluster.backend in ("scratch", "gloo"):
            cluster._reset_process_group()
            return _("the stuck ranks were interrupted and the process group rebuilt; "
                     "the cluster is ready")
        return _("the stuck ranks were interrupted; the cluster is ready")
    cluster.restart()
    return _("interrupting did not stop them, so the engines were restarted "
             "(engine-side state is lost) and the process group rebuilt")


def flight_records(cluster: "Cluster", timeout: float) -> list[dict | None]:
    """Every rank's flight record, asked of each rank's listener (not its kernel, which may be
    busy or stuck); None for a rank that does not answer within `timeout`."""
    if cluster.backend != "scratch":
        raise ClusterError(_("flight records come from the scratch backend; this cluster "
                             "runs {backend!r}", backend=cluster.backend))
    addresses, secret = cluster._rendezvous["addresses"], cluster._rendezvous["secret"]
    n = cluster.world_size
    return [query_record(addresses[r], secret, (r + 1) % n, r, timeout) if n > 1 else
            cluster.run(_own_flight_record)[0] for r in range(n)]


def _own_flight_record() -> dict:
    return dist.flight_record()
