"""The shared-memory ring one link direction's frames travel on (course_lib/dist/ring.py),
both ends in this process: bytes cross the ring's end intact, and a reducing receive takes
its payload straight from the ring, or through a copy where it wraps, with the same result."""

from __future__ import annotations

import socket
import threading
import time

import pytest
import torch

from course_lib.dist import ring
from course_lib.dist.wire import WireTimeout, byte_view

pytestmark = pytest.mark.skipif(not ring.supported(), reason="the ring needs x86's ordering")

RING_BYTES = 1000  # not a multiple of any element size: payloads wrap at odd places


@pytest.fixture
def stream():
    """A ring whose writer and reader are the same object (they share ctrl and data)."""
    a, b = socket.socketpair()
    try:
        yield ring.RingStream(a, memoryview(bytearray(192)), memoryview(bytearray(RING_BYTES)))
    finally:
        a.close()
        b.close()


def test_bytes_cross_the_ring_end_in_order(stream):
    deadline = time.monotonic() + 5
    sent = [bytes(range(k % 256, k % 256 + 1)) * n for k, n in enumerate([300, 500, 7, 640, 1])]
    for part in sent:
        stream.send([part], deadline)
        got = bytearray(len(part))
        stream.recv_exact(memoryview(got), deadline)
        assert got == part
    assert stream.head[0] == stream.tail[0] == sum(map(len, sent))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.int16])
def test_a_reducing_receive_equals_the_sum_in_place_and_across_the_end(stream, dtype):
    """Payloads at every offset of the ring, some lying in one piece (reduced from the ring)
    and some wrapping (reduced from a copy): each gives exactly acc + message."""
    deadline = time.monotonic() + 5
    gen = torch.Generator().manual_seed(0)
    wrapped = direct = 0
    for numel in [37, 120, 5, 64, 101, 3, 90, 77, 0, 111]:
        message = torch.randint(-50, 50, (numel,), generator=gen).to(dtype)
        acc = torch.randint(-50, 50, (numel,), generator=gen).to(dtype)
        expected = acc + message
        start = stream.tail[0] % RING_BYTES
        if start + message.nbytes > RING_BYTES:
            wrapped += 1
        else:
            direct += 1
        stream.send([byte_view(message)], deadline)
        stream.recv_reduce(acc, torch.Tensor.add_, deadline)
        assert torch.equal(acc, expected)
        assert stream.tail[0] == stream.head[0]
    assert wrapped and direct  # both paths were taken


@pytest.mark.parametrize("dtype", [torch.float32, torch.int16, torch.bool])
def test_a_frame_written_from_the_tensor_reads_back_at_every_offset(stream, dtype):
    """put_frame (a small message's path: the payload copied from the tensor's own memory)
    gives the reader the header's and the tensor's bytes, whether the frame lies in one
    piece or wraps around the ring's end, and however its header falls."""
    deadline = time.monotonic() + 5
    gen = torch.Generator().manual_seed(1)
    wraps = 0
    for k in range(60):
        header = bytes(range(k, k + 8 + k % 5))
        tensor = torch.randint(0, 2, (k % 23 + 1,), generator=gen).to(dtype)
        wraps += stream.head[0] % RING_BYTES + len(header) + tensor.nbytes > RING_BYTES
        stream.put_frame(header, tensor)
        got = bytearray(len(header) + tensor.nbytes)
        stream.recv_exact(memoryview(got), deadline)
        assert bytes(got) == header + bytes(byte_view(tensor))
        assert stream.tail[0] == stream.head[0]
    assert 0 < wraps < 60


def test_a_parsed_header_is_read_in_place_and_given_back_only_after_parsing(stream):
    """recv_parsed hands `parse` the next bytes where they lie in the ring (a copy only where
    they wrap); the writer gets their room back only after `parse` returns, so it cannot
    overwrite a header being decoded."""
    deadline = time.monotonic() + 5
    scratch = memoryview(bytearray(88))
    in_place = copied = 0
    for k in range(30):
        frame = bytes((k + i) % 256 for i in range(88))
        stream.send([frame, b"." * (k * 7 % 50)], deadline)
        room_before = stream.room()

        def parse(view):
            nonlocal in_place, copied
            if view.obj is scratch.obj:
                copied += 1  # read out already: the copy is ours
            else:
                in_place += 1
                assert stream.room() == room_before  # not released while parsing
            return bytes(view)

        assert stream.recv_parsed(scratch, parse, deadline) == frame
        assert stream.room() == room_before + 88
        stream.recv_exact(memoryview(bytearray(k * 7 % 50)), deadline)
    assert in_place and copied


def test_a_header_cut_short_times_out_saying_how_much_had_come(stream):
    stream.send([b"h" * 40], time.monotonic() + 5)
    with pytest.raises(WireTimeout) as caught:
        stream.recv_parsed(memoryview(bytearray(88)), bytes, time.monotonic() + 0.05)
    assert caught.value.received == 40


def test_a_reducing_receive_waits_for_a_payload_written_in_pieces(stream):
    deadline = time.monotonic() + 5
    message = torch.arange(100, dtype=torch.float32)
    raw = bytes(byte_view(message))

    def writer():
        for k in range(0, len(raw), 120):
            time.sleep(0.01)
            stream.send([raw[k:k + 120]], deadline)

    thread = threading.Thread(target=writer)
    thread.start()
    acc = torch.ones(100)
    stream.recv_reduce(acc, torch.Tensor.add_, deadline)
    thread.join()
    assert torch.equal(acc, message + 1)


def test_a_reducing_receive_times_out_saying_how_much_had_come(stream):
    half = bytes(byte_view(torch.ones(50)))[:100]
    stream.send([half], time.monotonic() + 5)
    with pytest.raises(WireTimeout) as caught:
        stream.recv_reduce(torch.zeros(50), torch.Tensor.add_, time.monotonic() + 0.05)
    assert caught.value.received == 100


@pytest.mark.parametrize("soon, yield_seconds, sleeps",
                         [(True, 5.0, False), (True, 0.0, True), (False, 5.0, True)])
def test_a_reader_polls_through_gaps_inside_a_frame_and_sleeps_between_frames(
        stream, monkeypatch, soon, yield_seconds, sleeps):
    """Waiting for the rest of a frame already begun (`soon`), a reader polls for up to
    YIELD_SECONDS (no system call to sleep, no wake-up to wait for: a large message's
    doorbells come a slot copy apart), then sleeps; waiting for a new frame it sleeps after
    its spin, leaving the core to a peer that may be busy for long. The writer comes 30 ms
    later in every case."""
    calls = []
    real_select = ring.select.select
    monkeypatch.setattr(ring, "YIELD_SECONDS", yield_seconds)
    monkeypatch.setattr(ring.select, "select", lambda *a: calls.append(a) or real_select(*a))
    writer = threading.Timer(0.03, lambda: stream.send([b"x"], time.monotonic() + 5))
    writer.start()
    got = bytearray(1)
    stream.recv_exact(memoryview(got), time.monotonic() + 5, soon=soon)
    writer.join()
    assert got == b"x" and bool(calls) is sleeps, calls


@pytest.mark.parametrize("how", ["closes", "resets"])
def test_a_peer_gone_is_peer_closed_whether_it_closed_or_reset(how):
    """A peer that closes its end, or dies with bytes unread so the kernel resets the link,
    is PeerClosed for `check_peer` (which the shared-memory waits poll), never a raw
    ConnectionResetError that no error of ours names; a live quiet peer is not."""
    import struct

    from course_lib.dist.stream import PeerClosed

    server = socket.create_server(("127.0.0.1", 0))
    mine = socket.create_connection(server.getsockname())
    theirs, _addr = server.accept()
    server.close()
    try:
        ring.check_peer(mine)  # alive and silent
        if how == "resets":
            mine.sendall(b"unread")
            time.sleep(0.05)
            theirs.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        theirs.close()
        time.sleep(0.05)
        with pytest.raises(PeerClosed):
            ring.check_peer(mine)
    finally:
        mine.close()
