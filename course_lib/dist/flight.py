"""The flight recorder: each group's last collectives on this rank, and what every rank's
record says when a collective hangs or ranks disagree.

Every collective is an `Entry` (sequence number in its group, op, dtype and shape, start, end,
state), the last `TRACE_SIZE` kept per group, as NCCL's flight recorder keeps them
(`TORCH_NCCL_TRACE_BUFFER_SIZE`). When a collective fails, the rank asks every other rank of
the group for its record (the transport's `query`, answered by the peer's listener thread, so
a rank asleep or stuck elsewhere still answers) and `diagnose` says who is behind. With
`TORCH_DISTRIBUTED_DEBUG=DETAIL` (torch's switch, read at init) every collective first trades
`fingerprint`s with its group, so ranks calling different collectives, shapes or dtypes at
the same sequence number fail at once, naming both.
"""

from __future__ import annotations

import collections
import os
import time
from dataclasses import asdict, dataclass

import torch

from course_lib.dist.wire import DTYPE_CODE, DTYPES
from course_lib.i18n import N_, _

TRACE_SIZE = 2000
OPS = ("broadcast", "reduce", "gather", "scatter", "all_gather", "reduce_scatter",
       "all_reduce", "barrier")
FINGERPRINT_DIMS = 8
COMPLETED, FAILED = N_("completed"), N_("failed")  # an entry's states after "started"
_DTYPE_NAMES = {dt: str(dt).removeprefix("torch.") for dt in DTYPES}  # "float32", ...


def detail_from_env() -> bool:
    """torch's switch: TORCH_DISTRIBUTED_DEBUG=DETAIL checks every collective across ranks."""
    return os.environ.get("TORCH_DISTRIBUTED_DEBUG", "").upper() == "DETAIL"


@dataclass
class Entry:
    """One collective as this rank saw it."""

    seq: int
    op: str
    dtype: str | None
    shape: list[int] | None
    start: float
    end: float | None = None
    state: str = N_("started")  # then "completed" or "failed"
    algorithm: str | None = None  # all_reduce's, as chosen (by its "auto" table or by name)

    def what(self, group: str) -> str:
        """'all_reduce #1583 (float32[1048576], world)'."""
        data = f"{self.dtype}{self.shape}, " if self.dtype else ""
        return f"{self.op} #{self.seq} ({data}{group})"


class Recorder:
    """The last TRACE_SIZE collectives of one group on this rank. Async ops finish on the
    group's worker thread, and a peer's query reads the record from the listener's: no lock
    is needed, as appending to a deque and copying it are atomic and each entry has one
    writer at a time (a reader may see an entry's end before its state)."""

    def __init__(self) -> None:
        self.entries: collections.deque[Entry] = collections.deque(maxlen=TRACE_SIZE)

    def start(self, seq: int, op: str, tensor: torch.Tensor | None) -> Entry:
        """Note collective `op` (one of OPS) as started; it runs on every call, so it is lean."""
        if tensor is None:
            entry = Entry(seq, op, None, None, time.time())
        else:
            dtype = tensor.dtype
            entry = Entry(seq, op, _DTYPE_NAMES.get(dtype) or str(dtype).removeprefix("torch."),
                          list(tensor.shape), time.time())
        self.entries.append(entry)
        return entry

    def finish(self, entry: Entry, failed: bool) -> None:
        entry.end, entry.state = time.time(), FAILED if failed else COMPLETED

    def snapshot(self) -> list[dict]:
        return [asdict(e) for e in list(self.entries)]


def fingerprint(entry: Entry) -> torch.Tensor:
    """The entry as int64s a peer compares: seq, op, dtype, ndim, the first 8 dims."""
    shape = entry.shape or []
    dtype = DTYPE_CODE[getattr(torch, entry.dtype)] if entry.dtype else -1
    dims = (shape + [-1] * FINGERPRINT_DIMS)[:FINGERPRINT_DIMS]
    return torch.tensor([entry.seq, OPS.index(entry.op), dtype, len(shape), *dims],
                        dtype=torch.int64)


def from_fingerprint(f: torch.Tensor) -> Entry:
    seq, op, dtype, ndim, *dims = (int(v) for v in f.tolist())
    return Entry(seq, OPS[op] if 0 <= op < len(OPS) else f"op{op}",
                 str(DTYPES[dtype]).removeprefix("torch.") if 0 <= dtype < len(DTYPES)
                 else None, dims[:min(ndim, FINGERPRINT_DIMS)] if dtype >= 0 else None, 0.0)


def same_call(a: Entry, b: Entry) -> bool:
    return (a.seq, a.op, a.dtype, a.shape) == (b.seq, b.op, b.dtype, b.shape)


def _ranks(ranks: list[int]) -> str:
    if len(ranks) == 1:
        return _("rank {rank}", rank=ranks[0])
    return _("ranks {ranks} and {last}", ranks=", ".join(map(str, ranks[:-1])), last=ranks[-1])


def diagnose(entry: Entry, group: str, records: dict[int, list[dict] | None]) -> str:
    """What every other rank's record says about `entry`: who completed it, who is in it too,
    and for the rest what they last completed and where they are now."""
    by_state: dict[str, list[int]] = {"completed": [], "started": [], "failed": []}
    notes = []
    for rank, record in sorted(records.items()):
        if record is None:
            notes.append(_("rank {rank} did not answer (its process may be gone)", rank=rank))
            continue
        entries = [Entry(**e) for e in record]
        at_seq = [e for e in entries if e.seq == entry.seq]
        if at_seq and same_call(at_seq[-1], entry):
            by_state[at_seq[-1].state].append(rank)
            continue
        done = [e.seq for e in entries if e.state == "completed" and e.seq < entry.seq]
        last = (_("last completed #{seq}", seq=max(done)) if done else
                _("completed none of this group's"))
        now = [e for e in entries if e.state == "started"]
        where = (_("is in {call}", call=now[-1].what(group)) if now else
                 _("is not in a collective (it has not called #{seq})", seq=entry.seq))
        if at_seq and not now:
            where = _("called {call} ({state})", call=at_seq[-1].what(group),
                      state=_(at_seq[-1].state))
        notes.append(_("rank {rank} {last} and {where}", rank=rank, last=last, where=where))
    done, inside, failed = by_state["completed"], by_state["started"], by_state["failed"]
    # one message per number, as Spanish (and English's "is"/"are") agree the verb with it
    parts = []
    if done:
        parts.append(_("{rank} completed it", rank=_ranks(done)) if len(done) == 1 else
                     _("{ranks} completed it", ranks=_ranks(done)))
    if inside:
        parts.append(_("{rank} is in it too", rank=_ranks(inside)) if len(inside) == 1 else
                     _("{ranks} are in it too", ranks=_ranks(inside)))
    if failed:
        parts.append(_("{rank} failed in it too", rank=_ranks(failed)) if len(failed) == 1 else
                     _("{ranks} failed in it too", ranks=_ranks(failed)))
    return "; ".join(parts + notes) or _("no other rank in the group")
