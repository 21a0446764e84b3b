"""The engine cluster: ranks, ordering, error naming, timeouts, crashes, clean shutdown."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import textwrap
import time

import cloudpickle
import psutil
import pytest
from course_lib import cluster as cl
from course_lib.cluster import ClusterError, EngineDied, RankError, RankTimeout

pytestmark = pytest.mark.cluster
cloudpickle.register_pickle_by_value(sys.modules[__name__])  # engines cannot import tests/


def whoami():
    import torch
    from course_lib.cluster import get_rank, get_world_size

    return get_rank(), get_world_size(), torch.get_num_threads()


def sum_of_ranks_squared():
    import torch
    import torch.distributed as dist

    t = torch.tensor([float(dist.get_rank() ** 2)])
    dist.all_reduce(t)
    return t.item()


def fail_on(ranks):
    from course_lib.cluster import get_rank

    if get_rank() in ranks:
        raise ValueError(f"rank {get_rank()} refuses")
    return get_rank()


def sleep_on(rank_to_hang):
    import time
    from course_lib.cluster import get_rank

    if get_rank() == rank_to_hang:
        while True:
            time.sleep(0.05)
    return get_rank()


def skip_collective_on(rank_to_hang):
    """The others block inside gloo's all_reduce, where SIGINT cannot reach them."""
    import time
    import torch
    import torch.distributed as dist

    if dist.get_rank() == rank_to_hang:
        time.sleep(3600)
    t = torch.ones(4)
    dist.all_reduce(t)
    return t.sum().item()


def die_on(rank_to_die):
    import os
    from course_lib.cluster import get_rank

    if get_rank() == rank_to_die:
        os._exit(3)
    return get_rank()


def alive(pids):
    """The PIDs that still run (zombies awaiting their parent's wait() count as ended)."""
    running = []
    for pid in pids:
        try:
            if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                running.append(pid)
        except psutil.NoSuchProcess:
            pass
    return running


def wait_gone(pids, seconds):
    deadline = time.monotonic() + seconds
    while alive(pids) and time.monotonic() < deadline:
        time.sleep(0.2)
    return alive(pids)


@pytest.fixture(scope="module")
def c4():
    with cl.start(4, backend="gloo", timeout=60) as c:
        yield c


def test_ranks_world_and_one_thread_each(c4):
    assert c4.run(whoami) == [(r, 4, 1) for r in range(4)]
    assert len(set(c4.pids)) == 4


def test_gloo_process_group_sums_across_ranks(c4):
    expected = float(sum(r * r for r in range(4)))
    assert c4.run(sum_of_ranks_squared) == [expected] * 4


def test_error_names_every_failing_rank_and_cluster_stays_usable(c4):
    with pytest.raises(RankError) as info:
        c4.run(fail_on, [1, 3])
    assert set(info.value.failures) == {1, 3}
    assert "ValueError: rank 3 refuses" in str(info.value)
    assert "rank 0" not in str(info.value)
    assert c4.run(fail_on, []) == [0, 1, 2, 3]


def test_hang_is_cut_off_within_30s_and_next_run_works(c4):
    t0 = time.monotonic()
    with pytest.raises(RankTimeout) as info:
        c4.run(sleep_on, 2, timeout=5)
    assert time.monotonic() - t0 < 30
    assert list(info.value.failures) == [2]
    assert "interrupted" in str(info.value)
    assert c4.run(sum_of_ranks_squared) == [14.0] * 4


def test_uninterruptible_hang_restarts_engines_and_says_so(c4):
    before = list(c4.pids)
    t0 = time.monotonic()
    with pytest.raises(RankTimeout) as info:
        c4.run(skip_collective_on, 1, timeout=5)
    assert time.monotonic() - t0 < 30
    assert 1 in info.value.failures
    assert "restarted" in str(info.value)
    assert not alive(before)
    assert c4.run(whoami) == [(r, 4, 1) for r in range(4)]
    assert c4.run(sum_of_ranks_squared) == [14.0] * 4


def test_crash_is_reported_and_restart_restores_ranks():
    with cl.start(2, backend="gloo") as c:
        with pytest.raises(EngineDied) as info:
            c.run(die_on, 1, timeout=30)
        assert list(info.value.failures) == [1]
        with pytest.raises(EngineDied, match="restart"):
            c.run(whoami)
        c.restart()
        assert c.run(whoami) == [(0, 2, 1), (1, 2, 1)]
        assert c.run(sum_of_ranks_squared) == [1.0, 1.0]


def test_processes_end_after_exception_inside_with():
    with pytest.raises(KeyError):
        with cl.start(1, backend="none") as c:
            pids = list(c.pids) + [pid for pid, _ in c._procs]
            raise KeyError("boom")
    assert not alive(pids)


def test_an_engine_that_dies_before_registering_is_named_with_its_log_at_once(monkeypatch,
                                                                             tmp_path):
    """Not the start's whole timeout spent waiting for engines that will never come: the error
    comes when the first one exits, names it and shows the end of its log; nothing is left."""
    from course_lib.cluster import launch, zygote

    real, started = zygote.fork, []
    broken = tmp_path / "e.json"
    broken.write_text("{ not the controller's connection file")

    def fork(argv, log, *args, app="engine", **kwargs):
        if app == "engine":  # one engine of two told to register from a broken file
            argv = [a if not a.startswith("--file=") or started else f"--file={broken}"
                    for a in argv]
        pid = real(argv, log, *args, app=app, **kwargs)
        started.append(pid) if app == "engine" else None
        return pid

    monkeypatch.setattr(zygote, "fork", fork)
    monkeypatch.setattr(launch.zygote, "fork", fork)
    begun = time.monotonic()
    with pytest.raises(ClusterError) as err:
        cl.start(2, backend="none", timeout=120)
    assert time.monotonic() - begun < 60, "waited out the start's timeout"
    text = str(err.value)
    assert "only 1 of 2 engines started" in text or "only 0 of 2 engines started" in text, text
    assert f"engine 0 (pid {started[0]}) exited before it registered" in text, text
    assert f"engine 1 (pid {started[1]}) runs" in text, text
    assert "JSONDecodeError" in text, text  # the engine's own log says what went wrong
    assert not alive(started)


@pytest.mark.parametrize("broken", [1, 2])
def test_a_controller_that_lost_a_port_is_replaced_once(monkeypatch, broken):
    """ipyparallel's controller frees the ports it picks before its children bind them; if
    another process takes one, that child dies and the controller runs on without it. Here
    the heartbeat child is killed instead, as if its port had been taken: the engines register
    and are never heard, the start finds the port unheard and starts over once with a new
    controller; a second loss is an error that names the ports, and nothing is left."""
    import json

    from course_lib.cluster import launch

    real, controllers = launch.fork_engines, []

    def lose_the_heartbeat(ipp, *args, **kwargs):
        root = ipp.controller.process
        controllers.append(root.pid)
        if len(controllers) <= broken:
            deadline = time.monotonic() + 30
            while not launch._connection_file_ready(launch.connection_file(ipp)):
                assert time.monotonic() < deadline, "no connection file"
                time.sleep(0.05)
            with open(launch.connection_file(ipp), encoding="utf-8") as f:
                hb = json.load(f)["hb_ping"]

            def heart():
                return [p for p in root.children(recursive=True) if hb in launch._listening(p)]

            deadline = time.monotonic() + 30
            while not heart() and time.monotonic() < deadline:
                time.sleep(0.05)
            assert heart(), "the controller's heartbeat never listened"
            for p in heart():
                p.kill()
        return real(ipp, *args, **kwargs)

    monkeypatch.setattr(launch, "fork_engines", lose_the_heartbeat)
    monkeypatch.setattr(launch, "STALLED_SECONDS", 2.0)
    begun = time.monotonic()
    if broken == 1:
        with cl.start(2, backend="none") as c:
            assert c.run(fail_on, []) == [0, 1]  # every rank answers
            pids = [pid for pid, _ in c._procs]
        assert len(controllers) == 2 and not alive(controllers[:1])
    else:
        with pytest.raises(launch.ControllerPortsTaken) as err:
            cl.start(2, backend="none")
        assert "does not listen on ports [" in str(err.value), err.value
        assert len(controllers) == 2
        pids = controllers
    assert time.monotonic() - begun < 30, "waited for the engines to give up (37 s)"
    assert not alive(pids)


def test_processes_end_after_keyboard_interrupt_inside_with():
    with pytest.raises(KeyboardInterrupt):
        with cl.start(1, backend="none") as c:
            pids = [pid for pid, _ in c._procs]
            raise KeyboardInterrupt
    assert not alive(pids)


def test_engines_are_forked_with_the_clients_environment_folder_and_path_of_the_moment(
        monkeypatch, tmp_path, shared_zygote):
    """Forked from the session's shared zygote (started elsewhere, before these variables),
    each engine takes the client's environment, folder and PYTHONPATH of the moment, as a new
    process would: a learner's bundle on PYTHONPATH, not the zygote's folder, gives course_lib."""
    for value in ("first", "second"):
        folder, path = tmp_path / value / "cwd", tmp_path / value / "path"
        for where, module in ((folder, "course_probe"), (path, "course_probe_path")):
            where.mkdir(parents=True)
            (where / f"{module}.py").write_text(f"VALUE = {str(where)!r}\n")
        monkeypatch.setenv("COURSE_TEST_VALUE", value)
        monkeypatch.setenv("PYTHONPATH", str(path))
        monkeypatch.chdir(folder)
        with cl.start(2, backend="none") as c:
            assert c.run(os.environ.get, "COURSE_TEST_VALUE") == [value, value]
            assert c.run(os.getcwd) == [str(folder)] * 2
            assert c.run(lambda: __import__("course_probe").VALUE) == [str(folder)] * 2
            assert c.run(lambda: __import__("course_probe_path").VALUE) == [str(path)] * 2
            assert all(psutil.Process(p).ppid() == shared_zygote.pid for p in c.pids)


def test_a_shared_zygote_refuses_another_python_and_survives_a_bad_client(tmp_path, monkeypatch):
    from course_lib.cluster import zygote

    proc, path = zygote.start_shared()
    try:
        request = zygote.request([], str(tmp_path / "log"), executable="/not/this/python")
        assert zygote.ask_shared(request, 30, path) is None  # refused: the client forks its own
        with socket.socket(socket.AF_UNIX) as s:  # a client that sends nonsense, then goes
            s.connect(path)
            s.sendall(b"[not a request\n")
        monkeypatch.setenv(zygote.SOCKET_ENV, path)
        with cl.start(1, backend="none") as c:  # still serving
            assert psutil.Process(c.pids[0]).ppid() == proc.pid
    finally:
        zygote.end(proc)
    assert proc.poll() is not None and not os.path.exists(os.path.dirname(path))


def test_a_shared_zygote_names_a_temporary_folder_too_long_for_its_socket(short_tmp):
    """Its socket is TMPDIR/course-zygote-XXXXXXXX/socket: past 107 bytes the zygote cannot
    listen, and its owner hears why, with the way out; the zygote has ended, its folder gone."""
    from course_lib.cluster import zygote

    long = short_tmp / ("d" * (100 - len(str(short_tmp))))
    long.mkdir()
    with pytest.raises(RuntimeError, match=r"cannot listen on .*too long.*set TMPDIR to a short"):
        zygote.start_shared(env=dict(os.environ, TMPDIR=str(long)))
    assert list(long.iterdir()) == []


LIMITED = textwrap.dedent("""
    import resource
    from course_lib import cluster
    resource.setrlimit(resource.RLIMIT_NOFILE, (321, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
    with cluster.start(1, backend="none") as c:
        print(c.run(lambda: __import__("resource").getrlimit(__import__("resource").RLIMIT_NOFILE)[0])[0],
              c.run(__import__("os").getppid)[0])
""")


def test_a_shared_zygote_gives_a_forked_process_its_clients_limits(shared_zygote):
    """A limit the client set (course-grade's memory cap, say) holds in what it has forked."""
    out = subprocess.run([sys.executable, "-c", LIMITED], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["321", str(shared_zygote.pid)]


SCRIPT = textwrap.dedent("""
    import os, sys, time
    from course_lib import cluster
    from course_lib.cluster import zygote
    os.environ.pop(zygote.SOCKET_ENV, None)  # this process's own zygote, the default
    c = cluster.start(2, backend="none")
    pids = [pid for pid, _ in c._procs] + [zygote._zygote.pid]  # the zygote must go too
    print(" ".join(str(pid) for pid in pids), flush=True)
    if sys.argv[1] == "hang":
        time.sleep(3600)
""")


def test_processes_end_at_interpreter_exit():
    out = subprocess.run([sys.executable, "-c", SCRIPT, "exit"], capture_output=True, text=True,
                         timeout=120)
    pids = [int(p) for p in out.stdout.split()]
    assert len(pids) >= 4, out.stderr  # controller, 2 engines and the zygote at least
    assert not wait_gone(pids, 10)


def test_processes_end_when_the_client_is_killed():
    proc = subprocess.Popen([sys.executable, "-c", SCRIPT, "hang"], stdout=subprocess.PIPE,
                            text=True)
    try:
        pids = [int(p) for p in proc.stdout.readline().split()]
        assert len(pids) >= 4
    finally:
        os.kill(proc.pid, signal.SIGKILL)  # no atexit: the engines' watchdog must act
        proc.wait(10)
    assert not wait_gone(pids, 20)


def test_bad_input_gets_clear_errors():
    with pytest.raises(ValueError, match="positive number of engines"):
        cl.start(n=0)
    with pytest.raises(ValueError, match="unknown backend 'nccl'"):
        cl.start(2, backend="nccl")
    with pytest.raises(ValueError, match='engines="mpi"'):
        cl.start(2, backend="mpi")
    c = cl.start(1, backend="none")
    c.stop()
    with pytest.raises(ClusterError, match="stopped"):
        c.run(whoami)
    with pytest.raises(TypeError, match="needs a function"):
        cl.Cluster.run(c, 42)



def mpi_rank_and_sum():
    import numpy as np
    from mpi4py import MPI
    from course_lib.cluster import get_rank

    buf = np.array([float(get_rank() + 1)])
    MPI.COMM_WORLD.Allreduce(MPI.IN_PLACE, buf)
    return MPI.COMM_WORLD.Get_rank(), get_rank(), float(buf[0])


def ddp_on_the_engines_dist():
    """Lesson 10: on MPI engines, components find course_lib.mpi as their dist."""
    import torch
    from torch import nn
    from course_lib import mpi
    from course_lib.backend import default_dist
    from course_lib.ddp import DistributedDataParallel

    torch.manual_seed(default_dist().get_rank())  # different weights: DDP broadcasts rank 0's
    ddp = DistributedDataParallel(nn.Linear(3, 2))
    ddp(torch.ones(1, 3) * (default_dist().get_rank() + 1)).sum().backward()
    return default_dist() is mpi, ddp.module.weight.grad.tolist()


@pytest.mark.mpi
def test_mpi_engines_under_the_wheels_mpiexec():
    pytest.importorskip("mpi4py")
    with cl.start(2, engines="mpi", backend="mpi") as c:
        assert c.run(mpi_rank_and_sum) == [(0, 0, 3.0), (1, 1, 3.0)]
        (is_mpi0, grad0), (is_mpi1, grad1) = c.run(ddp_on_the_engines_dist)
        assert is_mpi0 and is_mpi1
        assert grad0 == grad1 == [[1.5] * 3] * 2  # d(sum)/dW averaged over inputs 1 and 2
        pids = [pid for pid, _ in c._procs]
    assert not wait_gone(pids, 10)


def scratch_sum_skipping(rank_to_hang):
    import time
    import torch
    from course_lib import dist

    if dist.get_rank() == rank_to_hang:
        time.sleep(3600)
    t = torch.full((5,), float(dist.get_rank()))
    dist.all_reduce(t)
    return t.tolist()


def test_scratch_is_the_default_and_its_collective_hang_is_interruptible():
    with cl.start(3) as c:
        assert c.backend == "scratch"
        assert c.run(scratch_sum_skipping, -1) == [[3.0] * 5] * 3
        pids = list(c.pids)
        with pytest.raises(RankTimeout) as info:
            c.run(scratch_sum_skipping, 1, timeout=3)
        assert "interrupted and the process group rebuilt" in str(info.value)
        assert c.pids == pids  # no restart was needed: our waits are interruptible
        assert c.run(scratch_sum_skipping, -1) == [[3.0] * 5] * 3

        # A rank killed in the middle of a ring all_reduce: the others fail fast, naming it.
        with pytest.raises(EngineDied) as info:
            c.run(scratch_die_mid_all_reduce, 1, timeout=60)
        assert list(info.value.failures) == [1]
        c.restart()
        assert c.run(scratch_sum_skipping, -1) == [[3.0] * 5] * 3


def scratch_die_mid_all_reduce(rank_to_die):
    import os
    import threading
    import torch
    from course_lib import dist

    if dist.get_rank() == rank_to_die:
        threading.Timer(0.05, os._exit, args=(5,)).start()
    t = torch.ones(16 * 2**20 // 4)  # 16 MiB: several segments, so the rank dies mid-ring
    try:
        for _ in range(200):
            dist.all_reduce(t, algorithm="ring")
    except dist.DistError as err:
        return str(err)
    return "finished"
