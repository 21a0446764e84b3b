"""The allreduce benchmark runs end to end on tiny sizes and writes rows, JSON and a plot.

Speed itself is measured by the lead with `make bench`, never asserted in a test.
"""

from __future__ import annotations

import argparse
import json

import pytest

from course_lib.course.bench import __main__ as bench_cli
from course_lib import mpi
from course_lib.course.bench import allreduce


def test_parse_size():
    assert allreduce.parse_size("4KiB") == 4096
    assert allreduce.parse_size("16MiB") == 16 * 2 ** 20
    assert allreduce.parse_size("1000") == 1000
    for bad in ("3B", "4XB", "lots"):
        with pytest.raises(argparse.ArgumentTypeError):
            allreduce.parse_size(bad)


@pytest.mark.parametrize("option,value", [("--sizes", "4K"), ("--sizes", "4KiB,3B"),
                                          ("--sizes", "lots"), ("--repeats", "0"),
                                          ("--warmup", "-1"), ("--rounds", "0"),
                                          ("--block", "0"), ("--world", "two")])
def test_a_bad_option_is_a_usage_error_not_a_traceback(option, value, capsys):
    with pytest.raises(SystemExit) as exit_info:
        bench_cli.main(["allreduce", option, value])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert f"error: argument {option}: " in err and "Traceback" not in err, err


@pytest.mark.parametrize("args,message", [
    (["--algorithms", "ring,fastest"], "unknown algorithms ['fastest']"),
    (["--backends", "scratch,nccl"], "unknown backends ['nccl']")])
def test_an_unknown_name_is_a_one_line_error(args, message):
    with pytest.raises(SystemExit) as exit_info:
        bench_cli.main(["allreduce", *args])
    assert message in str(exit_info.value)


def test_only_mpi_without_mpi_is_a_one_line_error(monkeypatch, capsys):
    monkeypatch.setattr(mpi, "unavailable", lambda: "mpiexec not found")
    with pytest.raises(SystemExit, match="no backend left to run"):
        bench_cli.main(["allreduce", "--backends", "mpi"])
    assert "skipping mpi: mpiexec not found" in capsys.readouterr().err


def test_benchmark_rows_json_and_plot(tmp_path):
    out, png = tmp_path / "ar.json", tmp_path / "ar.png"
    backends = "scratch,gloo" + (",mpi" if mpi.unavailable() is None else "")
    assert bench_cli.main(["allreduce", "--world", "2", "--backends", backends,
                           "--sizes", "4KiB,64KiB", "--algorithms", "ring,tree,shared,one_shot",
                           "--repeats", "2", "--rounds", "1", "--warmup", "3",
                           "--timeout", "120",
                           "--json", str(out), "--plot", str(png)]) == 0
    rows = json.loads(out.read_text())["rows"]
    got = {(r["backend"], r["algorithm"], r["bytes"]) for r in rows}
    want = {(b, a, n) for n in (4096, 65536)
            for b, a in [("scratch", "ring"), ("scratch", "tree"), ("scratch", "shared"),
                         ("scratch", "one_shot"), ("gloo", "default")]
            + ([("mpi", "default")] if "mpi" in backends else [])}
    assert got == want
    for r in rows:
        assert r["world"] == 2 and r["repeats"] == 2 and r["seconds"] > 0
        assert r["algbw"] == pytest.approx(r["bytes"] / r["seconds"] / 1e9)
        assert r["busbw"] == pytest.approx(r["algbw"] * 2 * (2 - 1) / 2)
    assert png.stat().st_size > 1000


def test_all_to_all_rows_json_and_plot(tmp_path):
    """all_to_all in the same family: ours (pairwise, naive) against gloo (and MPI)."""
    out, png = tmp_path / "a2a.json", tmp_path / "a2a.png"
    backends = "scratch,gloo" + (",mpi" if mpi.unavailable() is None else "")
    assert bench_cli.main(["allreduce", "--collective", "all_to_all", "--world", "2",
                           "--backends", backends, "--sizes", "4KiB",
                           "--algorithms", "pairwise,naive", "--repeats", "2", "--rounds", "1",
                           "--warmup", "2", "--timeout", "120",
                           "--json", str(out), "--plot", str(png)]) == 0
    rows = json.loads(out.read_text())["rows"]
    got = {(r["backend"], r["algorithm"]) for r in rows}
    assert got == {("scratch", "pairwise"), ("scratch", "naive"), ("gloo", "default")} | (
        {("mpi", "default")} if "mpi" in backends else set())
    for r in rows:
        assert r["collective"] == "all_to_all" and r["bytes"] == 4096
        assert r["busbw"] == pytest.approx(r["algbw"] * (2 - 1) / 2)
    # its own figures, without the all_reduce targets: ours (pairwise) against each library
    figures = {f.what: f for f in allreduce.figures(rows)}
    pairwise, gloo = (next(r["seconds"] for r in rows if (r["backend"], r["algorithm"]) == k)
                      for k in (("scratch", "pairwise"), ("gloo", "default")))
    assert figures["all_to_all: ours / gloo at 4 KiB"].value == pytest.approx(pairwise / gloo)
    assert all(f.limit is None and f.what.startswith("all_to_all: ") for f in figures.values())
    assert allreduce.title(rows) == "all_to_all against gloo and MPI"
    with pytest.raises(SystemExit, match="unknown algorithms"):
        bench_cli.main(["allreduce", "--collective", "all_to_all", "--algorithms", "ring"])


def test_measure_catches_a_wrong_result(monkeypatch):
    """The check outside the timed region fails loudly when an all_reduce is wrong."""
    monkeypatch.setattr(allreduce, "_backend_ops", lambda b, a: (lambda: None, lambda t: None))
    with pytest.raises(AssertionError, match="expected 3.0"):
        allreduce.measure(0, 2, "scratch", [(4096, "ring")], repeats=1)


def test_bind_to_core_gives_each_rank_its_own_core_only_when_there_are_enough():
    import os

    before = os.sched_getaffinity(0)
    if len(before) < 2:
        pytest.skip("needs two CPUs")
    try:
        allreduce.bind_to_core(1, 2)
        assert os.sched_getaffinity(0) == {sorted(before)[1]}
        os.sched_setaffinity(0, before)
        allreduce.bind_to_core(0, len(before) + 1)  # more ranks than cores: left to the OS
        assert os.sched_getaffinity(0) == before
    finally:
        os.sched_setaffinity(0, before)
