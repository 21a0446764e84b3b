"""The ring-attention benchmark runs end to end on tiny sizes: rows for cp = 1, 2, 4, the
report's figures, and a plot (speed itself is never asserted)."""

from __future__ import annotations

import argparse

from course_lib.course.bench import ring_attention as bench


def test_benchmark_rows_figures_and_plot(tmp_path):
    p = argparse.ArgumentParser()
    bench.add_arguments(p)
    args = p.parse_args(["--seq", "64", "--heads", "2", "--head-dim", "8", "--repeats", "1",
                         "--warmup", "0", "--backend", "scratch"])
    rows = bench.run(args)
    assert [r["cp"] for r in rows] == [1, 2, 4]
    assert [r["local_seq"] for r in rows] == [64, 32, 16]
    assert all(r["step_s"] > 0 and r["overlap"] for r in rows)
    figures = list(bench.figures(rows))
    assert len(figures) == 4 and figures[1].value == 0.5 and figures[3].value == 0.25
    png = tmp_path / "ring.png"
    bench.plot(rows, str(png))
    assert png.stat().st_size > 0
