"""Run solution notebooks top to bottom in a fresh kernel and save their outputs in place, then
rebuild what they generate: what a contributor does after changing a lesson, so the saved
outputs that nbval compares are the ones the code gives.

    .venv/bin/python tools/execute_lesson.py 04 07c_pipeline_schedules   # stems or numbers

Each lesson runs as the suite runs it (a temporary, empty learner's package; no widgets).
A cell that raises stops the run and leaves the notebook unchanged.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SOLUTIONS = ROOT / "solutions"


def lessons(names: list[str]) -> list[Path]:
    found = [p for p in sorted(SOLUTIONS.glob("*.ipynb"))
             if any(p.stem == n or p.stem.startswith(n if "_" in n else n + "_")
                    or p.stem.split("_")[0].rstrip("abcdefgh") == n for n in names)]
    if not found:
        sys.exit(f"no solution notebook matches {names}")
    return found


def execute(path: Path, timeout: float) -> None:
    import nbformat
    from nbclient import NotebookClient

    nb = nbformat.read(path, as_version=4)
    with tempfile.TemporaryDirectory(prefix="course_lib_home-") as home:
        os.environ.update(COURSE_LIB_HOME=home, IPP_NONINTERACTIVE="1")
        NotebookClient(nb, timeout=timeout, kernel_name="python3",
                       resources={"metadata": {"path": str(path.parent)}}).execute()
    nbformat.write(nb, path)


def main(argv: list[str]) -> int:
    timeout = 900.0
    for path in lessons(argv):
        print(f"running {path.relative_to(ROOT)}", flush=True)
        execute(path, timeout)
    stems = [p.stem for p in lessons(argv)]
    return subprocess.call([sys.executable, "-m", "course_lib.course.build", "--only", *stems], cwd=ROOT)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
