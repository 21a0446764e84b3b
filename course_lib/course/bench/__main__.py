"""Command line: `python -m course_lib.course.bench {allreduce,ddp,tp,pipeline,zero,checkpoint,train}
... --json FILE`, and `python -m course_lib.course.bench report` (the page of the kept runs)."""

from __future__ import annotations

import argparse
import importlib
import sys

from course_lib.course.bench.common import format_table, write_json
from course_lib.course.bench import report

BENCHMARKS = ("allreduce", "ddp", "tp", "pipeline", "zero", "checkpoint", "train", "ring_attention")


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


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["report"]:  # the page of every kept run, not a benchmark
        return report.main(argv[1:])
    parser = argparse.ArgumentParser(prog="python -m course_lib.course.bench", description=__doc__)
    sub = parser.add_subparsers(dest="name", required=True)
    modules = {}
    for name in BENCHMARKS:
        try:
            modules[name] = importlib.import_module(f"course_lib.course.bench.{name}")
        except ModuleNotFoundError as exc:
            if exc.name != f"course_lib.course.bench.{name}":
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
