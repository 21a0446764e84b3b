"""The benchmark page: generated from kept runs, in both languages, in a format that does not
drift; targets judged from same-run ratios; no dates."""

from __future__ import annotations

import json
import re
from pathlib import Path

from course_lib.course.bench import allreduce, report

FIXTURES = Path(__file__).parent / "fixtures" / "bench"


def test_the_page_is_what_the_fixture_runs_give():
    """Regenerated from fixture JSON, the page equals the reviewed one, word for word: a change
    of format shows here first (update tests/fixtures/bench/expected*.md deliberately)."""
    found = report.runs(FIXTURES)
    assert report.page(found, "en") == (FIXTURES / "expected.md").read_text()
    assert report.page(found, "es") == (FIXTURES / "expected.es.md").read_text()


def test_targets_are_judged_from_same_run_ratios():
    run = json.loads((FIXTURES / "allreduce-w2.json").read_text())
    figures = {f.what: f for f in allreduce.figures(run["rows"])}
    mpi_16 = figures["ours / mpi at 16 MiB"]
    assert abs(mpi_16.value - 3.0e-3 / 2.4e-3) < 1e-12 and mpi_16.limit == 1.2
    assert mpi_16.met is False and figures["ours / mpi at 4 KiB"].met is True
    text = report.page({"allreduce-w2": run})
    assert "| ours / mpi at 16 MiB | 1.25x | <= 1.2x | **missed** |" in text
    assert "Missed in this run: 1 of 6 targets." in text


def test_the_command_and_the_machine_are_on_the_page_and_no_date():
    text = report.page(report.runs(FIXTURES))
    assert "python -m course_lib.course.bench zero --world 2" in text
    assert "Machine: 2 cores, Test CPU @ 2.0GHz, Python 3.11.7, torch 2.13.0, MPICH" in text
    assert not re.search(r"20\d\d-\d\d-\d\d", text)


def test_the_kept_page_is_current():
    """docs/benchmarks.md is what `python -m course_lib.course.bench report` writes from docs/bench/
    (course.py build --check says the same)."""
    for path, text in report.pages().items():
        assert path.read_text(encoding="utf-8") == text, f"{path} is stale: regenerate it"


def test_every_kept_run_is_what_bench_all_runs():
    """`bench all` re-measures the page: each of its runs names a benchmark whose parser takes its
    arguments, and each run kept in docs/bench/ is one of them, with the same arguments."""
    import argparse
    import importlib

    from course_lib.course.bench.__main__ import BENCHMARKS, SUITE

    for stem, (name, *args) in SUITE.items():
        assert name in BENCHMARKS, stem
        parser = argparse.ArgumentParser()
        importlib.import_module(f"course_lib.course.bench.{name}").add_arguments(parser)
        parser.parse_args(args)  # exits (SystemExit) on an argument the benchmark does not take
    kept = report.runs()
    assert sorted(kept) == sorted(SUITE)
    for stem, run in kept.items():
        assert run["argv"] == list(SUITE[stem]), stem


def test_the_page_shows_each_variants_roofline():
    """Where a benchmark measures the roofline, its section has one row per variant: FLOPs,
    achieved FLOP/s, MFU, waiting share, and data-parallel bytes over bandwidth against compute
    (a dash where the bytes are not modelled); the kept zero and train runs show it."""
    from course_lib.course.bench import roofline

    rows = [{"variant": "ddp", "step_ms": 100.0, "gflop_per_step": 2.0, "achieved_gflops": 20.0,
             "peak_gflops": 100.0, "mfu": 0.2, "wait_share": 0.5, "bus_gbps": 1.0,
             "dp_mib": 100.0},
            {"variant": "pp", "step_ms": 50.0, "gflop_per_step": 2.0, "achieved_gflops": 40.0,
             "peak_gflops": 90.0, "mfu": 40 / 90, "wait_share": None, "bus_gbps": 1.0,
             "dp_mib": None}]
    lines = roofline.table(rows)
    # compute: 100 ms x (1 - 0.5) = 50 ms; 100 MiB at 1 GB/s: 104.9 ms, so 2.10: comm-bound
    assert "| ddp | 2.00 | 20.0 | 20.0% | 50% | 2.10 |" in lines
    assert "| pp | 2.00 | 40.0 | 44.4% | - | - |" in lines
    assert "(100.0 GFLOP/s per rank)" in lines[0]
    assert roofline.table([{"variant": "plain", "step_ms": 1.0}]) == []
    kept = report.runs()
    for stem in ("zero", "train"):
        text = "\n".join(report.section(stem, kept[stem]))
        assert "Roofline per variant" in text and "| comm / compute |" in text
        for row in kept[stem]["rows"]:
            assert f"| {row['variant']} | {row['gflop_per_step']:.2f} |" in text
