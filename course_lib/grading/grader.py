"""Batch grading: run each submitted notebook in a fresh kernel, then the package's own checks.

The submission's cells run first (its check cells do nothing: `COURSE_LIB_GRADING=1`), so the
functions it defines live in the kernel; then the grader injects one cell per exercise calling
`in_kernel.grade_to_file`. Nothing the notebook printed is trusted. Every wait is bounded; the
kernel and everything it started are ended by PID, whatever happened.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import nbformat
import psutil
from nbclient import NotebookClient
from nbclient.exceptions import CellTimeoutError, DeadKernelError
from nbclient.util import run_sync

from course_lib.grading.exercise import EXTRA_ENV, Exercise, exercises_for, lessons
from course_lib.grading.report import Result
from course_lib.grading.runner import GRADING_ENV

FIELDS = ("student", "exercise", "points", "max_points", "reason", "notebook")
PROBE_SECONDS = 15      # a kernel that cannot run `pass` in this long is killed
CLUSTER_START_SECONDS = 90  # allowance for the grader's own cluster (distributed exercises)


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
        self.tree: list[psutil.Process] = []

    def start(self, env: dict[str, str], sockets: Path) -> None:
        """Start the kernel with `env`, talking over Unix sockets in the folder `sockets`."""
        self.client.km = self.client.create_kernel_manager()
        # Unix sockets in our own temp folder: no TCP port, nothing written next to the notebook.
        self.client.km.transport, self.client.km.ip = "ipc", str(sockets / "kernel")
        self.client.start_new_kernel(env=env)
        self.pid = self.client.km.provisioner.pid
        self.client.start_new_kernel_client()

    def run(self, cell: nbformat.NotebookNode, index: int, timeout: float) -> str:
        """Execute one cell: "ok" (errors included), "timeout" or "dead"."""
        self._remember_tree()
        self.client.timeout = max(1, math.ceil(timeout))
        try:
            self.client.execute_cell(cell, index)
            return "ok"
        except CellTimeoutError:
            return "timeout"
        except DeadKernelError:
            return "dead"
        finally:
            self._remember_tree()

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
        probe = nbformat.v4.new_code_cell("pass")
        self.client.nb.cells.append(probe)
        return self.run(probe, len(self.client.nb.cells) - 1, PROBE_SECONDS) == "ok"

    def _remember_tree(self) -> None:
        """Note the kernel's descendants (engines...) while they still have it as parent."""
        try:
            kernel = psutil.Process(self.pid)
            for p in [kernel] + kernel.children(recursive=True):
                if p not in self.tree:
                    self.tree.append(p)
        except (psutil.Error, TypeError):
            pass

    def close(self) -> list[int]:
        """Shut the kernel down (its atexit stops clusters), then kill whatever is left.
        Returns the PIDs that had to be killed."""
        self._remember_tree()
        try:
            if self.client.km is not None:
                self.client._cleanup_kernel()  # nbclient's own shutdown + cleanup
        except Exception:  # noqa: BLE001 - the kill below is the backstop
            pass
        _, alive = psutil.wait_procs(self.tree, timeout=5)
        for p in alive:
            try:
                p.kill()
            except psutil.Error:
                pass
        psutil.wait_procs(alive, timeout=5)
        return [p.pid for p in alive]


def _check_source(ex: Exercise, out: Path, time_limit: float | None) -> str:
    return ("from course_lib.grading.in_kernel import grade_to_file as _course_grade\n"
            f"_course_grade({ex.name!r}, globals().get({ex.function!r}), {str(out)!r}, "
            f"time_limit={time_limit!r})")


def _cell_error(cell: nbformat.NotebookNode) -> str:
    for out in cell.get("outputs", []):
        if out.get("output_type") == "error":
            return f"{out.get('ename')}: {out.get('evalue')}"
    return "no result"


def grade_submission(sub: Submission, *, notebook_timeout: float = 600.0,
                     exercise_timeout: float | None = None,
                     lesson: str | None = None) -> list[dict]:
    """One row per exercise of the submission's lesson (or one row if that cannot be told)."""
    def rows_for(exs: list[Exercise], reason: str) -> list[dict]:
        return [_row(sub.student, sub.path, e.name, 0.0, float(e.points), reason) for e in exs]

    try:
        nb = nbformat.read(sub.path, as_version=4)
        error = None
    except Exception as exc:  # noqa: BLE001 - bad JSON, bad schema, unreadable file
        nb, error = None, f"not a valid notebook: {type(exc).__name__}: {exc}"
    name = lesson_of(sub.path, nb, lesson)
    exercises = exercises_for(name) if name else []
    if not exercises:
        reason = error or (f"no exercises registered for lesson {name!r}" if name else
                           "cannot tell which lesson this is: name the file after it "
                           "(e.g. 00_cluster.ipynb) or pass --lesson")
        return [_row(sub.student, sub.path, "", 0.0, 0.0, reason)]
    if error:
        return rows_for(exercises, error)

    code = [c for c in nb.cells if c.cell_type == "code"]
    for c in code:
        c.outputs, c.execution_count = [], None
    nb.cells = code
    env = dict(os.environ, **{GRADING_ENV: "1"})
    work = Path(tempfile.mkdtemp(prefix="course-grade-"))
    session = None
    try:
        session = KernelSession(nb, sub.path.resolve().parent)
        session.start(env, work)
        note = ""
        deadline = time.monotonic() + notebook_timeout
        for i, cell in enumerate(code):
            left = deadline - time.monotonic()
            status = session.run(cell, i, left) if left > 0 else "timeout"
            if status == "dead":
                return rows_for(exercises, f"the kernel died while running code cell {i + 1} "
                                           "(a crash or exit in the notebook)")
            if status == "timeout":
                note = (f"the notebook ran past its {notebook_timeout:g}s limit at code cell "
                        f"{i + 1}; the cells after it were not run. ")
                if not session.recover():
                    return rows_for(exercises, note + "The kernel did not respond afterwards.")
                break
        rows, hung = [], ""
        for k, ex in enumerate(exercises):
            if hung:
                rows += rows_for([ex], f"not graded: {hung}")
                continue
            out = work / f"{k}.json"
            cell = nbformat.v4.new_code_cell(_check_source(ex, out, exercise_timeout))
            nb.cells.append(cell)
            limit = (exercise_timeout or ex.time_limit) * len(ex.cases) + 15
            limit += CLUSTER_START_SECONDS if ex.distributed else 0
            status = session.run(cell, len(nb.cells) - 1, limit)
            if status == "ok" and out.exists():
                result = Result.from_dict(json.loads(out.read_text()))
                rows.append(_row(sub.student, sub.path, ex.name, result.points,
                                 result.max_points, note + result.reason))
                continue
            if status == "ok":
                reason = f"grader error: {_cell_error(cell)}"
            elif status == "dead":
                reason = hung = f"the kernel died while checking {ex.name}"
            else:
                reason = f"timed out: checking {ex.name} took over {limit:g}s and was cut off"
                if not session.recover():
                    hung = f"the kernel hung in {ex.name} and was killed"
            rows.append(_row(sub.student, sub.path, ex.name, 0.0, float(ex.points),
                             note + reason))
        if not hung and any(e.distributed for e in exercises):
            stop = nbformat.v4.new_code_cell(
                "from course_lib.grading.in_kernel import stop_clusters\nstop_clusters()")
            nb.cells.append(stop)
            session.run(stop, len(nb.cells) - 1, 60)
        return rows
    except Exception as exc:  # noqa: BLE001 - e.g. the kernel would not start; grading goes on
        return rows_for(exercises, f"grader error: {type(exc).__name__}: {exc}")
    finally:
        if session is not None:
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
