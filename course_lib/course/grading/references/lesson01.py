"""Lesson 01's expected values and explanations (judge side: see this package's docstring).

The references here do not import `course_lib.dist.wire`, whose exercise regions a student
release leaves empty: the header format is written out from its specification.
"""

from __future__ import annotations

import math
import struct

import torch

from course_lib.course.grading.exercises.lesson01 import SCENARIOS, partner, payload, summary
from course_lib.i18n import _

FORMAT = struct.Struct("<IqBBHQ8q")  # magic, tag, dtype code, ndim, flags, nbytes, shape[8]
MAGIC = 0x54534443
DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.uint8, torch.int8,
          torch.int16, torch.int32, torch.int64, torch.bool, torch.complex64, torch.complex128]
FIELDS = ("magic", "tag", "dtype code", "ndim", "flags", "nbytes")


# --- lesson01.encode_header ------------------------------------------------------------------

def encode_header(tag: int, tensor: torch.Tensor) -> bytes:
    shape = list(tensor.shape)
    return FORMAT.pack(MAGIC, tag, DTYPES.index(tensor.dtype), len(shape), 0,
                       tensor.numel() * tensor.element_size(), *shape, *[0] * (8 - len(shape)))


def _fields(header: bytes) -> dict:
    values = FORMAT.unpack(header)
    return {**dict(zip(FIELDS, values[:6])), "shape": list(values[6:])}


def explain_encode_header(case, rank, expected, got) -> str | None:
    """The first header field that differs, read back from both headers, in the table's
    terms (for nbytes: how many elements of how many bytes the tensor holds)."""
    if not isinstance(got, (bytes, bytearray)):
        return _("returned a {kind}, not bytes", kind=type(got).__name__)
    if len(got) != FORMAT.size:
        return _("{n} bytes: a header is always {size}", n=len(got), size=FORMAT.size)
    want, have = _fields(expected), _fields(bytes(got))
    tensor = case.args[1]
    for field in (*FIELDS, "shape"):
        if want[field] == have[field]:
            continue
        if field == "nbytes":
            return _("nbytes is {got}; the tensor holds {numel} elements of {size} byte(s) "
                     "({dtype}), {want} bytes", got=have[field], numel=tensor.numel(),
                     size=tensor.element_size(), dtype=str(tensor.dtype).replace("torch.", ""),
                     want=want[field])
        if field == "shape":
            return _("the shape field reads {got}; the tensor's shape {shape}, padded with "
                     "zeros to 8 entries, is {want}", got=have[field],
                     shape=tuple(tensor.shape), want=want[field])
        if field == "dtype code":
            return _("dtype code {got} is {named}; the tensor is {dtype}, code {want}",
                     got=have[field], want=want[field],
                     named=str(DTYPES[have[field]]).replace("torch.", "")
                     if have[field] < len(DTYPES) else _("no dtype"),
                     dtype=str(tensor.dtype).replace("torch.", ""))
        return _("field {field} is {got}, expected {want}", field=field, got=have[field],
                 want=want[field])
    return None


# --- lesson01.decode_header ------------------------------------------------------------------

def decode_header(data: bytes):
    """The decoded tuple, or "rejected" for a header the receiver must refuse."""
    magic, tag, code, ndim, _flags, nbytes, *shape = FORMAT.unpack(data)
    if magic != MAGIC or code >= len(DTYPES) or ndim > 8 or min(shape) < 0 or any(shape[ndim:]):
        return "rejected"
    dtype, shape = DTYPES[code], tuple(shape[:ndim])
    if nbytes != math.prod(shape) * dtype.itemsize:
        return "rejected"
    return tag, dtype, shape, nbytes


def explain_decode_header(case, rank, expected, got) -> str | None:
    """A malformed header accepted, a valid one refused, or the field of the tuple that
    differs."""
    if expected == "rejected":
        return _("the receiver must refuse this header ({label}), not decode it",
                 label=case.describe("decode_header"))
    if got == "rejected":
        return _("a valid header was refused")
    if not isinstance(got, (tuple, list)) or len(got) != 4:
        return _("returned {got}; a decoded header is (tag, dtype, shape, nbytes)",
                 got=repr(got)[:60])
    for name, want, have in zip(("tag", "dtype", "shape", "nbytes"), expected, got):
        if name == "shape" and tuple(have) != want and len(have) > len(want):
            return _("shape {got}: only the first ndim = {ndim} entries are the tensor's; the "
                     "rest are padding", got=tuple(have), ndim=len(want))
        if have != want and not (name == "shape" and tuple(have) == want):
            return _("{name} is {got}, expected {want}", name=name, got=have, want=want)
    return None


# --- lesson01.recv_exact ---------------------------------------------------------------------

def recv_exact(scenario: str) -> dict:
    """Filled with the frame, unless the peer closes mid-frame (PeerClosed) or pauses past the
    deadline (WireTimeout)."""
    if scenario == "peer closes mid-frame":
        return {"outcome": "raised PeerClosed", "buffer == frame": None}
    if scenario == "peer too slow for the deadline":
        return {"outcome": "raised WireTimeout", "buffer == frame": None}
    return {"outcome": "filled", "buffer == frame": True}


def explain_recv_exact(case, rank, expected, got) -> str | None:
    """What the feeder did in this case, against what the function made of it."""
    if not isinstance(got, dict):
        return None
    scenario = case.args[0]
    pieces, pause, size, deadline = SCENARIOS[scenario]
    outcome, want = got.get("outcome"), expected["outcome"]
    did = _("returned") if outcome == "filled" else _(
        "raised {error}", error=str(outcome).removeprefix("raised "))
    if want == "filled" and outcome == "filled":
        return _("the function returned, but the view does not hold the frame's bytes in "
                 "order: the frame came in {n} piece(s) of {pieces} bytes", n=len(pieces),
                 pieces=pieces)
    if want == "filled":
        return _("the frame ({size} bytes, in {n} piece(s) of {pieces}) all arrived within the "
                 "deadline, but the function {outcome}", size=size, n=len(pieces),
                 pieces=pieces, outcome=did)
    if scenario == "peer closes mid-frame":
        return _("the peer sent {sent} of {size} bytes and closed the connection, a read of 0 "
                 "bytes: that is PeerClosed, not a slow peer; the function {outcome}",
                 sent=sum(pieces), size=size, outcome=did)
    return _("the peer sent {first} bytes, then nothing for {pause} s, past the {deadline} s "
             "deadline: that is WireTimeout; the function {outcome}", first=pieces[0],
             pause=f"{pause:g}", deadline=f"{deadline:g}", outcome=did)


# --- lesson01.exchange -----------------------------------------------------------------------

def exchange(rank: int, world_size: int, k: int, n: int, dtype: str, shift: int):
    peer = partner(rank, k, shift) if rank < k else rank
    if peer == rank:
        return None  # sits out this case
    return {"received": summary(payload(peer, n, getattr(torch, dtype))),
            "own tensor unchanged": True, "messages sent, received": (1, 1)}


def explain_exchange(case, rank, expected, got) -> str | None:
    """Whose tensor came back, whether the rank's own was overwritten, and how many messages
    went each way, in that order."""
    if not isinstance(expected, dict) or not isinstance(got, dict):
        return None
    k, n, dtype, shift = case.args[2:]
    peer = partner(rank, k, shift)
    received = got.get("received")
    if received != expected["received"]:
        if received == summary(payload(rank, n, getattr(torch, dtype))):
            return _("rank {rank} returned its own tensor, not the one rank {peer} sent",
                     rank=rank, peer=peer)
        return _("rank {rank} did not return the tensor rank {peer} sent", rank=rank, peer=peer)
    if got.get("own tensor unchanged") is False:
        return _("rank {rank} returned rank {peer}'s tensor but overwrote its own with it: the "
                 "caller's tensor must stay as it was", rank=rank, peer=peer)
    counts = got.get("messages sent, received")
    if counts != expected["messages sent, received"] and isinstance(counts, (list, tuple)):
        sent, received = counts
        if sent == 0 and received == 0:
            return _("rank {rank} sent and received no point-to-point message: an exchange "
                     "between two ranks is one send and one receive, not a collective",
                     rank=rank)
        return _("rank {rank} sent {sent} and received {received} messages; an exchange is one "
                 "message each way, the whole tensor in one", rank=rank, sent=sent,
                 received=received)
    return None
