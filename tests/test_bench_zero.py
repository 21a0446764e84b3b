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
                           "--unit-blocks", "2", "--batch", "4", "--iters", "1", "--warmup", "0",
                           "--timeout", "120", "--json", str(out)]) == 0
    (row,) = json.loads(out.read_text())["rows"]
    # building alone allocates the whole model (2 blocks of 256 -> 1024 -> 256: 8 MiB) anew
    assert row["peak_rss_mib"] > 4


def test_fsdp_units_group_the_blocks_and_leave_the_model_as_it_computes():
    """`--unit-blocks 2` of five blocks: units of 2, 2 and 1, the same parameters in the same
    order, the same output; 1 leaves the model as it is; below 1 is a one-line error."""
    import torch

    from course_lib.course.bench.ddp import make_blocks

    model = make_blocks(8, 5)
    x = torch.randn(3, 8)
    expected = model(x)
    grouped = bench.fsdp_units(model, 2)
    assert [len(unit) for unit in grouped] == [2, 2, 1]
    assert [id(p) for p in grouped.parameters()] == [id(p) for p in model.parameters()]
    assert torch.equal(grouped(x), expected)
    assert bench.fsdp_units(model, 1) is model
    with pytest.raises(SystemExit, match="--unit-blocks must be at least 1, got 0"):
        bench_cli.main(["zero", "--unit-blocks", "0", "--no-peak"])


def test_unknown_variant_is_a_one_line_error():
    with pytest.raises(SystemExit, match="unknown variants \\['zero4'\\]"):
        bench_cli.main(["zero", "--variants", "ddp,zero4"])




REUSE = """
import ctypes, resource, sys, torch
from course_lib.course.bench.common import M_MMAP_THRESHOLD, timing_process
if sys.argv[1] == "timing":
    timing_process()
else:  # glibc's default threshold, fixed: every buffer over 128 KiB goes back to the kernel
    ctypes.CDLL("libc.so.6").mallopt(M_MMAP_THRESHOLD, 128 * 1024)
def step():  # twelve 2 MiB buffers written and freed, as a sharded step gathers its units
    for t in [torch.empty(2**19) for _ in range(12)]:
        t.fill_(1.0)
faults = []
for _ in range(5):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    step()
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
print(torch.get_num_threads(), faults[-1] + faults[-2])
"""


@pytest.mark.skipif(__import__("platform").libc_ver()[0] != "glibc", reason="glibc's mallopt")
def test_a_timing_process_keeps_the_memory_a_step_frees():
    """The zero and train benchmarks time in processes that serve a step's buffers from the
    memory the previous step freed, as a GPU's caching allocator does: steps 4 and 5 fault in
    almost none of their 2 x 6144 pages, where an allocator that gives large buffers back to
    the kernel faults in all of them; and one intra-op thread runs."""
    import os
    import subprocess
    import sys

    def run(mode: str) -> tuple[int, int]:
        env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}  # the suite's
        out = subprocess.run([sys.executable, "-c", REUSE, mode], check=True, env=env,
                             capture_output=True, text=True).stdout.split()
        return int(out[0]), int(out[1])

    threads, faults = run("timing")
    assert threads == 1
    assert faults < 12288 // 10, f"{faults} page faults re-allocating 12288 freed pages"
    assert run("returning")[1] > 12288 * 9 // 10  # what the check tells apart


def test_variants_take_turns_at_every_place_and_after_every_neighbour():
    """Over a full cycle of `balanced_order` (n iterations, 2n for an odd n), each variant runs
    at every place, and just after every other variant, equally often (a rotation keeps every
    variant after the same neighbour)."""
    from collections import Counter

    from course_lib.course.bench.common import balanced_order

    for n in [*range(1, 9), 13]:
        names = [f"v{k}" for k in range(n)]
        cycle = n if n % 2 == 0 else 2 * n
        orders = [balanced_order(names, i) for i in range(cycle)]
        assert all(sorted(order) == sorted(names) for order in orders), n
        places = Counter((place, v) for order in orders for place, v in enumerate(order))
        assert set(places.values()) == {cycle // n} and len(places) == n * n, n
        after = Counter(pair for order in orders for pair in zip(order, order[1:]))
        assert len(after) == n * (n - 1), n  # every ordered pair of neighbours occurs...
        assert len(set(after.values())) <= 1, (n, after)  # ...equally often
        assert balanced_order(names, cycle) == orders[0]
    assert balanced_order([], 3) == []