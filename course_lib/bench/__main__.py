"""Command line: `python -m course_lib.bench {allreduce,ddp,tp,pipeline,zero,checkpoint,train} ... --json FILE`."""

from __future__ import annotations

import argparse
import importlib
import sys

from course_lib.bench.common import format_table, write_json

BENCHMARKS = ("allreduce", "ddp", "tp", "pipeline", "zero", "checkpoint", "train")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m course_lib.bench", description=__doc__)
    sub = parser.add_subparsers(dest="name", required=True)
    modules = {}
    for name in BENCHMARKS:
        try:
            modules[name] = importlib.import_module(f"course_lib.bench.{name}")
        except ModuleNotFoundError as exc:
            if exc.name != f"course_lib.bench.{name}":
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
        write_json(args.json, args.name, rows, vars(args))
    if args.plot and hasattr(mod, "plot"):
        mod.plot(rows, args.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
