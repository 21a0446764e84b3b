"""course_lib.gloo_sharded: the reduce-scatter and all-gather that ZeRO and FSDP use on gloo, as
one all-to-all or point to point, give exactly what the collectives define (the sum taken in rank
order), on 2, 3 and 4 ranks, on a sub-group, several in flight at once, with pieces in one buffer
or apart; anything else goes to torch.distributed."""

from __future__ import annotations

import pytest
import torch

from course_lib.spawn import spawn

SHARD = 1000


def inputs(rank: int, world: int) -> list[torch.Tensor]:
    """Rank `rank`'s pieces, one per destination: every rank can make anyone's."""
    g = torch.Generator().manual_seed(rank)
    return list(torch.randn(world * SHARD, generator=g).view(world, SHARD).unbind(0))


def rank_order_sum(rank: int, world: int) -> torch.Tensor:
    pieces = [inputs(r, world)[rank] for r in range(world)]
    out = pieces[0].clone()
    for p in pieces[1:]:
        out += p
    return out


def exchange(rank: int, world: int, overlapped: bool) -> dict:
    import torch.distributed as tdist

    from course_lib.gloo_sharded import ShardExchanges, sharded_dist

    dist = sharded_dist(tdist, overlapped=overlapped)
    out = {"wrapped": isinstance(dist, ShardExchanges)}
    shard = torch.empty(SHARD)
    assert dist.reduce_scatter(shard, inputs(rank, world)) is None  # as torch's: None when sync
    out["sync"] = torch.equal(shard, rank_order_sum(rank, world))
    # two in flight at once, waited for in the opposite order
    a, b = torch.empty(SHARD), torch.empty(SHARD)
    wa = dist.reduce_scatter(a, inputs(rank, world), async_op=True)
    wb = dist.reduce_scatter(b, [2 * t for t in inputs(rank, world)], async_op=True)
    wb.wait()
    wa.wait()
    out["in flight"] = (torch.equal(a, rank_order_sum(rank, world))
                        and torch.equal(b, 2 * rank_order_sum(rank, world)))
    if overlapped and world > 1:  # a piece over the limit goes point to point, beside one that
        from course_lib import gloo_sharded  # goes as an all-to-all, both in flight at once

        gloo_sharded.ALL_TO_ALL_MAX_BYTES = world * SHARD * 4
        big, small = torch.empty(2 * SHARD), torch.empty(SHARD)
        wbig = dist.reduce_scatter(big, [torch.cat([t, t]) for t in inputs(rank, world)],
                                   async_op=True)
        wsmall = dist.reduce_scatter(small, inputs(rank, world), async_op=True)
        wsmall.wait()
        wbig.wait()
        out["both ways"] = (torch.equal(big, rank_order_sum(rank, world).repeat(2))
                            and torch.equal(small, rank_order_sum(rank, world)))
    flat = torch.zeros(world, SHARD)
    mine = flat[rank]  # a view of the output: the all-gather's own piece is already in place
    mine.copy_(inputs(rank, world)[0])
    dist.all_gather(list(flat.unbind(0)), mine, async_op=True).wait()
    out["all_gather"] = all(torch.equal(flat[r], inputs(r, world)[0]) for r in range(world))
    apart = [torch.full((2, SHARD // 2), -1.0) for _ in range(world)]  # not one buffer
    dist.all_gather(apart, inputs(rank, world)[-1].view(2, -1))
    out["all_gather apart"] = all(torch.equal(apart[r].view(-1), inputs(r, world)[-1])
                                  for r in range(world))
    two_d = torch.empty(2, SHARD // 2)
    dist.reduce_scatter(two_d, [t.view(2, -1) for t in inputs(rank, world)])
    out["2-d"] = torch.equal(two_d.view(-1), rank_order_sum(rank, world))
    m = torch.empty(SHARD)
    dist.reduce_scatter(m, inputs(rank, world), op=tdist.ReduceOp.MAX)  # torch's own
    out["max"] = torch.equal(m, torch.stack([inputs(r, world)[rank] for r in range(world)]
                                            ).amax(0))
    try:
        dist.reduce_scatter(shard, inputs(rank, world)[:-1])
    except ValueError as exc:
        out["bad"] = str(exc)
    if world == 4:  # global ranks 1 and 3 as a group of two; 0 and 2 are not in it
        group = tdist.new_group([1, 3])
        if rank in (1, 3):
            me = rank // 2
            sub = sharded_dist(tdist, group, overlapped=overlapped)
            got = torch.empty(SHARD)
            sub.reduce_scatter(got, inputs(rank, 2), group=group)
            pieces = [inputs(r, 2)[me] for r in (1, 3)]
            out["sub group"] = torch.equal(got, pieces[0] + pieces[1])
    return out


@pytest.mark.parametrize("way", ["all-to-all", "point to point"])
@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_shard_exchanges_equal_the_collectives(world, way):
    """Both ways: as one all-to-all (overlapped), or point to point."""
    overlapped = way == "all-to-all"
    for rank, res in enumerate(spawn(exchange, world, overlapped, backend="gloo", timeout=120)):
        assert res["wrapped"], rank
        for key in ("sync", "in flight", "all_gather", "all_gather apart", "2-d", "max"):
            assert res[key], (key, rank)
        assert res.get("both ways", world == 1 or not overlapped), rank
        assert res["bad"].startswith(f"reduce_scatter: {world - 1} inputs of shapes"), res["bad"]
        assert f"for a group of {world}" in res["bad"], res["bad"]
        if world == 4 and rank in (1, 3):
            assert res["sub group"], rank


def test_only_torch_distributed_on_gloo_is_wrapped():
    from course_lib import dist as scratch
    from course_lib.gloo_sharded import sharded_dist

    assert sharded_dist(scratch) is scratch
    import torch.distributed as tdist

    assert not tdist.is_initialized()
    assert sharded_dist(tdist) is tdist  # no group: nothing to decide, torch's own


def test_a_failed_exchange_names_itself_and_only_then_builds_the_name():
    """A send or receive that fails is reported with the exchange's name (which collective,
    which rank, which peers); the name is built only on failure, not on every exchange, and
    `then()` does not run."""
    from course_lib.gloo_sharded import _Exchange

    class Broken:
        def wait(self, *args):
            raise RuntimeError("Connection reset by peer")

    named, ran = [], []
    ok = _Exchange([], lambda: ran.append(1), lambda: named.append(1) or "never")
    assert ok.wait() and ran == [1] and named == []
    bad = _Exchange([Broken()], lambda: ran.append(2), lambda: "all_gather on rank 0, "
                    "exchanging with ranks [1]")
    with pytest.raises(RuntimeError, match=r"all_gather on rank 0, exchanging with ranks \[1\]: "
                                           "Connection reset by peer"):
        bad.wait()
    assert ran == [1]
