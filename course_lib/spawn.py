"""Run one function on N local processes with a process group set up: SPMD without a cluster.

`spawn(fn, world_size, backend="gloo")` is what tests, benchmarks and scripts use when they do
not need an interactive cluster: like `torch.multiprocessing.spawn` plus `init_process_group`,
but results come back in rank order, every wait is bounded, and the processes are ended by PID
on every path. Each rank gets LOCAL_RANK and, on a host with a GPU per rank, its own GPU
(`bind_local_gpu`), as torchrun's ranks do.
"""

from __future__ import annotations

import contextlib
import faulthandler
import multiprocessing as mp
import os
import queue
import shutil
import signal
import sys
import tempfile
import threading
import time
import traceback
from typing import Any, Callable

from course_lib import backend as backends
from course_lib.i18n import _
from course_lib.processes import RankError, end_processes, record

STARTUP_TIMEOUT = 60.0
GRACE = 5.0  # past the group's timeout, so a rank's own timeout error (naming its peer) comes first
EXIT_GRACE = 5.0  # for ranks that finished to exit before they are ended by PID
SpawnError = RankError  # the name tests and scripts know; one error type for failed ranks
# Imported once by the fork server, so ranks fork from it ready to run: torch, and torch._dynamo,
# which the first optimizer a process builds imports (2 s of CPU more per rank otherwise).
PRELOAD = ["torch", "torch._dynamo"]


def _context() -> mp.context.BaseContext:
    """multiprocessing's forkserver with torch preloaded, so a rank starts in milliseconds
    instead of importing torch again (about 3 s of CPU each on a laptop); "spawn" where
    there is no fork. Ranks still start from a clean process: the server runs nothing else."""
    if "forkserver" not in mp.get_all_start_methods():
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    return ctx


def _end_helpers_before_kernel_shutdown() -> None:
    """In a Jupyter kernel, end multiprocessing's fork server and resource tracker first when
    the kernel shuts down. ipykernel then SIGTERMs the kernel's children for 14 s before a
    SIGKILL, and the tracker ignores SIGTERM: the kernel would outlive the server's 5 s wait,
    be killed, and leave the fork server's folder in /tmp. (ipykernel's `_at_shutdown` is
    private: where it is missing, nothing changes.)"""
    kernel = getattr(sys.modules.get("ipykernel.kernelbase"), "Kernel", None)
    kernel = kernel.instance() if kernel is not None and kernel.initialized() else None
    at_shutdown = getattr(kernel, "_at_shutdown", None)
    if at_shutdown is None or getattr(at_shutdown, "ends_helpers", False):
        return

    async def end_helpers_first() -> None:
        from multiprocessing import forkserver, resource_tracker

        for helper in (forkserver._forkserver, resource_tracker._resource_tracker):
            with contextlib.suppress(Exception):  # the fork server holds the tracker's pipe
                helper._stop()
        await at_shutdown()

    end_helpers_first.ends_helpers = True
    kernel._at_shutdown = end_helpers_first


def bind_local_gpu(local_rank: int, local_world_size: int) -> Any:
    """The launch contract for a process that may use a GPU: when CUDA sees a GPU for each of
    the `local_world_size` processes of this host, `torch.cuda.set_device(local_rank)` before
    any process group starts (so `"cuda"`, NCCL and `comm_device` mean this rank's GPU, not
    every rank's cuda:0) and return that device; else None (no CUDA, or ranks that must share
    a GPU: the caller places its tensors)."""
    import torch

    if not torch.cuda.is_available() or torch.cuda.device_count() < local_world_size:
        return None
    torch.cuda.set_device(local_rank)
    return torch.device("cuda", local_rank)


def _worker(rank, world_size, backend, timeout, to_parent, from_parent, fn, args, kwargs,
            env=None, cwd=None, fault_path=None):
    if env is not None:  # the fork server's were frozen when it started: take the caller's
        os.environ.clear()
        os.environ.update(env)
        os.chdir(cwd)
    if fault_path is not None:  # a crash in native code (SIGSEGV, SIGABRT) leaves its Python stack
        fault_file = open(fault_path, "w")  # noqa: SIM115 - open until the process ends
        faulthandler.enable(file=fault_file, all_threads=True)
    try:
        # every rank of a spawn is on this host: its rank is its local rank
        os.environ.update(LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world_size))
        bind_local_gpu(rank, world_size)
        to_parent.put(("addr", rank, backends.prepare(backend, rank)))
        init_kwargs = from_parent.get(timeout=timeout)
        backends.init(backend, rank, world_size, timeout=timeout, **init_kwargs)
        to_parent.put(("ready", rank, None))
        result = fn(rank, world_size, *args, **kwargs)
        to_parent.put(("ok", rank, result))
        # Tear down only when every rank is done: a rank that leaves early takes its end of
        # the process group with it (gloo's store lives in rank 0) while others still use it.
        # The parent always says so, by its own deadline; this bound only outlives a dead parent.
        from_parent.get(timeout=STARTUP_TIMEOUT + timeout + 2 * GRACE)
    except BaseException as exc:  # noqa: BLE001 - reported to the parent, then exit
        to_parent.put(("err", rank, f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))
    finally:
        backends.shutdown(backend)


def spawn(fn: Callable[..., Any], world_size: int, *args: Any, backend: str = "gloo",
          timeout: float = 120.0, **kwargs: Any) -> list[Any]:
    """Run `fn(rank, world_size, *args, **kwargs)` on `world_size` fresh processes.

    Returns the results in rank order. Raises `SpawnError` naming every rank that raised, died
    or did not finish within `timeout` seconds; all processes are gone when this returns.
    `fn` and its arguments must be picklable (a module-level function).
    """
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(_("world_size must be a positive int, got {world_size}",
                           world_size=repr(world_size)))
    backends.check_backend(backend)
    ctx = _context()
    to_parent = ctx.Queue()
    inboxes = [ctx.Queue() for _ in range(world_size)]
    faults = tempfile.mkdtemp(prefix="course-spawn-")
    fault_paths = [os.path.join(faults, f"rank{r}") for r in range(world_size)]
    procs = [ctx.Process(target=_worker, daemon=True,
                         args=(r, world_size, backend, timeout, to_parent,
                               inboxes[r], fn, args, kwargs, dict(os.environ), os.getcwd(),
                               fault_paths[r]))
             for r in range(world_size)]
    # Start-up (imports, rendezvous) gets its own allowance; `timeout` counts once all are ready.
    deadline = time.monotonic() + STARTUP_TIMEOUT + timeout
    ready, grace = 0, EXIT_GRACE
    results: dict[int, Any] = {}
    failures: dict[int, str] = {}
    addresses: dict[int, Any] = {}
    with _unwound_by_sigterm():  # a terminated caller still ends its ranks
        try:
            _start(procs)
            while len(results) + len(failures) < world_size:
                try:
                    kind, rank, payload = to_parent.get(timeout=0.2)
                except queue.Empty:
                    if time.monotonic() > deadline:
                        for r in range(world_size):
                            if r not in results and r not in failures:
                                what = fn.__name__ if ready == world_size else "start-up"
                                failures[r] = f"timed out after {timeout:g}s in {what}"
                        break
                    for r, p in enumerate(procs):
                        if r not in results and r not in failures and p.exitcode not in (None, 0):
                            failures[r] = _died(p, fault_paths[r])
                    continue
                if kind == "ready":
                    ready += 1
                    if ready == world_size:
                        deadline = time.monotonic() + timeout + GRACE
                elif kind == "addr":
                    addresses[rank] = payload
                    if len(addresses) == world_size:
                        init_kwargs = backends.rendezvous(backend, [addresses[r]
                                                                    for r in range(world_size)])
                        for inbox in inboxes:
                            inbox.put(init_kwargs)
                elif kind == "ok":
                    results[rank] = payload
                else:
                    failures[rank] = payload
        except BaseException:
            grace = 0.0  # interrupted: the ranks are still running `fn`, none will exit itself
            raise
        finally:
            for inbox in inboxes:
                inbox.put("done")
            _end_processes(procs, grace)
            shutil.rmtree(faults, ignore_errors=True)
    if failures:
        raise SpawnError(f"spawn({fn.__name__}, world_size={world_size}, backend={backend!r})",
                         failures, signals={r: -p.exitcode for r, p in enumerate(procs)
                                            if r in failures and (p.exitcode or 0) < 0})
    return [results[r] for r in range(world_size)]


def _start(procs: list[Any]) -> None:
    """Start the ranks' processes; a clear error where the temporary folder's path is too long
    for the Unix socket that multiprocessing's forkserver listens on there."""
    _end_helpers_before_kernel_shutdown()  # the helpers these starts bring up
    try:
        for p in procs:
            p.start()
    except OSError as exc:
        if "path too long" not in str(exc):
            raise
        raise OSError(_("spawn: the temporary folder {folder} is too long a path for the Unix "
                        "socket the ranks start through (Linux allows 107 bytes, macOS 103); "
                        "set TMPDIR to a shorter folder", folder=tempfile.gettempdir())) from exc


class _Terminated(BaseException):
    """SIGTERM arrived while `spawn` ran: unwinds it, as KeyboardInterrupt does for Ctrl-C."""


@contextlib.contextmanager
def _unwound_by_sigterm():
    """Let a SIGTERM unwind the block (its cleanup ends the ranks by PID and removes their
    files), then end this process by SIGTERM, as the signal would have. A handler the program
    set itself, or a thread other than the main one (which cannot take signals), is left as is."""
    if (threading.current_thread() is not threading.main_thread()
            or signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL):
        yield
        return

    def unwind(signum: int, frame: Any) -> None:
        raise _Terminated()

    signal.signal(signal.SIGTERM, unwind)
    try:
        yield
    except _Terminated:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGTERM)
        raise  # only if the signal is blocked
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)


def _died(proc: Any, fault_path: str, limit: int = 4000) -> str:
    """Why a rank's process ended without a word: its exit code or signal and, after a crash in
    native code, the Python stack faulthandler wrote (the end of it, up to `limit` characters)."""
    code = proc.exitcode
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = str(-code)
        what = _("process {pid} was killed by {signal}", pid=proc.pid, signal=name)
    else:
        what = _("process {pid} died with exit code {code}", pid=proc.pid, code=code)
    try:
        with open(fault_path, errors="replace") as f:
            stack = f.read().strip()
    except OSError:
        stack = ""
    return f"{what}\n{stack[-limit:]}" if stack else what


def _end_processes(procs: list, grace: float = EXIT_GRACE) -> None:
    """Give each process `grace` seconds to exit, end the rest by PID, and reap them all."""
    end = time.monotonic() + grace
    for p in procs:
        if p.pid is not None:
            p.join(max(0.0, end - time.monotonic()))
    stragglers = [entry for p in procs if p.pid is not None and p.is_alive()
                  for entry in record(p.pid)]
    end_processes(stragglers, reap=False)  # multiprocessing reaps its own children
    for p in procs:
        if p.pid is not None:
            p.join(5.0)
