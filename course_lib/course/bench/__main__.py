"""Command line: `python -m course_lib.course.bench {allreduce,ddp,tp,pipeline,zero,checkpoint,train}
... --json FILE`, `python -m course_lib.course.bench report` (the page of the kept runs), and
`python -m course_lib.course.bench all` (every benchmark at the page's sizes, then the page)."""

from __future__ import annotations

import argparse
import importlib
import os
import subprocess
import sys
import time

from course_lib.course.bench.common import format_table, write_json
from course_lib.course.bench import report
from course_lib.i18n import _

BENCHMARKS = ("allreduce", "ddp", "tp", "pipeline", "zero", "checkpoint", "train", "ring_attention")
# What `all` runs, the runs the page keeps (file stem -> the benchmark and its arguments), at the
# page's sizes. Timing on two shared cores: world size 2 (the capstone's layouts and cp = 4 need
# 4), one intra-op thread per process (OMP_NUM_THREADS=1 for every process).
SUITE: dict[str, tuple[str, ...]] = {
    "allreduce": ("allreduce", "--world", "2"),
    "all_to_all": ("allreduce", "--collective", "all_to_all", "--world", "2"),
    "ddp": ("ddp", "--world", "2", "--iters", "20"),
    "tp": ("tp", "--worlds", "1,2"),
    "pipeline": ("pipeline", "--stages", "2", "--repeats", "3", "--torch", "interleaved,zbv"),
    "zero": ("zero", "--world", "2"),
    "checkpoint": ("checkpoint", "--worlds", "2", "--mib", "64"),
    "train": ("train",),
    "ring_attention": ("ring_attention", "--cps", "1,2,4"),
}


def without_outputs(argv: list[str]) -> list[str]:
    """The command's arguments without where it writes (`--json FILE`, `--plot FILE`)."""
    kept, skip = [], False
    for arg in argv:
        if skip:
            skip = False
        elif arg in ("--json", "--plot"):
            skip = True
        elif not arg.startswith(("--json=", "--plot=")):
            kept.append(arg)
    return kept


def run_all(argv: list[str]) -> int:
    """`all [NAME ...] [--results DIR]`: run each benchmark of SUITE (or those named) in its own
    process, keeping `DIR/NAME.json` and `DIR/NAME.png`, then regenerate the page. A benchmark
    that fails keeps its previous run and makes the command fail."""
    parser = argparse.ArgumentParser(prog="python -m course_lib.course.bench all",
                                     description=run_all.__doc__)
    parser.add_argument("names", nargs="*", metavar="NAME",
                        help=f"of {', '.join(SUITE)} (default: all)")
    parser.add_argument("--results", default=str(report.RESULTS), help="the kept runs' folder")
    args = parser.parse_args(argv)
    unknown = sorted(set(args.names) - set(SUITE))
    if unknown:
        parser.error(_("unknown benchmark(s) {unknown}: choose from {names}",
                       unknown=", ".join(unknown), names=", ".join(SUITE)))
    os.makedirs(args.results, exist_ok=True)
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    failed = []
    for name in args.names or list(SUITE):
        out = os.path.join(args.results, name)
        cmd = [sys.executable, "-m", "course_lib.course.bench", *SUITE[name],
               "--json", f"{out}.json", "--plot", f"{out}.png"]
        start = time.perf_counter()
        code = subprocess.run(cmd, env=env).returncode
        print(_("{name}: exit {code} in {seconds:.0f} s", name=name, code=code,
                seconds=time.perf_counter() - start), flush=True)
        if code:
            failed.append(name)
    report.main(["--results", args.results])
    if failed:
        print(_("failed (their previous runs kept): {names}", names=", ".join(failed)),
              file=sys.stderr)
    return 1 if failed else 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["report"]:  # the page of every kept run, not a benchmark
        return report.main(argv[1:])
    if argv[:1] == ["all"]:
        return run_all(argv[1:])
    parser = argparse.ArgumentParser(prog="python -m course_lib.course.bench", description=__doc__)
    sub = parser.add_subparsers(dest="name", required=True)
    modules = {}
    for name in BENCHMARKS:
        try:
            modules[name] = importlib.import_module(f"course_lib.course.bench.{name}")
        except ModuleNotFoundError as exc:
            if exc.name != f"course_lib.course.bench.{name}" and name in argv[:1]:
                raise
            continue  # absent, or broken while another benchmark is asked for
        except Exception:  # noqa: BLE001 - only the benchmark asked for must import
            if name in argv[:1]:
                raise
            continue
        mod = modules[name]
        p = sub.add_parser(name, help=(mod.__doc__ or name).strip().splitlines()[0])
        p.add_argument("--json", metavar="FILE", help="write the rows (and run metadata) here")
        p.add_argument("--plot", metavar="FILE", help="save a plot of the rows here")
        mod.add_arguments(p)
    args = parser.parse_args(argv)
    mod = modules[args.name]
    rows = mod.run(args)
    print(format_table(rows))
    if args.json:
        write_json(args.json, args.name, rows, vars(args), without_outputs(argv))
    if args.plot and hasattr(mod, "plot"):
        mod.plot(rows, args.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
