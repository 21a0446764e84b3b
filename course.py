#!/usr/bin/env python3
"""The course's entry point, standard library only: `python3 course.py lab` or `... test`.

Each command first makes sure `.venv` holds the pinned dependencies (constraints.txt), so a
fresh machine with only Python 3.11+ needs nothing else.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent
VENV = ROOT / ".venv"
BIN = VENV / ("Scripts" if os.name == "nt" else "bin")
PY = BIN / ("python.exe" if os.name == "nt" else "python")
STAMP = VENV / ".course-installed"
DEPENDENCY_FILES = ("pyproject.toml", "constraints.txt")


def run(*cmd: object, env: dict | None = None) -> int:
    print("+", " ".join(str(c) for c in cmd), flush=True)
    return subprocess.call([str(c) for c in cmd], cwd=ROOT, env=env)


def dependency_hash() -> str:
    h = hashlib.sha256()
    for name in DEPENDENCY_FILES:
        h.update((ROOT / name).read_bytes())
    return h.hexdigest()


def ensure_env() -> None:
    """Create .venv and install the pinned dependencies, unless they are already current."""
    if sys.version_info < (3, 11):
        sys.exit(f"course_lib needs Python 3.11 or newer; this is {sys.version.split()[0]}")
    wanted = dependency_hash()
    if STAMP.exists() and STAMP.read_text() == wanted and PY.exists():
        return
    if not PY.exists() and run(sys.executable, "-m", "venv", VENV) != 0:
        sys.exit("could not create .venv (on Debian/Ubuntu: apt install python3-venv)")
    steps = [(PY, "-m", "pip", "install", "--quiet", "--upgrade", "pip"),
             (PY, "-m", "pip", "install", "--quiet", "-c", "constraints.txt", "-e", ".[mpi,dev]")]
    for step in steps:
        if run(*step) != 0:
            sys.exit("installing the dependencies failed (see pip's message above)")
    STAMP.write_text(wanted)


def main(argv: list[str]) -> int:
    commands = {
        "lab": "install, then open the course in JupyterLab",
        "test": "install, then run the whole test suite (extra args go to pytest; --quick: "
                "the tests that start no engines, kernels or servers, and no notebooks)",
        "build": "regenerate exported modules and the student notebooks (--check: verify only)",
        "bench": "run a benchmark: bench NAME ... (see python -m course_lib.bench -h)",
        "export": "write a lesson you completed into your own course_lib: export 04 (--status)",
        "release": "write the student bundle, without solutions, into a new folder: release DIR",
        "nbgrader": "lay out an nbgrader 0.9 course from the source: nbgrader DIR [LESSON...]",
    }
    if not argv or argv[0] not in commands:
        print(__doc__)
        for name, what in commands.items():
            print(f"  python3 course.py {name:6} {what}")
        return 2
    command, rest = argv[0], argv[1:]
    if command in ("test", "build", "release", "nbgrader") and not (ROOT / "solutions").is_dir():
        print(f"course.py {command}: this is the student release, which has no solutions/ or "
              "tests: each notebook's checks grade your work (python3 course.py lab)")
        return 2
    ensure_env()
    env = dict(os.environ, IPP_NONINTERACTIVE="1")
    if command == "lab":
        root = ["--allow-root"] if hasattr(os, "geteuid") and os.geteuid() == 0 else []  # containers
        return run(BIN / "jupyter", "lab", "--ServerApp.root_dir=notebooks", *root, *rest)
    if command == "test":
        start = time.monotonic()
        paths = [a for a in rest if not a.startswith("-") and Path(a.split("::")[0]).exists()]
        if "--quick" in rest:
            rest.remove("--quick")
            what = ("-m", "not cluster and not slow") + (() if paths else ("tests",))
        else:
            what = ("--nbval",) + (() if paths else ("tests", "solutions"))
        # The whole suite on two workers (the two cores CI and the budget assume); a file's tests
        # stay on one worker, in order, so a notebook's cells and a module's fixtures stay together.
        workers = () if paths or any(a.startswith("-n") for a in rest) else (
            "-n", "2", "--dist", "loadfile")
        code = run(PY, "-m", "pytest", *what, *workers, *rest, env=env)
        minutes, seconds = divmod(round(time.monotonic() - start), 60)
        print(f"course.py test: {minutes} min {seconds} s (budget on 2 cores: 15 min)", flush=True)
        return code
    if command == "build":
        return run(PY, "-m", "course_lib.build", *rest)
    if command == "export":
        # not `-m course_lib.overlay`: the package imports that module before it could run
        return run(PY, "-c", "import sys; from course_lib.overlay import main; "
                   "sys.exit(main(sys.argv[1:]))", *rest)
    if command == "release":
        return run(PY, "-m", "course_lib.release", *rest)
    if command == "nbgrader":
        return run(PY, "-m", "course_lib.grading.nbgrader_course", *rest)
    return run(PY, "-m", "course_lib.bench", *rest, env=env)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
