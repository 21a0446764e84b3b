"""The checkpoint benchmark runs end to end on tiny sizes: every variant on 3 ranks, each
loading exactly what it saved, the time to recover from a killed engine on a cluster of 3, rows,
JSON and a plot (speed itself is never asserted)."""

from __future__ import annotations

import json

import pytest

from course_lib.course.bench import __main__ as bench_cli
from course_lib.course.bench import checkpoint as bench


@pytest.mark.cluster
def test_benchmark_rows_json_and_plot(tmp_path):
    out, png = tmp_path / "ck.json", tmp_path / "ck.png"
    assert bench_cli.main(["checkpoint", "--worlds", "3", "--mib", "0.5", "--tensors", "3",
                           "--repeats", "1", "--dir", str(tmp_path), "--timeout", "120",
                           "--json", str(out), "--plot", str(png)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [(r["world"], r["variant"]) for r in rows] == [
        (3, v) for v in bench.VARIANTS]
    for r in rows:
        assert r["exact"], r  # what loaded equals what was saved, element for element
        assert r["save_s"] > 0 and r["load_s"] > 0
        assert r["save_gbps"] == pytest.approx(r["mib"] * 2 ** 20 / r["save_s"] / 1e9)
    assert {r["variant"]: r["save_vs_dcp"] for r in rows }["dcp"] == 1.0
    ours = rows[0]  # the recovery: a rank's engine killed after saving, noticed, restarted
    assert ours["variant"] == "ours" and ours["recover_exact"], ours
    parts = [ours[k] for k in ("detect_s", "restart_s", "reload_s")]
    assert all(0 < p < 120 for p in parts), ours
    assert ours["recover_s"] == pytest.approx(sum(parts))
    assert "recover_s" not in rows[1] and "recover_s" not in rows[2]
    assert png.stat().st_size > 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ck.json", "ck.png"]  # files removed


def test_unknown_variant_is_a_one_line_error():
    with pytest.raises(SystemExit, match="unknown variants \\['pickle'\\]"):
        bench_cli.main(["checkpoint", "--variants", "ours,pickle"])
