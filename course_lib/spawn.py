"""Run one function on N local processes with a process group set up: SPMD without a cluster.

`spawn(fn, world_size, backend="gloo")` is what tests, benchmarks and scripts use when they do
not need an interactive cluster: like `torch.multiprocessing.spawn` plus `init_process_group`,
but results come back in rank order, every wait is bounded, and the processes are ended by PID
on every path.
"""

from __future__ import annotations

import multiprocessing as mp
import queue
import secrets
import socket
import time
import traceback
from datetime import timedelta
from typing import Any, Callable

BACKENDS = ("gloo", "scratch", "none")
STARTUP_TIMEOUT = 60.0


class SpawnError(RuntimeError):
    """One or more ranks failed, died or timed out; `failures` maps rank -> message."""

    def __init__(self, operation: str, failures: dict[int, str]):
        self.failures = dict(sorted(failures.items()))
        lines = [f"{operation}: {len(self.failures)} rank(s) failed"]
        lines += [f"  rank {r}: {msg}" for r, msg in self.failures.items()]
        super().__init__("\n".join(lines))


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free a moment ago (the usual rendezvous race applies)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def init_backend(backend: str, rank: int, world_size: int, *, timeout: float,
                 gloo_port: int | None = None, master_addr: str = "127.0.0.1",
                 addresses: list | None = None,
                 secret: bytes | None = None) -> None:
    """Initialize `backend` in this process (shared by `spawn` and `course_lib.cluster`)."""
    import torch

    torch.set_num_threads(1)
    if backend == "gloo":
        import torch.distributed as tdist

        tdist.init_process_group("gloo", init_method=f"tcp://{master_addr}:{gloo_port}",
                                 rank=rank, world_size=world_size,
                                 timeout=timedelta(seconds=timeout))
    elif backend == "scratch":
        from course_lib import dist

        dist.init_process_group("scratch", rank=rank, world_size=world_size,
                                addresses=addresses, secret=secret, timeout=timeout)
    elif backend != "none":
        raise ValueError(f"unknown backend {backend!r}; expected one of {BACKENDS}")


def shutdown_backend(backend: str) -> None:
    """Tear down whatever `init_backend` set up, ignoring a group that is already gone."""
    try:
        if backend == "gloo":
            import torch.distributed as tdist

            if tdist.is_initialized():
                tdist.destroy_process_group()
        elif backend == "scratch":
            from course_lib import dist

            if dist.is_initialized():
                dist.destroy_process_group()
    except Exception:  # noqa: BLE001 - best effort at exit
        pass


def _worker(rank, world_size, backend, timeout, gloo_port, to_parent, from_parent, fn, args,
            kwargs):
    try:
        addresses = secret = None
        if backend == "scratch":
            from course_lib import dist

            to_parent.put(("addr", rank, dist.listen()))
            addresses, secret = from_parent.get(timeout=timeout)
        init_backend(backend, rank, world_size, timeout=timeout, gloo_port=gloo_port,
                     addresses=addresses, secret=secret)
        to_parent.put(("ready", rank, None))
        result = fn(rank, world_size, *args, **kwargs)
        to_parent.put(("ok", rank, result))
    except BaseException as exc:  # noqa: BLE001 - reported to the parent, then exit
        to_parent.put(("err", rank, f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))
    finally:
        shutdown_backend(backend)


def spawn(fn: Callable[..., Any], world_size: int, *args: Any, backend: str = "gloo",
          timeout: float = 120.0, **kwargs: Any) -> list[Any]:
    """Run `fn(rank, world_size, *args, **kwargs)` on `world_size` fresh processes.

    Returns the results in rank order. Raises `SpawnError` naming every rank that raised, died
    or did not finish within `timeout` seconds; all processes are gone when this returns.
    `fn` and its arguments must be picklable (a module-level function).
    """
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be a positive int, got {world_size!r}")
    if backend not in BACKENDS:
        raise ValueError(f"unknown backend {backend!r}; expected one of {BACKENDS}")
    ctx = mp.get_context("spawn")
    to_parent = ctx.Queue()
    inboxes = [ctx.Queue() for _ in range(world_size)]
    gloo_port = free_port() if backend == "gloo" else None
    procs = [ctx.Process(target=_worker, daemon=True,
                         args=(r, world_size, backend, timeout, gloo_port, to_parent,
                               inboxes[r], fn, args, kwargs))
             for r in range(world_size)]
    # Start-up (imports, rendezvous) gets its own allowance; `timeout` counts once all are ready.
    deadline = time.monotonic() + STARTUP_TIMEOUT + timeout
    ready = 0
    results: dict[int, Any] = {}
    failures: dict[int, str] = {}
    addresses: dict[int, Any] = {}
    try:
        for p in procs:
            p.start()
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
                        failures[r] = f"process {p.pid} died with exit code {p.exitcode}"
                continue
            if kind == "ready":
                ready += 1
                if ready == world_size:
                    deadline = time.monotonic() + timeout
            elif kind == "addr":
                addresses[rank] = payload
                if len(addresses) == world_size:
                    secret = secrets.token_bytes(32)
                    table = [addresses[r] for r in range(world_size)]
                    for inbox in inboxes:
                        inbox.put((table, secret))
            elif kind == "ok":
                results[rank] = payload
            else:
                failures[rank] = payload
    finally:
        _end_processes(procs)
    if failures:
        raise SpawnError(f"spawn({fn.__name__}, world_size={world_size}, backend={backend!r})",
                         failures)
    return [results[r] for r in range(world_size)]


def _end_processes(procs: list, grace: float = 5.0) -> None:
    """Join each process briefly, then kill it by PID; never leaves one behind."""
    end = time.monotonic() + grace
    for p in procs:
        if p.pid is None:
            continue
        p.join(max(0.0, end - time.monotonic()))
        if p.is_alive():
            p.kill()
            p.join(5.0)

