"""The ddp benchmark runs end to end on tiny sizes and writes rows, JSON and a plot.

Speed itself is measured by the lead (`python -m course_lib.course.bench ddp`), never asserted here.
"""

from __future__ import annotations

import json

import pytest

from course_lib.course.bench import __main__ as bench_cli
from course_lib.course.bench import ddp as bench


def test_benchmark_rows_json_and_plot(tmp_path):
    out, png = tmp_path / "ddp.json", tmp_path / "ddp.png"
    variants = ("torch_ddp/gloo,torch_ddp_view/gloo,ddp/gloo,ddp/scratch,per_param/scratch,"
                "bucketed/gloo")
    assert bench_cli.main(["ddp", "--world", "2", "--variants", variants, "--hidden", "32",
                           "--layers", "2", "--batch", "4", "--bucket-mb", "0.001",
                           "--iters", "2", "--warmup", "1", "--timeout", "120",
                           "--json", str(out), "--plot", str(png)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [r["variant"] for r in rows] == ["local"] + variants.split(",")
    for r in rows:
        # two blocks: LayerNorm (2h), up (4h*h + 4h), down (4h*h + h)
        assert r["world"] == 2 and r["iter_ms"] > 0 and r["params"] == 2 * (8 * 32 * 32 + 7 * 32)
        assert r["model"] == "blocks"
        assert r["efficiency"] == pytest.approx(rows[0]["iter_ms"] / r["iter_ms"])
        assert (r["ddp_wait_ms"] is not None) == r["variant"].startswith("ddp/")
    assert [r["vs_torch_ddp"] for r in rows if r["variant"] == "torch_ddp/gloo"] == [1.0]
    assert png.stat().st_size > 0


def test_square_mlp_model_and_default_variants(tmp_path):
    out = tmp_path / "ddp.json"
    assert bench_cli.main(["ddp", "--world", "2", "--model", "mlp", "--hidden", "16",
                           "--layers", "3", "--batch", "4", "--iters", "1", "--warmup", "0",
                           "--timeout", "120", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [r["variant"] for r in rows] == list(bench.DEFAULT_VARIANTS)
    assert {r["params"] for r in rows} == {3 * (16 * 16 + 16)} and rows[0]["model"] == "mlp"


def test_bucket_sweep_and_comm_hook_variants(tmp_path):
    out, png = tmp_path / "sweep.json", tmp_path / "sweep.png"
    assert bench_cli.main(["ddp", "--world", "2", "--variants",
                           "ddp/scratch,ddp_fp16/scratch,ddp_powersgd/scratch", "--hidden", "16",
                           "--layers", "1", "--batch", "4", "--bucket-mb", "0.001,0.1",
                           "--iters", "3", "--warmup", "1", "--timeout", "120",
                           "--json", str(out), "--plot", str(png)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [(r["variant"], r["bucket_mb"]) for r in rows[1:]] == [
        (f"{v}@{mb:g}", mb) for v in ("ddp/scratch", "ddp_fp16/scratch", "ddp_powersgd/scratch")
        for mb in (0.001, 0.1)]
    assert all(r["iter_ms"] > 0 for r in rows) and png.stat().st_size > 0
    with pytest.raises(SystemExit, match="positive sizes"):
        bench_cli.main(["ddp", "--bucket-mb", "0,1"])


def test_unknown_variant_is_refused():
    with pytest.raises(SystemExit, match="unknown variants"):
        bench_cli.main(["ddp", "--variants", "ddp/nccl"])
