"""Each case of a distributed check starts with nothing in flight: a message one case leaves
behind is that case's failure, named as such, and never reaches the next case's receive."""

from __future__ import annotations

import sys

import cloudpickle
import pytest
import torch

from course_lib.course.grading import RANK, WORLD_SIZE, case
from course_lib.course.grading.learner import grade_function
from course_lib.course.grading.judge import strays
from course_lib.course.grading.sub_worlds import (counting_messages, first_ranks_as_world,
                                          register_on_sub_worlds)

pytestmark = pytest.mark.cluster
cloudpickle.register_pickle_by_value(sys.modules[__name__])  # engines cannot import tests/
NAME = "lesson93.shift"


def _shift_harness(fn, rank: int, world_size: int, k: int, n: int, last: bool):
    """On a world of the first k ranks: rank r's tensor holds r's values; fn passes it one
    rank to the right. Only the values are compared: no message count in this check."""
    if rank >= k:
        return None
    t = torch.full((n,), float(rank))
    with first_ranks_as_world(k), counting_messages():
        fn(t, last)
    return t


def _shift_reference(rank: int, world_size: int, k: int, n: int, last: bool):
    return None if rank >= k else torch.full((n,), float((rank - 1) % k))


register_on_sub_worlds(
    NAME, "93_isolation_test", params=("tensor", "last"),
    cases=[case(RANK, WORLD_SIZE, 2, 3, False, label="2 ranks, 3 floats"),
           case(RANK, WORLD_SIZE, 3, 3, False, label="3 ranks, 3 floats"),
           case(RANK, WORLD_SIZE, 4, 3, True, label="4 ranks, 3 floats (last)")],
    reference=_shift_reference, harness=_shift_harness, time_limit=10.0)


def shift(tensor, last):
    from course_lib import dist
    r, p = dist.get_rank(), dist.get_world_size()
    send = dist.isend(tensor.clone(), (r + 1) % p)
    dist.recv(tensor, (r - 1) % p)
    send.wait()


def shift_twice_at_the_end(tensor, last):
    """Right values, one message too many in the last case: before each case had a tag
    space of its own and its messages were matched, nothing could notice it (no later case
    receives it)."""
    from course_lib import dist
    shift(tensor, last)
    if last and dist.get_rank() == 0:
        dist.isend(tensor.clone(), 1).wait()


def shift_twice_first(tensor, last):
    """One message too many in the first case: it must fail there, and the cases after it
    must not receive it."""
    from course_lib import dist
    shift(tensor, last)
    if dist.get_world_size() == 2 and dist.get_rank() == 1:
        dist.isend(torch.full_like(tensor, 99.0), 0).wait()


def test_a_message_left_behind_fails_its_own_case(scratch_cluster_4):
    honest = grade_function(NAME, shift, scratch_cluster_4)
    assert honest.points == honest.max_points, honest

    end = grade_function(NAME, shift_twice_at_the_end, scratch_cluster_4)
    assert [c.passed for c in end.cases] == [True, True, False], end
    assert "rank 0 sent 1 message(s) to rank 1 (tag 0) that nobody received" in end.reason

    first = grade_function(NAME, shift_twice_first, scratch_cluster_4)
    assert [c.passed for c in first.cases] == [False, True, True], first
    assert "rank 1 sent 1 message(s) to rank 0 (tag 0) that nobody received" in first.reason

    again = grade_function(NAME, shift, scratch_cluster_4)  # and nothing leaks into later checks
    assert again.points == again.max_points, again


def test_strays_are_named_on_the_sender_and_the_waiter():
    links = [{"sent": [[1, 0, 2]], "received": [[1, 0, 1]]},
             {"sent": [[0, 0, 1]], "received": [[0, 0, 1]]},
             {"sent": [], "received": [[0, 5, 1]]}]
    found = strays(links)
    assert found == {0: "rank 0 sent 1 message(s) to rank 1 (tag 0) that nobody received",
                     2: "rank 2 waited for 1 message(s) from rank 0 (tag 5) that nobody sent"}
    assert strays([None, None]) == {}
