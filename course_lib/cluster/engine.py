"""The engine side of a cluster: what each engine runs to become a rank.

The client (`course_lib.cluster.client`) calls these functions on every engine with
ipyparallel's `apply`: `info` (who am I), `setup` (my rank, and a watchdog on the client),
`prepare_backend`/`init_backend` (the process group, through `course_lib.backend`) and
`install_globals`, which gives `%%px` cells their `rank`, `world_size`, `torch` and `dist`.
Plain functions of this module, so they are imported, not shipped as code strings.
"""

from __future__ import annotations

import os
import socket
import sys
import threading
import time
from typing import Any, Callable, Sequence

import psutil

from course_lib import backend as backends
from course_lib.processes import Recorded, end_processes
from course_lib.i18n import LANG_ENV, _

_STATE: dict[str, Any] = {}  # this engine's rank, world size and backend, once set up


def get_rank() -> int:
    """This engine's rank (engine side)."""
    return _STATE["rank"]


def get_world_size() -> int:
    """The number of ranks in this cluster (engine side)."""
    return _STATE["world_size"]


def info() -> dict:
    """This engine's process and host, and its MPI rank when mpiexec started it."""
    found = {"pid": os.getpid(), "ppid": os.getppid(), "host": socket.gethostname(),
             "mpi_rank": None}
    if "mpi4py" in sys.modules or os.environ.get("PMI_RANK") is not None:
        from mpi4py import MPI

        found["mpi_rank"] = MPI.COMM_WORLD.Get_rank()
    return found


def setup(rank: int, world_size: int, backend: str, watch: dict | None = None,
          lang: str | None = None, startup: Sequence[Callable[[], None]] = ()) -> None:
    """Become rank `rank`; with `watch`, end this engine when the client process is gone;
    messages in the client's language `lang` (the Spanish edition's errors are Spanish); then
    call what the client registered to run on every engine (`client.STARTUP`)."""
    import torch


    if lang:
        os.environ[LANG_ENV] = lang
    torch.set_num_threads(1)
    for call in startup:
        call()
    _STATE.update(rank=rank, world_size=world_size, backend=backend)
    install_globals("none")  # `dist` arrives with the process group
    if watch is not None:
        threading.Thread(target=watch_client, kwargs=watch, daemon=True,
                         name="course-lib-watch-client").start()


def watch_client(client_pid: int, client_created: float, pids: list[Recorded],
                 poll: float = 1.0) -> None:
    """End this engine and the cluster's other processes once the client is gone (e.g. it was
    SIGKILLed and could not stop them itself)."""
    while True:
        time.sleep(poll)
        try:
            alive = psutil.Process(client_pid).create_time() == client_created
        except psutil.NoSuchProcess:
            alive = False
        if not alive:
            end_processes(pids)
            os._exit(1)


def address_toward(location: str) -> str:
    """This host's address on the route to `location` (the interface other hosts reach us on),
    or its host name when there is no route or no location."""
    if location:
        try:
            with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
                s.connect((location, 9))  # UDP: picks the route, sends nothing
                return s.getsockname()[0]
        except OSError:
            pass
    return socket.gethostname()


def prepare_backend(backend: str, location: str | None) -> tuple[str, int] | None:
    """The address this rank offers for the rendezvous (`course_lib.backend.prepare`): on
    loopback when every engine is on this machine (`location` None), else on the interface
    that routes toward the controller's `location`."""
    host = "127.0.0.1" if location is None else address_toward(location)
    return backends.prepare(backend, _STATE["rank"], host)


def _session_key() -> bytes:
    """ipyparallel's key, from this engine's connection file (never sent by the client)."""
    from IPython import get_ipython

    shell = get_ipython()
    key = getattr(getattr(getattr(shell, "kernel", None), "session", None), "key", b"")
    if not key:
        raise RuntimeError(_("this engine has no ipyparallel key to derive the secret from"))
    return key


def init_backend(backend: str, timeout: float, nonce: bytes | None = None,
                 **kwargs: Any) -> None:
    """Join the process group once every rank's address is known; `%%px` then sees `dist`.
    With `nonce`, the scratch secret is derived here from ipyparallel's key."""
    if nonce is not None:
        kwargs["secret"] = backends.derive_secret(_session_key(), nonce)
    backends.init(backend, _STATE["rank"], _STATE["world_size"], timeout=timeout, **kwargs)
    _STATE["backend"] = backend
    install_globals(backend)


def px_globals(backend: str | None = None) -> dict[str, Any]:
    """The names a `%%px` cell sees: `rank`, `world_size`, `torch`, and `dist` (the backend's
    module), or `MPI` and `comm` under the mpi backend."""
    import torch

    backend = _STATE["backend"] if backend is None else backend
    names: dict[str, Any] = {"torch": torch, "rank": get_rank(), "world_size": get_world_size()}
    if backend == "mpi":
        from mpi4py import MPI

        names.update(MPI=MPI, comm=MPI.COMM_WORLD)
    elif backend in ("scratch", "gloo"):
        names["dist"] = backends.dist_module(backend)
    return names


def install_globals(backend: str | None = None) -> list[str]:
    """Put `px_globals` into the engine's interactive (IPython) namespace; returns the names
    (none outside IPython, where no `%%px` cell can run)."""
    try:
        from IPython import get_ipython
    except ImportError:
        return []
    shell = get_ipython()
    if shell is None:
        return []
    names = px_globals(backend)
    shell.user_ns.update(names)
    return sorted(names)
