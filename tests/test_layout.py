"""ParallelLayout: every rank's data, tensor and pipeline groups for each (dp, tp, pp) on 4
ranks, on both backends, checked against groups written out by hand and by communicating in
them; the context-parallel axis and the "dp_cp" group; degrees that do not fit the world get
an error naming them."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from course_lib.layout import ParallelLayout, check_degrees, layout_groups
from course_lib.spawn import spawn

# rank = (pp_rank * dp + dp_rank) * tp + tp_rank: tp contiguous, dp within a pipeline stage.
EXPECTED = {
    (2, 2, 1): {"tp": [[0, 1], [2, 3]], "dp": [[0, 2], [1, 3]], "pp": [[0], [1], [2], [3]]},
    (1, 2, 2): {"tp": [[0, 1], [2, 3]], "dp": [[0], [1], [2], [3]], "pp": [[0, 2], [1, 3]]},
    (2, 1, 2): {"tp": [[0], [1], [2], [3]], "dp": [[0, 1], [2, 3]], "pp": [[0, 2], [1, 3]]},
    (4, 1, 1): {"tp": [[0], [1], [2], [3]], "dp": [[0, 1, 2, 3]], "pp": [[0], [1], [2], [3]]},
}


def _layouts(rank: int, world: int) -> dict:
    """For each layout: this rank's groups (ranks and size), its coordinates, and the sum of
    global ranks over each of its groups, computed by an all_reduce inside that group."""
    from course_lib.backend import default_dist

    dist = default_dist()
    out = {}
    for dp, tp, pp in EXPECTED:
        layout = ParallelLayout(dp=dp, tp=tp, pp=pp)
        got = {"coords": dict(layout.coords)}
        for axis in ("dp", "tp", "pp"):
            group = layout.group(axis)
            total = torch.tensor([float(rank)])
            dist.all_reduce(total, group=group)
            got[axis] = {"ranks": layout.ranks(axis), "all": layout.all_groups(axis),
                         "size": dist.get_world_size(group), "sum": total.item()}
        out[(dp, tp, pp)] = got
    return out


@pytest.mark.parametrize("backend", ["scratch", "gloo"])
def test_every_rank_gets_its_groups(backend):
    per_rank = spawn(_layouts, 4, backend=backend, timeout=120)
    for rank, layouts in enumerate(per_rank):
        for degrees, want in EXPECTED.items():
            got = layouts[degrees]
            dp, tp, pp = degrees
            assert got["coords"] == {"pp": rank // (dp * tp), "dp": rank // tp % dp, "cp": 0,
                                     "tp": rank % tp}, (degrees, rank)
            for axis, groups in want.items():
                mine = next(g for g in groups if rank in g)
                assert got[axis]["ranks"] == mine, (degrees, rank, axis)
                assert got[axis]["all"] == groups, (degrees, axis)
                assert got[axis]["size"] == len(mine), (degrees, rank, axis)
                assert got[axis]["sum"] == sum(mine), (degrees, rank, axis)


@pytest.mark.parametrize("degrees, message", [
    ((2, 2, 2), r"dp=2 x tp=2 x pp=2 = 8, but the world has 4 ranks"),
    ((3, 1, 1), r"dp=3 x tp=1 x pp=1 = 3, but the world has 4 ranks"),
    ((0, 4, 1), r"positive ints, got dp=0 \(dp=0, tp=4, pp=1, cp=1\)"),
    ((2, -2, -1), r"positive ints, got pp=-1, tp=-2"),
    ((2, 2, 1.0), r"positive ints, got pp=1.0"),
])
def test_bad_degrees_name_the_degrees(degrees, message):
    dp, tp, pp = degrees
    with pytest.raises(ValueError, match=message):
        check_degrees(dp, tp, pp, 4)
    world = SimpleNamespace(get_world_size=lambda group=None: 4, get_rank=lambda group=None: 0,
                            new_group=lambda ranks: pytest.fail("no group before validation"))
    with pytest.raises(ValueError, match=message):
        ParallelLayout(dp=dp, tp=tp, pp=pp, dist=world)


@pytest.mark.parametrize("degrees, ep, want", [
    ((4, 1, 1), 2, {"ep": [[0, 1], [2, 3]], "edp": [[0, 2], [1, 3]]}),
    ((2, 2, 1), 2, {"ep": [[0, 2], [1, 3]], "edp": [[0], [2], [1], [3]]}),
    ((2, 1, 2), 2, {"ep": [[0, 1], [2, 3]], "edp": [[0], [1], [2], [3]]}),
])
def test_expert_groups_split_each_dp_group(degrees, ep, want):
    """ep groups partition each dp group into consecutive dp coordinates; the expert-data-
    parallel groups take one rank of each; ep x edp = dp; the dp, tp, pp groups unchanged."""
    dp, tp, pp = degrees
    for rank in range(4):
        made = []
        world = SimpleNamespace(get_world_size=lambda group=None: 4,
                                get_rank=lambda group=None, r=rank: r,
                                new_group=lambda ranks: made.append(list(ranks)) or tuple(ranks))
        layout = ParallelLayout(dp=dp, tp=tp, pp=pp, ep=ep, dist=world)
        assert layout.expert_groups() == want
        old = EXPECTED[degrees]  # the (dp, tp, pp) groups first, in their order: ids unchanged
        cp = [[r] for r in range(4)]  # then cp's (of one rank each here); dp_cp is dp's
        assert made == [*old["pp"], *old["dp"], *old["tp"], *cp, *want["ep"], *want["edp"]]
        for axis in ("ep", "edp"):
            mine = next(g for g in want[axis] if rank in g)
            assert layout.group(axis) == tuple(mine)
        dp_rank = layout.coords["dp"]
        assert (layout.coords["ep"], layout.coords["edp"]) == (dp_rank % ep, dp_rank // ep)
        for g in EXPECTED[degrees]["dp"]:  # each dp group: ep groups partition it
            inside = [e for e in want["ep"] if set(e) <= set(g)]
            assert sorted(r for e in inside for r in e) == sorted(g)
            assert len(inside) * ep == len(g)


def test_ep_must_divide_dp():
    world = SimpleNamespace(get_world_size=lambda group=None: 4, get_rank=lambda group=None: 0,
                            new_group=lambda ranks: tuple(ranks))
    with pytest.raises(ValueError, match="ep=3 must divide dp=4"):
        ParallelLayout(dp=4, ep=3, dist=world)


def test_layout_groups_with_a_cp_axis():
    """tp innermost, then cp, then dp, then pp; each axis's groups tile the world."""
    groups = layout_groups(2, 2, 1, 2)
    assert groups["tp"] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert groups["cp"] == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert groups["dp"] == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert groups["pp"] == [[r] for r in range(8)]
    for name, every in groups.items():
        assert sorted(r for g in every for r in g) == list(range(8)), name
    with pytest.raises(ValueError, match=r"dp=2 x cp=2 x tp=2 x pp=1 = 8, but the world has 4"):
        check_degrees(2, 2, 1, 4, cp=2)


def test_dp_cp_group_holds_the_ranks_with_the_same_weights():
    """The gradients are averaged over dp and cp together: one group per (pp, tp)."""
    for rank in range(8):
        made = []
        world = SimpleNamespace(get_world_size=lambda group=None: 8,
                                get_rank=lambda group=None, r=rank: r,
                                new_group=lambda ranks: made.append(list(ranks)) or tuple(ranks))
        layout = ParallelLayout(dp=2, tp=2, cp=2, sp=True, dist=world)
        assert layout.coords == {"pp": 0, "dp": rank // 4, "cp": rank // 2 % 2, "tp": rank % 2}
        assert layout.group("dp_cp") == ((0, 2, 4, 6) if rank % 2 == 0 else (1, 3, 5, 7))
        assert layout.group("cp") == tuple(layout.ranks("cp"))
        assert layout.sp and layout.cp == 2
        assert made[-2:] == [[0, 2, 4, 6], [1, 3, 5, 7]]
        assert "cp=2, sp" in repr(layout)
