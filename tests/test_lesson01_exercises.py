"""Lesson 01 exercises: the notebook's solutions score full points, realistic mistakes less."""

from __future__ import annotations

import socket
import sys
from pathlib import Path

import cloudpickle
import nbformat
import pytest
import torch

from conftest import full, less
from course_lib import dist
from course_lib.dist import stream, wire
from course_lib.course.grading.learner import grade_function

cloudpickle.register_pickle_by_value(sys.modules[__name__])  # engines cannot import tests/
NOTEBOOK = Path(__file__).resolve().parents[1] / "solutions" / "01_point_to_point.ipynb"


def solution(name: str, notebook: Path = NOTEBOOK, **names):
    """The function `name` as the solution notebook defines it (its cell run on its own, with
    `names`: the notebook's other functions it calls)."""
    for cell in nbformat.read(notebook, as_version=4).cells:
        if cell.cell_type == "code" and f"def {name}(" in cell.source:
            namespace = {**vars(wire),  # exported cells use the module's own names
                         "__name__": f"solution_{name}", "torch": torch, "dist": dist,
                         "wire": wire, **names}
            exec(compile(cell.source, f"{notebook.name}:{name}", "exec"), namespace)
            return namespace[name]
    raise LookupError(f"{notebook.name} defines no function {name}")


# lesson01.encode_header -------------------------------------------------------------------

def _pack(tag, tensor, code, nbytes, shape):
    shape = list(shape) + [0] * (wire.MAX_DIMS - len(shape))
    return wire.HEADER.pack(wire.MAGIC, tag, code, len(tensor.shape), 0, nbytes, *shape)


def four_bytes_per_element(tag, tensor):
    return _pack(tag, tensor, wire.DTYPE_CODE[tensor.dtype], tensor.numel() * 4, tensor.shape)


def shape_reversed(tag, tensor):
    return _pack(tag, tensor, wire.DTYPE_CODE[tensor.dtype],
                 tensor.numel() * tensor.element_size(), tuple(reversed(tensor.shape)))


def no_dtype(tag, tensor):
    return _pack(tag, tensor, 0, tensor.numel() * tensor.element_size(), tensor.shape)


def test_encode_header_solution_and_mistakes():
    full("lesson01.encode_header", solution("encode_header"))
    full("lesson01.encode_header", wire.encode_header)
    for wrong, why in ((four_bytes_per_element, "nbytes is 20; the tensor holds 5 elements of 8"),
                       (shape_reversed, "the shape field reads [4, 3, 0, 0, 0, 0, 0, 0]"),
                       (no_dtype, "dtype code 0 is float32; the tensor is int64, code 8")):
        r = less("lesson01.encode_header", wrong)
        assert why in r.reason, r.reason


# lesson01.decode_header -------------------------------------------------------------------

def trusts_everything(data):
    magic, tag, code, ndim, _, nbytes, *shape = wire.HEADER.unpack(data)
    return tag, wire.DTYPES[code], tuple(shape[:ndim]), nbytes


def keeps_padding(data):
    tag, dtype, _, nbytes = wire.decode_header(data)
    return tag, dtype, tuple(wire.HEADER.unpack(data)[6:]), nbytes


def float32_sizes_only(data):
    magic, tag, code, ndim, _, nbytes, *shape = wire.HEADER.unpack(data)
    if magic != wire.MAGIC or code >= len(wire.DTYPES) or ndim > wire.MAX_DIMS:
        raise ValueError("bad header")
    if nbytes != torch.Size(shape[:ndim]).numel() * 4:
        raise ValueError("bad nbytes")
    return tag, wire.DTYPES[code], tuple(shape[:ndim]), nbytes


def test_decode_header_solution_and_mistakes():
    full("lesson01.decode_header", solution("decode_header"))
    for wrong, why in ((trusts_everything, "must refuse this header (bad magic"),
                       (keeps_padding, "only the first ndim = 2 entries are the tensor's"),
                       (float32_sizes_only, "int64 (7,), tag 5: a valid header was refused")):
        r = less("lesson01.decode_header", wrong)
        assert why in r.reason, r.reason


def test_not_implemented_scores_zero():
    def stub(data):
        raise NotImplementedError
    r = grade_function("lesson01.decode_header", stub)
    assert r.points == 0, r  # the harness must not turn NotImplementedError into "rejected"


# lesson01.exchange (on 2, 3 and 4 ranks of a 4-rank cluster) ----------------------------------------------------

def both_send_first(tensor, peer):
    from course_lib import dist
    received = torch.empty_like(tensor)
    dist.send(tensor, peer)
    dist.recv(received, peer)
    return received


def returns_own(tensor, peer):
    from course_lib import dist
    received = torch.empty_like(tensor)
    works = [dist.irecv(received, peer), dist.isend(tensor, peer)]
    for w in works:
        w.wait()
    return tensor


def receives_into_input(tensor, peer):
    """The higher rank overwrites its tensor with the message, then sends that back."""
    from course_lib import dist
    if dist.get_rank() < peer:
        dist.send(tensor, peer)
        dist.recv(tensor, peer)
    else:
        dist.recv(tensor, peer)
        dist.send(tensor, peer)
    return tensor


def in_pieces(tensor, peer):
    """Right tensor, in four messages each way: the check counts one."""
    from course_lib import dist
    received = torch.empty_like(tensor)
    mine, theirs = tensor.view(-1).tensor_split(4), received.view(-1).tensor_split(4)
    for a, b in zip(mine, theirs):
        works = [dist.irecv(b, peer), dist.isend(a, peer)]
        for w in works:
            w.wait()
    return received


def by_all_gather(tensor, peer):
    """Right tensor from the library's all_gather: a collective, which the check refuses."""
    from course_lib import dist
    parts = [torch.empty_like(tensor) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, tensor)
    return parts[peer]


@pytest.mark.cluster
def test_exchange_solution_and_mistakes(scratch_cluster_4):
    c = scratch_cluster_4
    full("lesson01.exchange", solution("exchange"), c)
    for wrong, why in ((returns_own, "rank 0 returned its own tensor, not the one rank 1 sent"),
                       (receives_into_input, "but overwrote its own with it"),
                       (in_pieces, "rank 0 sent 4 and received 4 messages; an exchange is one "
                                   "message each way"),
                       (by_all_gather, "all_gather")):
        r = less("lesson01.exchange", wrong, c)
        notes = [r.reason] + [row.note for case in r.cases for row in case.rows]
        assert any(why in note for note in notes), r
    r = less("lesson01.exchange", both_send_first, c, time_limit=4)
    assert r.reason.startswith("timed out"), r.reason  # the 16 MiB case deadlocks
    assert r.cases[0].passed  # a small message fits in the link's buffer: no deadlock
    full("lesson01.exchange", solution("exchange"), c)  # the cluster recovered


# lesson01.recv_exact (local socket pairs) -------------------------------------------------------

def one_read(sock, view, deadline):
    """One recv_into: a frame that arrives in pieces is left partly empty."""
    stream.set_timeout(sock, socket.SO_RCVTIMEO, deadline)
    if sock.recv_into(view, len(view)) == 0 and len(view):
        raise wire.PeerClosed("closed")


def no_deadline(sock, view, deadline):
    """Loops and detects EOF, but never arms the deadline: a slow peer is waited for forever
    (here until it closes, so the error is the wrong one)."""
    got = 0
    while got < len(view):
        k = sock.recv_into(view[got:], len(view) - got)
        if k == 0:
            raise wire.PeerClosed("closed")
        got += k


def eof_as_timeout(sock, view, deadline):
    """Treats a closed peer like a slow one: raises WireTimeout for both."""
    got = 0
    while got < len(view):
        stream.set_timeout(sock, socket.SO_RCVTIMEO, deadline)
        try:
            k = sock.recv_into(view[got:], len(view) - got)
        except (BlockingIOError, TimeoutError):
            raise wire.WireTimeout(got) from None
        if k == 0:
            raise wire.WireTimeout(got)
        got += k


def test_recv_exact_solution_and_mistakes():
    full("lesson01.recv_exact", wire.recv_exact)
    for wrong, why in ((one_read, "the view does not hold the frame's bytes in order"),
                       (no_deadline, "past the 0.3 s deadline: that is WireTimeout; the function "
                                     "returned"),
                       (eof_as_timeout, "that is PeerClosed, not a slow peer; the function "
                                        "raised WireTimeout")):
        r = less("lesson01.recv_exact", wrong)
        assert why in r.reason, r.reason
