"""The engine side of a cluster and the backend seam, as ordinary code in this process: what
`%%px` cells see, the rendezvous arguments each backend gets, and the client watchdog."""

from __future__ import annotations

import socket
import subprocess
import sys
import textwrap

import psutil
import pytest
import torch.distributed

from course_lib import backend, dist
from course_lib.cluster import engine
from course_lib.processes import end_processes, record


@pytest.fixture
def as_rank(monkeypatch):
    monkeypatch.setattr(engine, "_STATE", {})
    engine.setup(2, 4, "none")
    return engine


def test_setup_gives_rank_and_px_globals(as_rank):
    assert (engine.get_rank(), engine.get_world_size()) == (2, 4)
    names = engine.px_globals("none")
    assert names["rank"] == 2 and names["world_size"] == 4 and "dist" not in names
    assert engine.px_globals("scratch")["dist"] is dist
    assert engine.px_globals("gloo")["dist"] is torch.distributed
    assert engine.install_globals("none") == []  # no IPython shell in this process


def test_install_globals_fills_the_interactive_namespace(as_rank, monkeypatch):
    import IPython

    shell = type("Shell", (), {"user_ns": {}})()
    monkeypatch.setattr(IPython, "get_ipython", lambda: shell)
    assert engine.install_globals("scratch") == ["dist", "rank", "torch", "world_size"]
    assert shell.user_ns["dist"] is dist and shell.user_ns["rank"] == 2


def test_rendezvous_arguments_per_backend():
    addresses = [("127.0.0.1", 5000 + r) for r in range(3)]
    scratch = backend.rendezvous("scratch", addresses)
    assert scratch["addresses"] == addresses and len(scratch["secret"]) == 32
    assert backend.rendezvous("scratch", addresses)["secret"] != scratch["secret"]
    assert backend.rendezvous("gloo", [("10.0.0.1", 29500), None, None]) == \
        {"master_addr": "10.0.0.1", "gloo_port": 29500}
    assert backend.rendezvous("none", [None] * 3) == {}
    assert backend.prepare("none", 0) is None and backend.prepare("gloo", 1) is None
    host, port = backend.prepare("gloo", 0)
    assert host == "127.0.0.1" and port > 0


def test_gloo_rank_0_listens_from_prepare_on():
    """The port rank 0 offers is its store's, bound already: nothing can take it between the
    rendezvous and init (a port merely chosen could be), and two prepares get two ports."""
    _, port = backend.prepare("gloo", 0)
    with socket.create_connection(("127.0.0.1", port), timeout=5):
        pass
    with pytest.raises(OSError):
        socket.create_server(("127.0.0.1", port))
    assert backend.prepare("gloo", 0)[1] != port


def test_backend_checks_name_the_problem():
    with pytest.raises(ValueError, match="unknown backend 'nccl'"):
        backend.check_backend("nccl")
    with pytest.raises(ValueError, match="mpiexec"):
        backend.check_backend("mpi")
    backend.check_backend("mpi", engines="mpi")
    assert backend.global_rank(dist, None, 3) == 3


def test_watchdog_ends_recorded_processes_when_the_client_is_gone():
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        client = subprocess.Popen([sys.executable, "-c", "pass"])
        created = psutil.Process(client.pid).create_time()
        client.wait()  # the client is gone (exited and reaped)
        code = textwrap.dedent(f"""
            from course_lib.cluster import engine
            engine.watch_client({client.pid}, {created}, {record(sleeper.pid)!r}, poll=0.1)
        """)
        watcher = subprocess.run([sys.executable, "-c", code], timeout=30)
        assert watcher.returncode == 1  # it ended itself after ending the sleeper
        assert sleeper.wait(timeout=10) is not None
    finally:
        end_processes(record(sleeper.pid))
        sleeper.wait(timeout=10)
