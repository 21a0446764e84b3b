"""`course-grade SUBMISSIONS... --out DIR`: grade submitted notebooks into a score table."""

from __future__ import annotations

import argparse
import signal
import sys

from course_lib.course.grading.batch import FILE_LIMIT, MEMORY_LIMIT, SOURCE, grade_all


def _exit_on_term(signum, frame):  # noqa: ARG001 - unwinds through the kernel cleanup
    raise SystemExit(128 + signum)


def main(argv: list[str] | None = None) -> int:
    """Grade every submission; results are rewritten after each one. Exit 0 when all graded."""
    parser = argparse.ArgumentParser(
        prog="course-grade",
        description="Rebuild each submitted notebook from the instructor's source (only its "
                    "answer cells are taken), run it in a fresh kernel, then the course's own "
                    "checks for its lesson, judged outside that kernel; write DIR/grades.csv "
                    "and DIR/grades.json.")
    parser.add_argument("submissions", nargs="+",
                        help="notebooks, or folders of them (a sub-folder is one student)")
    parser.add_argument("--out", required=True, help="folder for grades.csv and grades.json")
    parser.add_argument("--timeout-notebook", type=float, default=600.0, metavar="S",
                        help="seconds for running one submission's own cells (default 600)")
    parser.add_argument("--timeout-exercise", type=float, default=None, metavar="S",
                        help="seconds per call of a learner's function (default: the "
                             "exercise's own limit)")
    parser.add_argument("--lesson", help="grade every submission as this lesson (e.g. "
                                         "00_cluster) instead of telling it from the file")
    parser.add_argument("--exercises", action="append", default=[], metavar="FILE.py",
                        help="a .py file registering extra exercises (repeatable)")
    parser.add_argument("--source", default=str(SOURCE), metavar="DIR",
                        help="the instructor's solution notebooks, from which each submission "
                             "is rebuilt (default: this repository's solutions/)")
    parser.add_argument("--memory-limit", type=float, default=MEMORY_LIMIT / 2**30, metavar="GiB",
                        help="address space of each process a submission runs (default 8)")
    parser.add_argument("--file-limit", type=float, default=FILE_LIMIT / 2**20, metavar="MiB",
                        help="size of any one file a submission writes (default 1024)")
    parser.add_argument("--resume", action="store_true",
                        help="keep the rows already in DIR/grades.json and skip their notebooks "
                             "(after an interrupted run)")
    args = parser.parse_args(argv)
    for name, value in (("--timeout-notebook", args.timeout_notebook),
                        ("--timeout-exercise", args.timeout_exercise),
                        ("--memory-limit", args.memory_limit), ("--file-limit", args.file_limit)):
        if value is not None and not value > 0:
            parser.error(f"{name} must be positive, got {value:g}")
    signal.signal(signal.SIGTERM, _exit_on_term)
    try:
        rows = grade_all(args.submissions, args.out, notebook_timeout=args.timeout_notebook,
                         exercise_timeout=args.timeout_exercise, lesson=args.lesson,
                         exercise_files=args.exercises, resume=args.resume,
                         source=args.source, memory_limit=int(args.memory_limit * 2**30),
                         file_limit=int(args.file_limit * 2**20),
                         progress=lambda line: print(line, file=sys.stderr, flush=True))
    except (FileNotFoundError, ValueError) as exc:
        parser.error(str(exc))
    print(f"graded {len({r['notebook'] for r in rows})} notebook(s): "
          f"{args.out}/grades.csv, {args.out}/grades.json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
