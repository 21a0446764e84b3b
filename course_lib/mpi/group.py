"""MPI's world and groups: launching under mpiexec, init_process_group, ranks, new_group."""

from __future__ import annotations

import importlib.util
import os
import sys
from datetime import timedelta
from pathlib import Path
from typing import Any, Sequence

from course_lib.dist.work import seconds
from course_lib.i18n import _
from course_lib.processes import run_session

DEFAULT_TIMEOUT = 300.0


_state: dict[str, Any] = {}


def unavailable() -> str | None:
    """None if MPI programs can run here, else why not (what to install)."""
    if importlib.util.find_spec("mpi4py") is None:
        return _("mpi4py is not importable (pip install mpi4py mpich)")
    if not (Path(sys.executable).parent / "mpiexec").exists():
        return _("no mpiexec next to {python} (pip install mpich)", python=sys.executable)
    return None


def launch(world_size: int, args: Sequence[str], timeout: float,
           env: dict[str, str] | None = None) -> str:
    """Run `python ARGS` on `world_size` processes under the mpiexec next to this Python and
    return its stdout (`env`: extra variables, e.g. MPICH's MPIR_CVAR_* to force an
    algorithm), in its own process group, ended if it outlives `timeout` (`run_session`)."""
    why = unavailable()
    if why:
        raise RuntimeError(_("course_lib.mpi: cannot run mpiexec: {why}", why=why))
    cmd = [str(Path(sys.executable).parent / "mpiexec"), "-n", str(world_size), sys.executable,
           *args]
    return run_session(cmd, timeout, f"mpiexec -n {world_size}", env).stdout


def _MPI():
    from mpi4py import MPI

    return MPI


class Group:
    """A communicator and its members' global ranks (what `new_group` returns)."""

    def __init__(self, comm: Any, ranks: list[int]):
        self.comm, self.ranks = comm, ranks

    def __repr__(self) -> str:
        return f"mpi.Group(ranks={self.ranks})"


def init_process_group(backend: str = "mpi", *, timeout: float | timedelta = DEFAULT_TIMEOUT,
                       **_ignored: Any) -> None:
    """Use MPI_COMM_WORLD as the world. Needs processes started by mpiexec."""
    if backend != "mpi":
        raise ValueError(_("course_lib.mpi runs the 'mpi' backend, got {backend!r}",
                           backend=backend))
    if not any(k in os.environ for k in ("PMI_RANK", "PMIX_RANK", "OMPI_COMM_WORLD_RANK",
                                        "PMI_FD", "PMI_PORT", "HYDI_CONTROL_FD")):
        raise RuntimeError(_("course_lib.mpi: this process was not started by mpiexec; run "
                             "`mpiexec -n N python ...` or "
                             "course_lib.cluster.start(engines='mpi')"))
    MPI = _MPI()
    world = MPI.COMM_WORLD
    _state.update(world=Group(world, list(range(world.Get_size()))), timeout=seconds(timeout))


def is_initialized() -> bool:
    return "world" in _state


def destroy_process_group() -> None:
    _state.clear()


def get_backend(group: Group | None = None) -> str:
    return "mpi"


def _group(group: Group | None, name: str) -> Group:
    if not _state:
        raise RuntimeError(_("course_lib.mpi.{name}: call init_process_group() first",
                             name=name))
    g = _state["world"] if group is None else group
    if g.comm == _MPI().COMM_NULL:
        raise RuntimeError(_("rank {rank}: {name}: this rank is not a member of group {ranks}",
                             rank=_state["world"].comm.Get_rank(), name=name, ranks=g.ranks))
    return g


def get_rank(group: Group | None = None) -> int:
    return _group(group, "get_rank").comm.Get_rank()


def get_world_size(group: Group | None = None) -> int:
    return _group(group, "get_world_size").comm.Get_size()


def get_global_rank(group: Group, group_rank: int) -> int:
    return _group(group, "get_global_rank").ranks[group_rank]


def get_process_group_ranks(group: Group | None) -> list[int]:
    return list(_group(group, "get_process_group_ranks").ranks)


def new_group(ranks: Sequence[int] | None = None, **_: Any) -> Group:
    """A communicator of `ranks` (collective over the world, as torch's new_group is)."""
    world = _group(None, "new_group")
    ranks = sorted(ranks) if ranks is not None else list(world.ranks)
    comm = world.comm.Create(world.comm.Get_group().Incl(ranks))
    return Group(comm, ranks)
