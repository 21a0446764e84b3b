"""Batch grading: run each submitted notebook in a fresh kernel, then the package's own checks.

The submission's cells run first (its check cells do nothing: `COURSE_LIB_GRADING=1`), so the
functions it defines live in the kernel; then the grader injects one cell per exercise calling
`kernel.grade_to_file`. Nothing the notebook printed is trusted. Every wait is bounded; the
kernel and everything it started are ended by PID, whatever happened.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import nbformat
from nbclient import NotebookClient
from nbclient.exceptions import CellTimeoutError, DeadKernelError
from nbclient.util import run_sync

from course_lib.grading.catalogue import EXTRA_ENV, Exercise, exercises_for, lessons
from course_lib.grading.learner import GRADING_ENV
from course_lib.grading.report import Result
from course_lib.overlay import HOME_ENV, USE_ENV
from course_lib.processes import ProcessSet

FIELDS = ("student", "exercise", "points", "max_points", "reason", "notebook")
PROBE_SECONDS = 15      # a kernel that cannot run `pass` in this long is killed
CLUSTER_START_SECONDS = 90  # allowance for the grader's own cluster (distributed exercises)
TREE_POLL_SECONDS = 0.5


@dataclass(frozen=True)
class Submission:
    student: str
    path: Path


def collect(paths: list[str | os.PathLike]) -> list[Submission]:
    """Submissions named by files or folders: a file is one student (its stem); in a folder,
    each notebook at the top is a student, and each sub-folder is one student (its name)."""
    found: list[Submission] = []
    for arg in map(Path, paths):
        if arg.is_file() or arg.suffix == ".ipynb":
            found.append(Submission(arg.stem, arg))
            continue
        if not arg.is_dir():
            raise FileNotFoundError(f"no such file or folder: {arg}")
        for nb in sorted(arg.rglob("*.ipynb")):
            rel = nb.relative_to(arg)
            if ".ipynb_checkpoints" in rel.parts:
                continue
            found.append(Submission(rel.parts[0] if len(rel.parts) > 1 else nb.stem, nb))
    return found


def lesson_of(path: Path, nb: nbformat.NotebookNode | None, override: str | None) -> str | None:
    """The lesson a submission belongs to: --lesson, else the file name, else the release's
    notebook metadata (a renamed file still carries it)."""
    known = lessons()
    if override:
        return override
    matches = [name for name in known if name in path.stem]
    if matches:
        return max(matches, key=len)
    meta = (nb or {}).get("metadata", {}).get("course_lib", {}).get("lesson")
    return meta if meta in known else None


def _row(student: str, path: Path, exercise: str, points: float, max_points: float,
         reason: str) -> dict:
    return {"student": student, "exercise": exercise, "points": points,
            "max_points": max_points, "reason": reason, "notebook": str(path)}


class KernelSession:
    """A fresh kernel for one submission; `close()` ends it and its process tree by PID."""

    def __init__(self, nb: nbformat.NotebookNode, cwd: Path):
        self.client = NotebookClient(nb, kernel_name="python3", allow_errors=True,
                                     interrupt_on_timeout=False, shutdown_kernel="graceful",
                                     resources={"metadata": {"path": str(cwd)}})
        self.pid: int | None = None
        self.tree = ProcessSet()  # the kernel and everything it starts
        self._closing = threading.Event()

    def start(self, env: dict[str, str], sockets: Path) -> None:
        """Start the kernel with `env`, talking over Unix sockets in the folder `sockets`."""
        self.client.km = self.client.create_kernel_manager()
        # Unix sockets in our own temp folder: no TCP port, nothing written next to the notebook.
        self.client.km.transport, self.client.km.ip = "ipc", str(sockets / "kernel")
        self.client.start_new_kernel(env=env)
        self.pid = self.client.km.provisioner.pid
        # Keep noting the kernel's descendants: if the kernel dies, they are re-parented.
        threading.Thread(target=self._watch_tree, daemon=True, name="course-grade-tree").start()
        self.client.start_new_kernel_client()

    def _watch_tree(self) -> None:
        while not self._closing.wait(TREE_POLL_SECONDS):
            self.tree.add(self.pid)

    def run(self, cell: nbformat.NotebookNode, index: int, timeout: float) -> str:
        """Execute one cell: "ok" (errors included), "timeout" or "dead"."""
        self.client.timeout = max(1, math.ceil(timeout))
        try:
            self.client.execute_cell(cell, index)
            return "ok"
        except CellTimeoutError:
            return "timeout"
        except DeadKernelError:
            return "dead"

    def run_code(self, source: str, timeout: float) -> tuple[str, nbformat.NotebookNode]:
        """Append a cell with `source` to the notebook and run it."""
        cell = nbformat.v4.new_code_cell(source)
        self.client.nb.cells.append(cell)
        return self.run(cell, len(self.client.nb.cells) - 1, timeout), cell

    def recover(self) -> bool:
        """After a timeout: interrupt the kernel and check it answers again."""
        try:
            run_sync(self.client.km.interrupt_kernel)()
        except Exception:  # noqa: BLE001 - a dead kernel fails the probe below
            pass
        # Fresh channels: the timed-out cell's reply and outputs must not reach later cells.
        self.client.kc.stop_channels()
        self.client.kc = None
        self.client.start_new_kernel_client()
        return self.run_code("pass", PROBE_SECONDS)[0] == "ok"

    def close(self) -> list[int]:
        """Shut the kernel down (its atexit stops clusters), then kill whatever is left.
        Returns the PIDs that had to be killed."""
        if self.client.km is None:
            return []
        self.tree.add(self.pid)
        self._closing.set()
        try:
            self.client._cleanup_kernel()  # nbclient's own shutdown + cleanup
        except Exception:  # noqa: BLE001 - ending the tree below is the backstop
            pass
        return self.tree.end(grace=5.0)


def _check_source(ex: Exercise, out: Path, time_limit: float | None) -> str:
    return ("from course_lib.grading.kernel import grade_to_file as _course_grade\n"
            f"_course_grade({ex.name!r}, globals().get({ex.function!r}), {str(out)!r}, "
            f"time_limit={time_limit!r})")


def _cell_error(cell: nbformat.NotebookNode) -> str:
    for out in cell.get("outputs", []):
        if out.get("output_type") == "error":
            return f"{out.get('ename')}: {out.get('evalue')}"
    return "no result"


def _read(sub: Submission, lesson: str | None) -> tuple:
    """(notebook or None, its lesson's exercises, why it cannot be run or "")."""
    try:
        nb, error = nbformat.read(sub.path, as_version=4), ""
    except Exception as exc:  # noqa: BLE001 - bad JSON, bad schema, unreadable file
        nb, error = None, f"not a valid notebook: {type(exc).__name__}: {exc}"
    name = lesson_of(sub.path, nb, lesson)
    exercises = exercises_for(name) if name else []
    if not exercises and not error:
        error = (f"no exercises registered for lesson {name!r}" if name else
                 "cannot tell which lesson this is: name the file after it "
                 "(e.g. 00_cluster.ipynb) or pass --lesson")
    return nb, exercises, error


def _run_notebook(session: KernelSession, cells: list, timeout: float) -> tuple[str, str]:
    """Run the submission's own cells within `timeout` seconds in all.
    Returns (a note for every reason, why nothing can be graded or "")."""
    deadline = time.monotonic() + timeout
    for i, cell in enumerate(cells):
        left = deadline - time.monotonic()
        status = session.run(cell, i, left) if left > 0 else "timeout"
        if status == "dead":
            return "", (f"the kernel died while running code cell {i + 1} "
                        "(a crash or exit in the notebook)")
        if status == "timeout":
            note = (f"the notebook ran past its {timeout:g}s limit at code cell {i + 1}; "
                    "the cells after it were not run. ")
            if not session.recover():
                return "", note + "The kernel did not respond afterwards."
            return note, ""
    return "", ""


def _run_checks(session: KernelSession, exercises: list[Exercise], work: Path,
                exercise_timeout: float | None) -> list[tuple[Exercise, float, str]]:
    """The package's checks, one injected cell each: (exercise, points, reason) per exercise."""
    graded, hung = [], ""
    for k, ex in enumerate(exercises):
        if hung:
            graded.append((ex, 0.0, f"not graded: {hung}"))
            continue
        out = work / f"{k}.json"
        limit = (exercise_timeout or ex.time_limit) * len(ex.cases) + 15
        limit += CLUSTER_START_SECONDS if ex.distributed else 0
        status, cell = session.run_code(_check_source(ex, out, exercise_timeout), limit)
        if status == "ok" and out.exists():
            result = Result.from_dict(json.loads(out.read_text()))
            graded.append((ex, result.points, result.reason))
            continue
        if status == "ok":
            reason = f"grader error: {_cell_error(cell)}"
        elif status == "dead":
            reason = hung = f"the kernel died while checking {ex.name}"
        else:
            reason = f"timed out: checking {ex.name} took over {limit:g}s and was cut off"
            if not session.recover():
                hung = f"the kernel hung in {ex.name} and was killed"
        graded.append((ex, 0.0, reason))
    if not hung and any(e.distributed for e in exercises):
        session.run_code("from course_lib.grading.kernel import stop_clusters\n"
                         "stop_clusters()", 60)
    return graded


def grade_submission(sub: Submission, *, notebook_timeout: float = 600.0,
                     exercise_timeout: float | None = None,
                     lesson: str | None = None) -> list[dict]:
    """One row per exercise of the submission's lesson (or one row if that cannot be told)."""
    nb, exercises, error = _read(sub, lesson)

    def rows(graded: list[tuple[Exercise, float, str]]) -> list[dict]:
        return [_row(sub.student, sub.path, ex.name, points, float(ex.points), reason)
                for ex, points, reason in graded]

    if not exercises:
        return [_row(sub.student, sub.path, "", 0.0, 0.0, error)]
    if error:
        return rows([(ex, 0.0, error) for ex in exercises])
    nb.cells = [c for c in nb.cells if c.cell_type == "code"]
    for c in nb.cells:
        c.outputs, c.execution_count = [], None
    work = Path(tempfile.mkdtemp(prefix="course-grade-"))
    session = KernelSession(nb, sub.path.resolve().parent)
    try:
        # The package's reference components, never a learner's overlay on this machine
        session.start(dict(os.environ, **{GRADING_ENV: "1", USE_ENV: "reference",
                                          HOME_ENV: str(work / "home")}), work)
        note, fatal = _run_notebook(session, list(nb.cells), notebook_timeout)
        if fatal:
            return rows([(ex, 0.0, fatal) for ex in exercises])
        return rows([(ex, points, note + reason) for ex, points, reason
                     in _run_checks(session, exercises, work, exercise_timeout)])
    except Exception as exc:  # noqa: BLE001 - e.g. the kernel would not start; grading goes on
        return rows([(ex, 0.0, f"grader error: {type(exc).__name__}: {exc}")
                     for ex in exercises])
    finally:
        session.close()
        shutil.rmtree(work, ignore_errors=True)


def write_results(rows: list[dict], out_dir: Path) -> None:
    """Rewrite grades.csv and grades.json atomically (a reader never sees half a file)."""
    import csv
    import io

    out_dir.mkdir(parents=True, exist_ok=True)
    buf = io.StringIO()
    writer = csv.DictWriter(buf, fieldnames=FIELDS, lineterminator="\n")
    writer.writeheader()
    writer.writerows(rows)
    for name, text in (("grades.csv", buf.getvalue()),
                       ("grades.json", json.dumps(rows, indent=1) + "\n")):
        tmp = out_dir / f".{name}.tmp"
        tmp.write_text(text, encoding="utf-8")
        os.replace(tmp, out_dir / name)


def grade_all(paths: list[str | os.PathLike], out_dir: str | os.PathLike, *,
              notebook_timeout: float = 600.0, exercise_timeout: float | None = None,
              lesson: str | None = None, exercise_files: list[str] = (),
              resume: bool = False, progress=print) -> list[dict]:
    """Grade every submission, writing the results after each one; returns all rows.
    With `resume`, rows already in `out_dir/grades.json` are kept and their notebooks skipped."""
    if exercise_files:
        os.environ[EXTRA_ENV] = os.pathsep.join(
            [p for p in os.environ.get(EXTRA_ENV, "").split(os.pathsep) if p]
            + [str(Path(f).resolve()) for f in exercise_files])
    if lesson and lesson not in lessons():
        raise ValueError(f"unknown lesson {lesson!r}; lessons with exercises: {lessons()}")
    out = Path(out_dir)
    previous = out / "grades.json"
    rows: list[dict] = json.loads(previous.read_text()) if resume and previous.exists() else []
    done = {r["notebook"] for r in rows}
    for sub in collect(paths):
        if str(sub.path) in done:
            progress(f"{sub.student} ({sub.path}): already graded, skipped")
            continue
        start = time.monotonic()
        new = grade_submission(sub, notebook_timeout=notebook_timeout,
                               exercise_timeout=exercise_timeout, lesson=lesson)
        rows += new
        write_results(rows, out)
        got, best = sum(r["points"] for r in new), sum(r["max_points"] for r in new)
        progress(f"{sub.student} ({sub.path}): {got:g} / {best:g} points "
                 f"[{time.monotonic() - start:.0f}s]")
    return rows
