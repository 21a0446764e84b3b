"""A cluster's engines made ranks, for `Cluster` (`course_lib.cluster.client`), whose base class
`RankedEngines` is: the engines ordered (by MPI rank, then engine id), each told its rank, the
world size and what to run first (`STARTUP`), `%%px` pointed at them in rank order, and the
backend's process group set up among them through `course_lib.backend`'s rendezvous.
"""

from __future__ import annotations

import os
import socket
from typing import Any, Callable

from course_lib import backend as backends
from course_lib.cluster import calls, engine, launch
from course_lib.i18n import _, current


def _in_ipython() -> bool:
    try:
        from IPython import get_ipython
    except ImportError:
        return False
    return get_ipython() is not None


# Called on every engine as it becomes a rank: what the course registers (its overlay); a
# callable of an importable module, so that it travels by name.
STARTUP: list[Callable[[], None]] = []


class RankedEngines:
    """The ranks of a cluster's engines and their process group. What it reads of the cluster:
    `world_size`, `backend`, `engines`, `joining`, `timeout`, `_ipp_kwargs`, `_ipp`, `_client`
    and `_procs`; what it sets: `_ids` (the engine id of each rank), `_info` (pid and host of
    each rank's engine), `_view` and `_rendezvous` (what every rank's init got)."""

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
        self._give_ranks(launch.watchdog(self._procs.recorded))

    def _give_ranks(self, watch: dict | None) -> None:
        """Tell each engine of `self._ids` its rank and the world size (and, once, to watch
        this client); `%%px` then runs on them in rank order."""
        local = socket.gethostname()
        self._view = self._client.direct_view(self._ids)
        self._view.block = True  # `%%px` waits for its cell and shows the output
        self._view.use_cloudpickle()
        futures = [self._client[eid].apply_async(
                       engine.setup, rank, self.world_size, self.backend,
                       watch if self._info[rank]["host"] == local else None, current(),
                       list(STARTUP))
                   for rank, eid in enumerate(self._ids)]
        calls.gather(self, futures, _("setting up engines"), self.timeout)
        if _in_ipython():
            self._view.activate()  # %%px now runs on these ranks

    def join_instructions(self) -> str:
        """What to run on the other machines so that the joining engines arrive."""
        return _("waiting {limit}s for {k} engine(s) from other machines: copy {path} to each "
                 "(scp: it holds the cluster's key) and run there: python3 course.py engines "
                 "COUNT --file ipcontroller-engine.json", limit=f"{self.timeout:g}",
                 k=self.joining, path=launch.connection_file(self._ipp))

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
        addresses = calls.gather(self, self._on_all(engine.prepare_backend, self.backend,
                                                    self._location()),
                                 _("opening listening sockets"), timeout)
        kwargs = backends.rendezvous(self.backend, addresses)
        self._rendezvous, sent = kwargs, kwargs
        key = self._client.session.key
        if "secret" in kwargs and key:
            nonce = os.urandom(16)
            self._rendezvous = {**kwargs, "secret": backends.derive_secret(key, nonce)}
            sent = {**kwargs, "secret": None, "nonce": nonce}
        calls.gather(self, self._on_all(engine.init_backend, self.backend, timeout, **sent),
                     _("initializing the {backend!r} process group", backend=self.backend),
                     timeout + 10)
