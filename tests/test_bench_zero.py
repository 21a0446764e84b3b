"""The zero benchmark runs end to end on tiny sizes: every variant, rows, JSON and a plot, and
each variant's measured state bytes equal its closed form (speed itself is never asserted)."""

from __future__ import annotations

import json

import pytest

from course_lib.course.bench import __main__ as bench_cli
from course_lib.course.bench import zero as bench


def test_benchmark_rows_json_and_plot(tmp_path):
    out, png = tmp_path / "zero.json", tmp_path / "zero.png"
    assert bench_cli.main(["zero", "--world", "2", "--hidden", "32", "--layers", "2",
                           "--batch", "4", "--iters", "2", "--warmup", "1", "--timeout", "120",
                           "--no-peak", "--json", str(out), "--plot", str(png)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [r["variant"] for r in rows] == list(bench.VARIANTS)
    params = 2 * (8 * 32 * 32 + 7 * 32)  # two blocks: LayerNorm, up and down projections
    for r in rows:
        assert r["world"] == 2 and r["params"] == params and r["step_ms"] > 0
        # P is even, so no padding at world 2: measured bytes are the formula's exactly
        assert r["state_mib"] == pytest.approx(r["formula_mib"], rel=1e-12), r["variant"]
        assert "peak_rss_mib" not in r  # --no-peak
    by = {r["variant"]: r for r in rows}
    assert by["ddp"]["vs_our_ddp"] == 1.0
    assert by["zero3"]["vs_torch"] == pytest.approx(by["zero3"]["step_ms"]
                                                    / by["torch_fsdp2"]["step_ms"])
    assert png.stat().st_size > 0


def test_peak_runs_one_process_set_per_variant(tmp_path):
    out = tmp_path / "zero.json"
    assert bench_cli.main(["zero", "--variants", "zero3", "--hidden", "256", "--layers", "2",
                           "--batch", "4", "--iters", "1", "--warmup", "0", "--timeout", "120",
                           "--json", str(out)]) == 0
    (row,) = json.loads(out.read_text())["rows"]
    # building alone allocates the whole model (2 blocks of 256 -> 1024 -> 256: 8 MiB) anew
    assert row["peak_rss_mib"] > 4


def test_unknown_variant_is_a_one_line_error():
    with pytest.raises(SystemExit, match="unknown variants \\['zero4'\\]"):
        bench_cli.main(["zero", "--variants", "ddp,zero4"])
