"""Which process group a component talks to, and how each backend is set up and torn down.

The one home of backend choice: components call `default_dist(dist)` (the `dist`-like contract
in CONTRIBUTING.md) and `global_rank(dist, group, r)`; `course_lib.spawn` and
`course_lib.cluster` set a backend up in three steps, the same for both:

    address = prepare(backend, rank, host)              # on every rank
    kwargs = rendezvous(backend, [address of each rank])  # in the parent / client
    init(backend, rank, world_size, timeout=..., **kwargs)  # on every rank
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import socket
import sys
from datetime import timedelta
from typing import Any
from course_lib import dist as scratch
from course_lib import dist
from course_lib import mpi
from course_lib.i18n import _

BACKENDS = ("scratch", "gloo", "mpi", "none")
DEFAULT_BACKEND = "scratch"


class Availability:
    """Whether the scratch backend can run here, and the default backend: the package alone
    always can. The course registers its own answer (`course_lib.course.overlay`: in a student
    release, lesson 01's wire format is the learner's, and runs once its checks pass)."""

    def scratch_written(self) -> bool:
        return True

    def default(self) -> str:
        return DEFAULT_BACKEND


_availability = Availability()


def set_availability(rule: Availability) -> None:
    """Install the rule `default_backend` and `check_backend` follow (the course's overlay)."""
    global _availability
    _availability = rule


def default_backend() -> str:
    """"scratch", unless the registered rule says otherwise (a student release whose wire
    format the learner has not finished: then "gloo", said by the rule in one line)."""
    return _availability.default()


def check_backend(backend: str, engines: str | None = None) -> None:
    """ValueError unless `backend` is known and can run on processes started by `engines`
    ("mpi" for mpiexec; None for plain local processes, as `spawn` starts)."""
    if backend not in BACKENDS:
        raise ValueError(_("unknown backend {backend}; choose one of {choices}",
                           backend=repr(backend), choices=", ".join(BACKENDS)))
    if backend == "scratch" and not _availability.scratch_written():
        raise ValueError(_('backend="scratch" runs on your lesson 01 wire format, which this '
                           "student release does not ship and you have not exported yet: "
                           'complete lesson 01, or use backend="gloo"'))
    if backend == "mpi" and engines != "mpi":
        use = 'engines="mpi"' if engines is not None else 'course_lib.cluster.start(engines="mpi")'
        raise ValueError(_('backend="mpi" needs processes started by mpiexec: use {use}',
                           use=use))


def default_dist(dist: Any = None) -> Any:
    """The `dist`-like module to use: the one given, else torch.distributed if it is
    initialized, else `course_lib.mpi` if it is, else `course_lib.dist`."""
    if dist is not None:
        return dist
    import torch.distributed as tdist

    if tdist.is_available() and tdist.is_initialized():
        return tdist
    mpi = sys.modules.get("course_lib.mpi")
    if mpi is not None and mpi.is_initialized():
        return mpi

    return scratch


def comm_device(dist: Any = None, group: Any = None) -> Any:
    """Where `dist` wants small *control* tensors (shape signatures, JSON bytes, flags, loss
    shares): the current CUDA device for a group whose backend is NCCL only, else the CPU
    (gloo, the scratch backend, MPI, and "cpu:gloo,cuda:nccl", whose CPU tensors travel over
    gloo). *Data* tensors (buckets, flat buffers, shards) go on their parameters' device."""
    import torch

    dist = default_dist(dist)
    get_backend = getattr(dist, "get_backend", None)
    try:
        backend = str(get_backend(group)) if get_backend is not None else "scratch"
    except (RuntimeError, ValueError, TypeError):  # no group initialized: nothing to talk to
        backend = "none"
    if "nccl" in backend.lower() and "cpu:" not in backend.lower():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def global_rank(dist: Any, group: Any, group_rank: int) -> int:
    """The global rank of `group`'s member number `group_rank` (src/dst take global ranks, as in
    torch); the world (group None) maps every rank to itself."""
    if group is None:
        return group_rank
    return dist.get_global_rank(group, group_rank)


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free a moment ago (the usual rendezvous race applies)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


_gloo_store: Any = None  # rank 0's TCPStore, listening since `prepare`, for `init` to use


def prepare(backend: str, rank: int, host: str = "127.0.0.1") -> tuple[str, int] | None:
    """Step 1, on each rank: the address this rank offers, if its backend needs one
    (scratch: this rank's listening socket; gloo: rank 0's store, already listening: a port
    only chosen here could be taken by another process before `init` binds it)."""
    global _gloo_store
    if backend == "scratch":
        shutdown("scratch")  # a rebuild: close the old group before opening a new socket
        return dist.listen(host)
    if backend == "gloo" and rank == 0:
        from torch.distributed import TCPStore

        _gloo_store = TCPStore(host, 0, is_master=True, wait_for_workers=False)
        return host, _gloo_store.port
    return None


def rendezvous(backend: str, addresses: list[tuple[str, int] | None]) -> dict[str, Any]:
    """Step 2, in one place: the keyword arguments every rank passes to `init`."""
    if backend == "scratch":
        return {"addresses": [tuple(a) for a in addresses], "secret": secrets.token_bytes(32)}
    if backend == "gloo":
        master_addr, gloo_port = addresses[0]
        return {"master_addr": master_addr, "gloo_port": gloo_port}
    return {}


def derive_secret(key: bytes, nonce: bytes) -> bytes:
    """A scratch secret from a key every rank already holds (ipyparallel's, from its connection
    file) and a fresh nonce: the cluster sends only the nonce, so the secret never crosses the
    network."""
    return hmac.new(key, b"course_lib.dist secret\0" + nonce, hashlib.sha256).digest()


def init(backend: str, rank: int, world_size: int, *, timeout: float,
         gloo_port: int | None = None, master_addr: str = "127.0.0.1",
         addresses: list | None = None, secret: bytes | None = None) -> None:
    """Step 3, on each rank: initialize `backend` in this process (one intra-op thread)."""
    import torch

    torch.set_num_threads(1)
    shutdown(backend)
    if backend == "gloo":
        import torch.distributed as tdist

        wait = timedelta(seconds=timeout)
        if rank == 0 and _gloo_store is not None and _gloo_store.port == gloo_port:
            store = _gloo_store  # opened by `prepare`; the others connect to it
            store.set_timeout(wait)
        else:
            store = tdist.TCPStore(master_addr, gloo_port, is_master=rank == 0, timeout=wait,
                                   wait_for_workers=False)
        tdist.init_process_group("gloo", store=store, rank=rank, world_size=world_size,
                                 timeout=wait)
    elif backend == "scratch":
        dist.init_process_group("scratch", rank=rank, world_size=world_size,
                                addresses=addresses, secret=secret, timeout=timeout)
    elif backend == "mpi":
        mpi.init_process_group(timeout=timeout)
        if mpi.get_rank() != rank:
            raise RuntimeError(_("MPI rank {mpi_rank} and rank {rank} disagree",
                                 mpi_rank=mpi.get_rank(), rank=rank))
    elif backend != "none":
        check_backend(backend)  # raises: unknown backend


def torchrun_init(device: str = "auto", env: Any = None) -> Any:
    """Set up torch.distributed in a process torchrun started (RANK, WORLD_SIZE, LOCAL_RANK,
    MASTER_ADDR in the environment) and return this rank's device, by the launch contract:
    with CUDA, `torch.cuda.set_device(LOCAL_RANK)` *before* init, then the group
    "cpu:gloo,cuda:nccl" bound to that GPU (`device_id`; CPU control tensors over gloo, CUDA
    data over NCCL); without, gloo on the CPU. `device`: "cpu", "cuda", "cuda:N", or "auto"
    (CUDA when every rank of this node has a GPU of its own, else the CPU). RANK is never a
    device index: on the second node it is larger than the GPU count."""
    import os

    import torch
    import torch.distributed as tdist

    env = os.environ if env is None else env
    local = env.get("LOCAL_RANK")
    if device == "auto":
        gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
        per_node = int(env.get("LOCAL_WORLD_SIZE", "1"))
        device = "cuda" if local is not None and 0 < per_node <= gpus else "cpu"
    if device == "cpu":
        tdist.init_process_group("gloo")
        return torch.device("cpu")
    if not device.startswith("cuda") or not torch.cuda.is_available():
        raise ValueError(_("device={device}: choose 'auto', 'cpu', 'cuda' or 'cuda:N' (CUDA "
                           "needs a torch that sees a GPU: torch.cuda.is_available()={available})",
                           device=repr(device), available=torch.cuda.is_available()))
    if device == "cuda":
        if local is None:
            raise RuntimeError(_('device="cuda" under a launcher needs LOCAL_RANK (torchrun '
                                 "sets it) to pick this rank's GPU"))
        index = int(local)
    else:
        index = torch.device(device).index
    chosen = torch.device("cuda", index)
    torch.cuda.set_device(chosen)  # before init: NCCL binds its communicator to it
    tdist.init_process_group("cpu:gloo,cuda:nccl", device_id=chosen)
    return chosen


def shutdown(backend: str) -> None:
    """Tear down whatever `init` set up, ignoring a group that is already gone."""
    try:
        if backend == "gloo":
            import torch.distributed as tdist

            if tdist.is_initialized():
                tdist.destroy_process_group()
        elif backend == "scratch":
            if dist.is_initialized():
                dist.destroy_process_group()
        elif backend == "mpi":
            mpi.destroy_process_group()
    except Exception:  # noqa: BLE001 - best effort at exit
        pass


def dist_module(backend: str) -> Any:
    """What `%%px` cells see as `dist` for `backend` (None when there is no process group)."""
    if backend == "scratch":
        return dist
    if backend == "gloo":
        import torch.distributed as tdist

        return tdist
    if backend == "mpi":
        return mpi
    return None
