"""A process group: a set of global ranks that run collectives together (`course_lib.dist.group`
makes them and holds this process's world).

- `ProcessGroup`: its members and this process's index among them, point-to-point by group rank
  and wire tag (what the collectives are written with), and `submit` for `async_op=True`;
- `Collective`: one collective call: its sequence number and tag, taken in call order on every
  rank, its flight-recorder entry, the fingerprints traded under `TORCH_DISTRIBUTED_DEBUG=DETAIL`,
  and a failure explained by every other rank's flight record;
- `_Worker`: the thread that runs a group's asynchronous calls in order.
"""

from __future__ import annotations

import itertools
import threading
import time
from typing import Any, Callable, Sequence

import torch

from course_lib.dist import flight
from course_lib.dist.errors import DistError, DistTimeoutError
from course_lib.dist.matching import RecvRequest
from course_lib.dist.peer import Peer, overlaps
from course_lib.dist.work import What, Work
from course_lib.dist.transport import Transport
from course_lib.i18n import _

MAX_TAG = 2 ** 31 - 1
QUERY_TIMEOUT = 2.0  # how long a failing collective waits for each peer's flight record
FINGERPRINT_TAGS = 1 << 60  # fingerprint messages' tags sit this far below their collective's


class ProcessGroup:
    """A set of global ranks that run collectives together; `rank` is this process's index."""

    def __init__(self, transport: Transport, ranks: Sequence[int], group_id: int,
                 timeout: float):
        self.transport, self.ranks, self.id = transport, list(ranks), group_id
        self.timeout = timeout
        self.size = len(self.ranks)
        self.rank = self.ranks.index(transport.rank) if transport.rank in self.ranks else -1
        self._seq = itertools.count()
        self._worker: _Worker | None = None
        self.recorder = flight.Recorder()
        self.detail = False  # TORCH_DISTRIBUTED_DEBUG=DETAIL: check fingerprints every call
        self.all_reduce_table: dict | None = None  # all_reduce "auto"'s (set_all_reduce_table)
        self.shared: dict[int, Any] = {}  # symmetric buffers by data_ptr (dist.shared_zeros)
        self.staging: Any = None  # symmetric.Staging once made; False: its ranks cannot share

    def __repr__(self) -> str:
        return f"ProcessGroup(ranks={self.ranks}, rank={self.rank})"

    def check_member(self, name: str) -> None:
        if self.rank < 0:
            raise DistError(_("rank {rank}: {name} on {group} failed: this rank is not a member "
                              "of the group", rank=self.transport.rank, name=name,
                              group=repr(self)), rank=self.transport.rank,
                            operation=name)

    def group_rank(self, global_rank: int, what: str) -> int:
        """Index in this group of a global rank given as `src`/`dst` (torch's convention)."""
        if global_rank not in self.ranks:
            raise ValueError(_("{what}={rank} is not in the group's ranks {ranks}", what=what,
                               rank=global_rank, ranks=self.ranks))
        return self.ranks.index(global_rank)

    def deadline(self) -> float:
        return time.monotonic() + self.timeout

    @property
    def description(self) -> str:
        return "world" if self.id == 0 else f"group {self.id} of ranks {self.ranks}"

    def collective(self, name: str, tensor: torch.Tensor | None) -> "Collective":
        """The next collective call: its sequence number, a fresh negative tag (so messages of
        two calls never mix) and its flight-recorder entry, taken in call order on every rank."""
        seq = next(self._seq)
        tag = -1 - ((self.id << 32) | (seq & 0xFFFFFFFF))
        return Collective(self, name, tag, self.recorder.start(seq, name, tensor))

    def p2p_tag(self, tag: int) -> int:
        if not isinstance(tag, int) or not 0 <= tag <= MAX_TAG:
            raise ValueError(_("tag must be an int in [0, {max_tag}], got {tag!r}",
                               max_tag=MAX_TAG, tag=tag))
        return (self.id << 32) | tag

    def peer(self, group_rank: int, name: str) -> Peer:
        if group_rank == self.rank:
            raise ValueError(_("rank {rank}: {name}: cannot send to or receive from itself",
                               rank=self.transport.rank, name=name))
        return self.transport.peer(self.ranks[group_rank])

    # Point-to-point by group rank and wire tag: what collectives are written with. `name` is
    # the operation's name for error messages, e.g. "all_reduce(ring)".
    def send(self, tensor: torch.Tensor, to: int, tag: int, name: str) -> None:
        self.peer(to, name).isend(tensor, tag, name, self.deadline(), blocking=True).wait()

    def isend(self, tensor: torch.Tensor, to: int, tag: int, name: str) -> Work:
        return self.peer(to, name).isend(tensor, tag, name, self.deadline())

    def recv(self, tensor: torch.Tensor, frm: int, tag: int, name: str,
             combine: Callable[[torch.Tensor, torch.Tensor], None] | None = None) -> None:
        """Receive into `tensor`; with `combine(dst, src)` the message is reduced into it
        instead, straight from shared memory when it travels there (no temporary)."""
        self.peer(frm, name).recv(tensor, tag, name, self.deadline(), combine)

    def sendrecv(self, out: torch.Tensor, to: int, into: torch.Tensor, frm: int, tag: int,
                 name: str, combine: Callable[[torch.Tensor, torch.Tensor], None] | None = None
                 ) -> None:
        """Send `out` to `to` and receive from `frm` into `into` (MPI_Sendrecv), combined with
        `combine`; `into` may be `out` itself (see `Peer.sendrecv`). One peer both ways: a
        small message goes out whole with no request object, the cheapest exchange we have."""
        if to == frm:
            self.peer(to, name).sendrecv(out, into, tag, name, self.deadline(), combine)
            return
        work = self.isend(out.clone() if overlaps(out, into) else out, to, tag, name)
        self.recv(into, frm, tag, name, combine)
        work.wait()

    def exchange(self, tensor: torch.Tensor, tag: int, name: str) -> list[torch.Tensor]:
        """Every rank's `tensor` (same shape and dtype), in group rank order: one message to
        and from each peer under `tag`, outside the group's sequence of collectives."""
        out = [tensor if q == self.rank else torch.empty_like(tensor) for q in range(self.size)]
        sends = [self.isend(tensor, q, tag, name) for q in range(self.size) if q != self.rank]
        for q in range(self.size):
            if q != self.rank:
                self.recv(out[q], q, tag, name)
        for work in sends:
            work.wait()
        return out

    def irecv(self, tensor: torch.Tensor, frm: int, tag: int, name: str) -> RecvRequest:
        return self.peer(frm, name).irecv(tensor, tag, name, self.deadline())

    def submit(self, fn: Callable[[], None], name: str,
               result: Sequence[torch.Tensor] = ()) -> Work:
        """Run `fn` on the group's worker thread (in call order): what async_op=True returns;
        `result`, the tensors `fn` writes, is the value of the Work's future."""
        if self._worker is None:
            self._worker = _Worker(f"dist-async-{self.transport.rank}-g{self.id}")
        work = Work(self.deadline(), What(self.transport.rank, name), result)
        self._worker.put(fn, work)
        return work

    def close(self) -> None:
        if self._worker is not None:
            self._worker.stop()


class Collective:
    """One collective call: `run(body)` runs `body(group, tag)`, recording how it ends; a
    DistError from it comes back explained by every rank's flight record."""

    __slots__ = ("group", "name", "tag", "entry")

    def __init__(self, group: ProcessGroup, name: str, tag: int, entry: flight.Entry):
        self.group, self.name, self.tag, self.entry = group, name, tag, entry

    def run(self, body: Callable[[ProcessGroup, int], None]) -> None:
        g = self.group
        try:
            if g.detail:
                self._check_fingerprints()
            body(g, self.tag)
        except DistError as exc:
            g.recorder.finish(self.entry, failed=True)
            raise self._explained(exc) from exc
        except BaseException:
            g.recorder.finish(self.entry, failed=True)
            raise
        g.recorder.finish(self.entry, failed=False)

    def _check_fingerprints(self) -> None:
        """Trade fingerprints with every rank of the group; a mismatch fails here, naming both
        ranks and both calls (torch's DETAIL mode), instead of hanging or mixing data later."""
        g = self.group
        theirs = g.exchange(flight.fingerprint(self.entry), self.tag - FINGERPRINT_TAGS, self.name)
        for r in range(g.size):
            if r == g.rank:
                continue
            other = flight.from_fingerprint(theirs[r])
            if not flight.same_call(other, self.entry):
                me, peer = g.transport.rank, g.ranks[r]
                raise DistError(
                    _("rank {me}: collectives do not match across ranks: rank {me} called "
                      "{mine}, rank {peer} called {theirs}", me=me, peer=peer,
                      mine=self.entry.what(g.description), theirs=other.what(g.description)),
                    rank=me, peer_rank=peer,
                    operation=self.name)

    def _explained(self, exc: DistError) -> DistError:
        """`exc` with what every other rank's flight record says about this call first."""
        g = self.group
        me = g.transport.rank
        peers = [r for r in g.ranks if r != me]
        answers: dict[int, Any] = {}

        def ask(r: int) -> None:
            answers[r] = g.transport.query(r, QUERY_TIMEOUT)

        def lost(r: int) -> bool:  # its own link closed: no use waiting for an answer
            dead = g.transport.peers[r].dead
            return dead is not None and not dead.startswith("group aborted")

        threads = [threading.Thread(target=ask, args=(r,), daemon=True)
                   for r in peers if not lost(r)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(QUERY_TIMEOUT + 1.0)
        records = {r: (answers.get(r) or {}).get("groups", {}).get(str(g.id), {}).get("entries")
                   if answers.get(r) is not None else None for r in peers}
        said = (_("{call} timed out on rank {rank}: {diagnosis}") if isinstance(
            exc, DistTimeoutError) else _("{call} failed on rank {rank}: {diagnosis}"))
        text = said.format(call=self.entry.what(g.description), rank=me,
                           diagnosis=flight.diagnose(self.entry, g.description, records))
        text += "\n  " + _("cause: {error}", error=exc)
        return type(exc)(text, rank=exc.rank, peer_rank=exc.peer_rank, operation=exc.operation)


class _Worker:
    """One thread running queued calls in order, finishing each call's Work."""

    def __init__(self, name: str):
        self._queue: list = []
        self._cond = threading.Condition()
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    def put(self, fn: Callable[[], None], work: Work) -> None:
        with self._cond:
            self._queue.append((fn, work))
            self._cond.notify()

    def _loop(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._queue)
                fn, work = self._queue.pop(0)
            if fn is None:
                return
            try:
                fn()
            except BaseException as exc:  # noqa: BLE001 - handed to whoever waits
                work.finish(exc)
            else:
                work.finish()

    def stop(self) -> None:
        self.put(None, Work(0.0, What(0, "stop")))
        self._thread.join(1.0)
