"""Lesson 02 exercises (parts 02a and 02b): the notebooks' solutions score full points, realistic
mistakes less, each with a reason in the lesson's terms (which chunk, summed over which ranks;
how many messages a tree or a ring sends)."""

from __future__ import annotations

import sys
from pathlib import Path

import cloudpickle
import pytest
import torch

from conftest import full, less
from test_lesson01_exercises import solution  # tests/ is on sys.path

cloudpickle.register_pickle_by_value(sys.modules[__name__])  # engines cannot import tests/
SOLUTIONS = Path(__file__).resolve().parents[1] / "solutions"
TREES = SOLUTIONS / "02a_broadcast_reduce.ipynb"   # tree_broadcast, tree_reduce
RINGS = SOLUTIONS / "02b_all_reduce.ipynb"          # ring_*, tree_all_reduce


def _ring(tensor, *, chunk_of=None, gather=True, recv_first=False, left_for_send=False,
          ends_with_next=False):
    """A ring all_reduce with one mistake switched on (see the wrong versions below)."""
    from course_lib import dist
    p, r = dist.get_world_size(), dist.get_rank()
    right, left = (r + 1) % p, (r - 1) % p
    if left_for_send:
        right = left
    flat = tensor.view(-1)
    chunks = chunk_of(flat, p) if chunk_of else flat.tensor_split(p)
    incoming = torch.empty_like(chunks[0])
    first = 0 if ends_with_next else 1  # rank r sends chunk r - first in step 0
    for s in range(p - 1):
        mine, theirs = chunks[(r - s - first) % p], chunks[(r - s - first - 1) % p]
        buf = incoming[:theirs.numel()]
        if recv_first:
            dist.recv(buf, left)
            dist.send(mine, right)
        else:
            send = dist.isend(mine, right)
            dist.recv(buf, left)
            send.wait()
        theirs += buf
    if gather:
        for s in range(p - 1):
            send = dist.isend(chunks[(r - s - first + 1) % p], right)
            dist.recv(chunks[(r - s - first) % p], left)
            send.wait()


def off_by_one_chunk(tensor):
    """All-gather starts from chunk r + 1 instead of the finished chunk r."""
    from course_lib import dist
    p, r = dist.get_world_size(), dist.get_rank()
    _ring(tensor, gather=False)
    chunks = tensor.view(-1).tensor_split(p)
    for s in range(p - 1):
        send = dist.isend(chunks[(r - s + 1) % p], (r + 1) % p)
        dist.recv(chunks[(r - s) % p], (r - 1) % p)
        send.wait()


def no_all_gather(tensor):
    _ring(tensor, gather=False)


def forgets_remainder(tensor):
    def equal_chunks(flat, p):
        k = flat.numel() // p
        return [flat[i * k:(i + 1) * k] for i in range(p)]
    _ring(tensor, chunk_of=equal_chunks)


def everyone_receives_first(tensor):
    _ring(tensor, recv_first=True)


def sends_left_receives_left(tensor):
    _ring(tensor, left_for_send=True)


def whole_tensor_ring(tensor):
    """Right sums from p - 1 passes of the whole tensor (each rank adds what it got and passes
    its own on): p - 1 messages, but p times the bytes of a reduce-scatter, and no all-gather
    needed; as an all_reduce, (p-1) n elements instead of 2(p-1)/p n."""
    from course_lib import dist
    p, r = dist.get_world_size(), dist.get_rank()
    passing, incoming = tensor.clone(), torch.empty_like(tensor)
    for s in range(p - 1):
        send = dist.isend(passing, (r + 1) % p)
        dist.recv(incoming, (r - 1) % p)
        send.wait()
        tensor += incoming
        passing = incoming.clone()


def rs_ends_with_next(tensor):
    """The reduce-scatter of a convention where rank r ends with chunk r + 1 (not torch's)."""
    _ring(tensor, gather=False, ends_with_next=True)


def rs_forgets_remainder(tensor):
    def equal_chunks(flat, p):
        k = flat.numel() // p
        return [flat[i * k:(i + 1) * k] for i in range(p)]
    _ring(tensor, chunk_of=equal_chunks, gather=False)


def library_reduce_scatter(tensor):
    from course_lib import dist
    p = dist.get_world_size()
    chunks = list(tensor.view(-1).tensor_split(p))
    out = chunks[dist.get_rank()].clone()
    dist.reduce_scatter(out, chunks)  # refused: not built from send/recv


def library_all_reduce(tensor):
    from course_lib import dist
    dist.all_reduce(tensor, algorithm="ring")  # right sums, but not built from send/recv


_TREE = solution("tree_broadcast", TREES)


def from_rank_zero(tensor, src):
    """A correct binomial tree, rooted at rank 0 whatever `src` says."""
    _TREE(tensor, 0)


def naive_broadcast(tensor, src):
    from course_lib import dist
    if dist.get_rank() == src:
        for r in range(dist.get_world_size()):
            if r != src:
                dist.send(tensor, r)
    else:
        dist.recv(tensor, src)


def chain_broadcast(tensor, src):
    from course_lib import dist
    p, r = dist.get_world_size(), dist.get_rank()
    v = (r - src) % p
    if v > 0:
        dist.recv(tensor, (r - 1) % p)
    if v < p - 1:
        dist.send(tensor, (r + 1) % p)


def whole_rounds_only(tensor, src):
    """floor(lg p) rounds instead of ceil(lg p): right on 2 and 4 ranks, on 3 the last rank
    never receives (it waits: a timeout)."""
    import math

    from course_lib import dist
    p, r = dist.get_world_size(), dist.get_rank()
    v = (r - src) % p
    for j in range(int(math.log2(p))):
        k = 2 ** j
        if v < k and v + k < p:
            dist.send(tensor, (v + k + src) % p)
        elif k <= v < 2 * k:
            dist.recv(tensor, (v - k + src) % p)
    if v >= 2 ** int(math.log2(p)):
        dist.recv(tensor, (v - 2 ** int(math.log2(p)) + src) % p)


def tree_without_translation(tensor, src):
    """Virtual ranks computed but never translated back: only right when src == 0."""
    from course_lib import dist
    p = dist.get_world_size()
    v = (dist.get_rank() - src) % p
    k = 1
    while k < p:
        if v < k and v + k < p:
            dist.send(tensor, v + k)
        elif k <= v < 2 * k:
            dist.recv(tensor, v - k)
        k *= 2


@pytest.fixture
def c4(scratch_cluster_4):
    return scratch_cluster_4


_RS = solution("ring_reduce_scatter", RINGS)


@pytest.mark.cluster
def test_ring_reduce_scatter_solution_and_mistakes(c4):
    full("lesson02.ring_reduce_scatter", _RS, c4)
    for wrong, why in (
            (rs_ends_with_next, "rank 0 ends with chunk 0 summed over 1 of 4 ranks (0)"),
            (rs_forgets_remainder, "summed over all 3 ranks except its element"),
            (library_reduce_scatter, "dist.reduce_scatter is the library's"),
            (whole_tensor_ring, "sent 36 elements: in each step a rank passes on one chunk")):
        r = less("lesson02.ring_reduce_scatter", wrong, c4)
        assert why in r.reason, (wrong.__name__, r.reason)


@pytest.mark.cluster
def test_ring_all_reduce_solution_and_mistakes(c4):
    ring = solution("ring_all_reduce", RINGS, ring_reduce_scatter=_RS)
    full("lesson02.ring_all_reduce", ring, c4)
    for wrong, why in (
            (off_by_one_chunk, "rank 0 ends with chunk 0 summed over 3 of 4 ranks (1, 2, 3)"),
            (no_all_gather, "rank 0 ends with chunk 1 summed over 3 of 4 ranks (0, 2, 3)"),
            (forgets_remainder, "summed over all 3 ranks except its element"),
            (library_all_reduce, "dist.all_reduce is the library's"),
            (whole_tensor_ring, "sent 3 message(s): the ring all_reduce on 4 ranks sends 6")):
        r = less("lesson02.ring_all_reduce", wrong, c4)
        assert why in r.reason, (wrong.__name__, r.reason)
    for hangs in (everyone_receives_first, sends_left_receives_left):
        r = less("lesson02.ring_all_reduce", hangs, c4, time_limit=3)
        assert r.reason.startswith("timed out"), r.reason
    full("lesson02.ring_all_reduce", ring, c4)  # the cluster recovered


@pytest.mark.cluster
def test_tree_broadcast_solution_and_mistakes(c4):
    full("lesson02.tree_broadcast", _TREE, c4)
    for wrong, why in (
            (from_rank_zero, "rank 0 never received the data of rank 1, the root"),
            (naive_broadcast, "the root, sent 3 message(s): on 4 ranks a binomial tree takes 2"),
            (chain_broadcast, "the root, sent 1 message(s)"),
            (tree_without_translation, "timed out: 3 ranks, 7 floats from rank 1")):
        hangs = wrong is tree_without_translation  # a short limit: it waits out any limit
        r = less("lesson02.tree_broadcast", wrong, c4, **({"time_limit": 3} if hangs else {}))
        assert why in r.reason, (wrong.__name__, r.reason)
    r = less("lesson02.tree_broadcast", whole_rounds_only, c4, time_limit=3)
    assert "3 ranks" in r.reason, r.reason  # the power-of-two case passes; 3 ranks does not
    full("lesson02.tree_broadcast", _TREE, c4)  # the cluster recovered


# lesson02.tree_all_reduce ---------------------------------------------------------------------

def doubling_powers_of_two_only(tensor):
    """XOR partners without folding: on 3 ranks rank 2's partner 3 does not exist (a hang or
    an error, cut off)."""
    from course_lib import dist
    p, r = dist.get_world_size(), dist.get_rank()
    incoming, k = torch.empty_like(tensor), 1
    while k < p:
        send = dist.isend(tensor, r ^ k)
        dist.recv(incoming, r ^ k)
        send.wait()
        tensor += incoming
        k *= 2


def doubling_via_rank_zero(tensor):
    """Right sums by reducing to rank 0 and sending back: the naive algorithm's messages."""
    from course_lib import dist
    p, rank = dist.get_world_size(), dist.get_rank()
    if rank == 0:
        incoming = torch.empty_like(tensor)
        for r in range(1, p):
            dist.recv(incoming, r)
            tensor += incoming
        for r in range(1, p):
            dist.send(tensor, r)
    else:
        dist.send(tensor, 0)
        dist.recv(tensor, 0)


def folds_without_returning(tensor):
    """Folds the extra ranks in but never sends them the result: they keep their own."""
    from course_lib import dist
    p, r = dist.get_world_size(), dist.get_rank()
    pof2 = 1 << (p.bit_length() - 1)
    extra = p - pof2
    incoming = torch.empty_like(tensor)
    if r < 2 * extra and r % 2 == 0:
        dist.send(tensor, r + 1)
        return
    if r < 2 * extra:
        dist.recv(incoming, r - 1)
        tensor += incoming
    vrank = r // 2 if r < 2 * extra else r - extra
    mask = 1
    while mask < pof2:
        vpeer = vrank ^ mask
        peer = vpeer * 2 + 1 if vpeer < extra else vpeer + extra
        send = dist.isend(tensor, peer)
        dist.recv(incoming, peer)
        send.wait()
        tensor += incoming
        mask <<= 1


@pytest.mark.cluster
def test_tree_all_reduce_solution_and_mistakes(c4):
    full("lesson02.tree_all_reduce", solution("tree_all_reduce", RINGS), c4)
    for wrong, why in (
            (doubling_via_rank_zero, "sent 3 message(s), 15 elements: recursive doubling on 4 "
                                     "ranks sends 2 whole tensor(s)"),
            (folds_without_returning, "rank 0 ends with the sum over 1 of 3 ranks (0)")):
        r = less("lesson02.tree_all_reduce", wrong, c4)
        assert why in r.reason, (wrong.__name__, r.reason)
    r = less("lesson02.tree_all_reduce", doubling_powers_of_two_only, c4, time_limit=3)
    assert r.cases[0].passed and not r.cases[1].passed, r.reason  # 4 ranks pass, 3 do not


# lesson02.tree_reduce -------------------------------------------------------------------------

def reduce_to_root_directly(tensor, dst):
    """Everyone sends straight to the root: right sum, p - 1 messages into one rank."""
    from course_lib import dist
    p, rank = dist.get_world_size(), dist.get_rank()
    if rank != dst:
        dist.send(tensor, dst)
        return
    incoming = torch.empty_like(tensor)
    for r in range(p):
        if r != dst:
            dist.recv(incoming, r)
            tensor += incoming


def reduce_in_place_everywhere(tensor, dst):
    """Adds into every rank's own tensor: the root is right, the others are clobbered."""
    from course_lib import dist
    p, rank = dist.get_world_size(), dist.get_rank()
    v = (rank - dst) % p
    incoming, k = torch.empty_like(tensor), 1
    while k < p:
        if v & k:
            dist.send(tensor, (v - k + dst) % p)
            return
        if v + k < p:
            dist.recv(incoming, (v + k + dst) % p)
            tensor += incoming
        k *= 2


def reduce_ignoring_dst(tensor, dst):
    _tree_reduce(tensor, 0)


_tree_reduce = solution("tree_reduce", TREES)


@pytest.mark.cluster
def test_tree_reduce_solution_and_mistakes(c4):
    full("lesson02.tree_reduce", _tree_reduce, c4)
    for wrong, why in (
            (reduce_to_root_directly, "received 3 message(s); in a binomial tree on 4 ranks "
                                      "rooted at rank 0 it sends 0 and receives 2"),
            (reduce_in_place_everywhere, "rank 2's tensor changed to the sum over 2 of 4 ranks "
                                         "(2, 3): a reduce changes only the root's tensor"),
            (reduce_ignoring_dst, "rank 0's tensor changed to the sum over 3 of 3 ranks")):
        r = less("lesson02.tree_reduce", wrong, c4)
        assert why in r.reason, (wrong.__name__, r.reason)
    assert any("rank 2, the root, ends with the sum over 1 of 3 ranks (2)" in row.note
               for c in r.cases for row in c.rows), r
