"""Process sets that take turns: every backend's ranks live at once and run one row at a time.

On a shared machine, memory-bound work slows by up to 3x for seconds at a time (a neighbour on
the host). Run backend A's processes and then B's, and one of them can fall in such a spell
and the other not: the ratio measures the machine, not the backends. Here a driver
(`conduct`) starts every set first, then hands out short turns in rotating order; only the set
holding a turn runs, the others sleep in a blocking read. A spell then falls on every backend
alike. Turns are ASCII lines on a Unix socket in a private folder: nothing is unpickled.
"""

from __future__ import annotations

import math
import os
import shutil
import socket
import tempfile
import threading
import time
from typing import Callable, Iterator, Sequence

from course_lib.i18n import _

REWARM = 10  # untimed calls per timed turn: the set slept while others ran, on cold caches
Turn = tuple[str, int, int, int]  # (set, row, untimed calls, timed calls)


def schedule(rows: dict[str, Sequence[int]], warmup: int, timed: int, block: int,
             start: int = 0) -> list[Turn]:
    """The turns of one round. `rows[set]` gives each of the set's rows a group (its message
    size); every row first gets `warmup` untimed calls, then `timed` timed ones in turns of at
    most `block`. Within a block, groups go in order (reversed every other block) and, per
    group, the sets take turns in an order that rotates with the block and `start`."""
    names = list(rows)
    turns = [(n, r, warmup, 0) for n in names for r in range(len(rows[n])) if warmup]
    groups = sorted({g for n in names for g in rows[n]})
    for b in range(math.ceil(timed / block)):
        k = min(block, timed - b * block)
        shift = (b + start) % len(names)
        order = names[shift:] + names[:shift]
        for g in (groups if b % 2 == 0 else groups[::-1]):
            turns += [(n, r, REWARM, k) for n in order for r, rg in enumerate(rows[n]) if rg == g]
    return turns


class TurnError(RuntimeError):
    """A set that did not come, did not finish its turn, or failed: names the set and rank."""


class _Sets:
    """The driver's end: one listening socket, and one connection per (set, rank)."""

    def __init__(self, sizes: dict[str, int], timeout: float):
        self.sizes, self.timeout = sizes, timeout
        self.folder = tempfile.mkdtemp(prefix="bench-turns-")  # 0700: only this user connects
        self.address = os.path.join(self.folder, "turns")
        self.server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.server.bind(self.address)
        self.server.listen(sum(sizes.values()))
        self.links: dict[tuple[str, int], tuple[socket.socket, object]] = {}

    def accept_all(self, failed: Callable[[], str | None]) -> None:
        """Wait for every rank to say hello; stop early with the error of a set that failed."""
        deadline = time.monotonic() + self.timeout
        self.server.settimeout(0.2)
        while len(self.links) < sum(self.sizes.values()):
            if (why := failed()) is not None:
                raise TurnError(why)
            if time.monotonic() > deadline:
                missing = sorted(f"{n} rank {r}" for n, size in self.sizes.items()
                                 for r in range(size) if (n, r) not in self.links)
                raise TurnError(_("bench: {missing} did not connect within {timeout:g}s",
                                  missing=", ".join(missing), timeout=self.timeout))
            try:
                conn = self.server.accept()[0]
            except socket.timeout:
                continue
            conn.settimeout(self.timeout)
            reader = conn.makefile("rb")
            name, rank = reader.readline().decode("ascii").split()
            self.links[(name, int(rank))] = (conn, reader)

    def turn(self, name: str, row: int, untimed: int, timed: int) -> None:
        """Give `name` one turn and wait until each of its ranks reports it done."""
        ranks = range(self.sizes[name])
        for r in ranks:
            self._send(name, r, f"run {row} {untimed} {timed}\n", row)
        for r in ranks:
            try:
                line = self.links[(name, r)][1].readline()
            except socket.timeout:
                line = b"timeout"
            except ConnectionError:
                line = b""
            if line != b"done\n":
                fields = dict(name=name, rank=r, row=row, timeout=self.timeout)
                raise TurnError(
                    _("bench: {name} rank {rank} timed out in its turn on row {row} (waited up "
                      "to {timeout:g}s)", **fields) if line == b"timeout" else
                    _("bench: {name} rank {rank} ended in its turn on row {row} (waited up to "
                      "{timeout:g}s)", **fields))

    def _send(self, name: str, rank: int, line: str, row: int) -> None:
        try:
            self.links[(name, rank)][0].sendall(line.encode("ascii"))
        except OSError:
            raise TurnError(_("bench: {name} rank {rank} ended before its turn on row {row}",
                              name=name, rank=rank, row=row)) from None

    def close(self) -> None:
        for conn, reader in self.links.values():
            try:
                conn.sendall(b"stop\n")
            except OSError:
                pass  # that rank has gone; its set's own error says why
            reader.close()
            conn.close()
        self.server.close()
        shutil.rmtree(self.folder, ignore_errors=True)


def conduct(launchers: dict[str, Callable[[str], object]], sizes: dict[str, int],
            turns: list[Turn], timeout: float) -> dict[str, object]:
    """Start every set at once (`launchers[name](address)`, in a thread each; `sizes[name]`
    ranks), run `turns` in order, stop them, and return each launcher's result."""
    sets = _Sets(sizes, timeout)
    results: dict[str, object] = {}
    errors: dict[str, BaseException] = {}

    def launch(name: str) -> None:
        try:
            results[name] = launchers[name](sets.address)
        except BaseException as exc:  # noqa: BLE001 - reported by the driver below
            errors[name] = exc

    threads = [threading.Thread(target=launch, args=(n,), daemon=True) for n in launchers]
    for t in threads:
        t.start()
    failure = None
    try:
        sets.accept_all(lambda: next((_("bench: {name} failed to start: {exc}", name=n, exc=e)
                                      for n, e in errors.items()), None))
        for turn in turns:
            sets.turn(*turn)
    except TurnError as exc:
        failure = exc
    finally:  # on every path: stopped sets return; a stuck one ends by its own deadline
        sets.close()
        for t in threads:
            t.join()
    if failure is not None:
        detail = "; ".join(f"{n}: {e}" for n, e in errors.items())
        raise TurnError(f"{failure}" + (f" ({detail})" if detail else "")) from None
    if errors:
        name, exc = next(iter(errors.items()))
        raise TurnError(_("bench: {name} failed: {exc}", name=name, exc=exc)) from exc
    return results


def turns(address: str, name: str, rank: int, timeout: float) -> Iterator[tuple[int, int, int]]:
    """A rank's end: yields (row, untimed, timed) per turn it is given, and reports each done
    when the caller asks for the next; returns when the driver says stop."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
        conn.settimeout(timeout)
        conn.connect(address)
        conn.sendall(f"{name} {rank}\n".encode())
        with conn.makefile("rb") as reader:
            while True:
                try:
                    line = reader.readline().decode("ascii").split()
                except socket.timeout:
                    raise TurnError(_("bench: {name} rank {rank} waited {timeout:g}s for its "
                                      "next turn", name=name, rank=rank,
                                      timeout=timeout)) from None
                except ConnectionError:
                    return  # the driver has gone, and reports why itself
                if not line or line[0] == "stop":
                    return
                yield int(line[1]), int(line[2]), int(line[3])
                try:
                    conn.sendall(b"done\n")
                except ConnectionError:
                    return
