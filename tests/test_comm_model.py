"""The alpha-beta-gamma model: the fit recovers known parameters, the choice is the cheapest,
the table says what the choice says, all_reduce("auto") runs the table's algorithm; and the
hierarchical all_reduce sums over every rank with one rank per host talking across hosts
(6 ranks as 2 hosts of 3 and as 3 hosts of 2)."""

from __future__ import annotations

import random

import pytest
import torch

from course_lib import comm_model
from course_lib.comm_model import Fit
from course_lib.course.demos import message_costs
from course_lib.spawn import spawn

SIZES = [2 ** k for k in range(2, 25)]
TRUE = Fit(alpha=30e-6, beta=1e-9, gamma=0.3e-9)  # 30 us per message, 1 GB/s, 3.3 GB/s adds


def test_terms_count_what_each_algorithm_sends():
    n = 1000.0
    assert comm_model.terms("ring", n, 4) == (6.0, 1500.0, 750.0)  # 2(p-1), 2(p-1)/p n, (p-1)/p n
    assert comm_model.terms("tree", n, 4) == (2.0, 2000.0, 2000.0)  # lg p swaps of everything
    assert comm_model.terms("rabenseifner", n, 4) == (4.0, 1500.0, 750.0)
    assert comm_model.terms("naive", n, 3) == (4.0, 4000.0, 2000.0)
    # 3 ranks: one extra rank folds in and out (2 messages of n, one addition) around p' = 2.
    assert comm_model.terms("tree", n, 3) == (3.0, 3000.0, 2000.0)
    assert comm_model.terms("rabenseifner", n, 3) == (4.0, 3000.0, 1500.0)
    with pytest.raises(ValueError, match="unknown algorithm 'butterfly'"):
        comm_model.terms("butterfly", n, 4)


def test_fit_recovers_the_parameters_that_made_the_measurements():
    rng = random.Random(0)
    rows = [(a, n, p, comm_model.cost(a, n, p, TRUE) * rng.uniform(0.97, 1.03))
            for a in comm_model.ALGORITHMS for n in SIZES[::3] for p in (2, 3, 4)]
    fit = comm_model.fit_model(rows)
    for name in ("alpha", "beta", "gamma"):
        assert getattr(fit, name) == pytest.approx(getattr(TRUE, name), rel=0.1), name
    with pytest.raises(ValueError, match="at least 3 measurements"):
        comm_model.fit_model(rows[:2])


@pytest.mark.parametrize("p", [2, 3, 4, 5, 8])
def test_choice_is_the_cheapest_and_the_table_agrees(p):
    table = comm_model.build_table(TRUE, [p], SIZES)
    for n in SIZES:
        best = comm_model.choose_algorithm(n, p, TRUE)
        assert all(comm_model.cost(best, n, p, TRUE) <= comm_model.cost(a, n, p, TRUE)
                   for a in comm_model.ALGORITHMS)
        from course_lib.dist.collectives import table_choice

        assert table_choice(table, n, p) == best
    # Latency wins small messages (the tree's lg p rounds), bandwidth large ones.
    assert comm_model.choose_algorithm(4, p, TRUE) == "tree"
    assert comm_model.choose_algorithm(16 * 2 ** 20, p, TRUE) in ("ring", "rabenseifner")
    assert table[p][-1][0] is None


def measured_auto(rank: int, world: int) -> dict:
    """Measure on this world, fit, install the table, and see what "auto" runs."""
    from course_lib import dist

    sizes = [64, 4096, 262144]
    rows = message_costs.measure(sizes, repeats=3)
    fit = comm_model.fit_model(rows)
    table = comm_model.build_table(fit, [world], [2 ** k for k in range(4, 23)])
    dist.set_all_reduce_table(table)
    ran = {}
    for n in (16, 1024, 65536, 2 ** 21):
        t = torch.ones(n // 4)
        dist.all_reduce(t)
        assert torch.equal(t, torch.full_like(t, float(world)))
        ran[n] = dist.flight_record()["groups"]["0"]["entries"][-1]["algorithm"]
    return {"fit": (fit.alpha, fit.beta, fit.gamma), "table": table, "ran": ran}


def test_auto_runs_the_fitted_tables_choice():
    from course_lib.dist.collectives import table_choice

    results = spawn(measured_auto, 3, backend="scratch", timeout=120)
    for out in results:
        # The slowest rank's medians, so every rank fits the same model (set_all_reduce_table
        # would refuse different tables).
        assert out["table"] == results[0]["table"]
        for n, algorithm in out["ran"].items():
            assert algorithm == table_choice(out["table"], n, 3)
    assert results[0]["fit"][0] > 0  # a latency was measured


def hierarchical_worker(rank: int, world: int) -> dict:
    """On 6 ranks, as 2 hosts of 3 and as 3 hosts of 2 (one spawn for both layouts)."""
    from course_lib import dist
    from course_lib.counting import CountingDist
    from course_lib.hierarchical import hierarchical_all_reduce, host_groups

    out = {}
    for per_host in (3, 2):
        counting = CountingDist(dist)
        hosts = host_groups(per_host, dist=counting)
        t = torch.arange(10, dtype=torch.float64) * (rank + 1)
        counting.reset()
        hierarchical_all_reduce(t, hosts)
        out[per_host] = {"t": t.numpy(), "calls": dict(counting.calls),
                         "leader": hosts.leaders is not None}
    return out


def test_hierarchical_all_reduce_sums_over_hosts():
    results = spawn(hierarchical_worker, 6, backend="scratch", timeout=60)
    want = torch.arange(10, dtype=torch.float64) * sum(range(1, 7))
    for per_host in (3, 2):
        for rank, by_layout in enumerate(results):
            out = by_layout[per_host]
            torch.testing.assert_close(torch.as_tensor(out["t"]), want, rtol=0, atol=0)
            # One reduce and one broadcast inside the host; the cross-host all_reduce only on
            # each host's first rank.
            assert out["leader"] == (rank % per_host == 0)
            want_calls = {"reduce": 1, "broadcast": 1}
            if out["leader"]:
                want_calls["all_reduce"] = 1
            assert out["calls"] == want_calls, (per_host, rank)


def test_hierarchical_layout_that_does_not_fit_is_an_error():
    from course_lib.hierarchical import host_groups

    class FakeDist:
        def get_world_size(self, group=None):
            return 6

        def get_rank(self, group=None):
            return 0

    with pytest.raises(ValueError, match="6 ranks do not split into hosts of 4 ranks"):
        host_groups(4, dist=FakeDist())


def test_hierarchical_cost_beats_a_flat_ring_when_links_across_hosts_are_slow():
    from course_lib.hierarchical import hierarchical_cost

    inside = Fit(alpha=1e-6, beta=0.02e-9, gamma=0.1e-9)  # shared memory: 50 GB/s
    across = Fit(alpha=20e-6, beta=0.8e-9, gamma=0.1e-9)  # the network: 1.25 GB/s
    n = 64 * 2 ** 20
    flat = comm_model.cost("ring", n, 16, across)  # a flat ring crosses hosts on every hop
    assert hierarchical_cost(n, 2, 8, inside, across) < flat
