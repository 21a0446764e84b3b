"""The flight recorder: each group's last collectives on this rank, and what every rank's
record says when a collective hangs or ranks disagree.

Every collective is an `Entry` (sequence number in its group, op, dtype and shape, start, end,
state), the last `TRACE_SIZE` kept per group, as NCCL's flight recorder keeps them
(`TORCH_NCCL_TRACE_BUFFER_SIZE`). When a collective fails, the rank asks every other rank of
the group for its record (the transport's `query`, answered by the peer's listener thread, so
a rank asleep or stuck elsewhere still answers) and `diagnose` says who is behind: lesson 09b's
`course_lib.dist.diagnosis.standing` reads each record, `diagnose` puts the verdicts in words. With
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

from course_lib.dist import diagnosis
from course_lib.dist.wire import DTYPE_CODE, DTYPES
from course_lib.i18n import N_, _

TRACE_SIZE = 2000
OPS = ("broadcast", "reduce", "gather", "scatter", "all_gather", "reduce_scatter",
       "all_reduce", "barrier", "all_to_all", "all_to_all_single")
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
    return diagnosis.same_call(vars(a), vars(b))


def _ranks(ranks: list[int]) -> str:
    if len(ranks) == 1:
        return _("rank {rank}", rank=ranks[0])
    return _("ranks {ranks} and {last}", ranks=", ".join(map(str, ranks[:-1])), last=ranks[-1])


def _note(verdict: dict, rank: int, entry: Entry, group: str,
          by_state: dict[str, list[int]]) -> str | None:
    """A rank's verdict in words, or None when it made the same call (then it is counted in
    `by_state` under the state it has it in)."""
    kind = verdict["verdict"]
    if kind == "no answer":
        return _("rank {rank} did not answer (its process may be gone)", rank=rank)
    if kind == "same call":
        by_state[verdict["state"]].append(rank)
        return None
    seq = verdict["last completed"]
    last = (_("last completed #{seq}", seq=seq) if seq is not None else
            _("completed none of this group's"))
    now, called = verdict["in"], verdict["called"]
    if now:
        where = _("is in {call}", call=Entry(**now).what(group))
    elif called:
        where = _("called {call} ({state})", call=Entry(**called).what(group),
                  state=_(called["state"]))
    else:
        where = _("is not in a collective (it has not called #{seq})", seq=entry.seq)
    return _("rank {rank} {last} and {where}", rank=rank, last=last, where=where)


def diagnose(entry: Entry, group: str, records: dict[int, list[dict] | None]) -> str:
    """What every other rank's record says about `entry`: who completed it, who is in it too,
    and for the rest what they last completed and where they are now (each rank's verdict is
    `diagnosis.standing`'s, the learner's own once lesson 09b is done)."""
    call = asdict(entry)
    by_state: dict[str, list[int]] = {"completed": [], "started": [], "failed": []}
    notes = []
    for rank, record in sorted(records.items()):
        try:
            note = _note(diagnosis.standing(call, record), rank, entry, group, by_state)
        except Exception as exc:  # noqa: BLE001 - an unfinished exercise must not hide the error
            note = (f"rank {rank}: no verdict ({type(exc).__name__} in "
                    "course_lib.dist.diagnosis.standing, lesson 09b)")
        if note:
            notes.append(note)
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
