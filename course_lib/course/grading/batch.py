"""Batch grading: each submission rebuilt from the instructor's source, run in a fresh kernel,
then the package's own checks, judged in this process.

The rebuilt notebook (`rebuild`: the release's given cells, the submission's answer cells) runs
first, its check cells doing nothing (`COURSE_LIB_GRADING=1`), so the learner's functions live
in the kernel; then the grader injects one cell per exercise calling `kernel.collect_to_file`,
which writes what the function did as plain data to a path the kernel learns only then. Expected
values, comparison and points are computed here (`judge`), never in the kernel; nothing it
printed is read and nothing it wrote is unpickled. Every wait is bounded; the kernel runs under
memory and file-size limits in a scratch folder, and it and everything it started (escaped
double-forks included: `containment`) are ended by PID, whatever happened.

The parts: `kernel_session` (the kernel, its limits and its process tree) and `grades` (the
results files, and the rows an interrupted run left).
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import nbformat

from course_lib.cluster import zygote
from course_lib.course.grading import containment, judge, plain, rebuild, sandbox
from course_lib.course.catalogue import EXTRA_ENV, Exercise, exercises_for, lessons
from course_lib.course.grading.grades import FIELDS, Results, _previous, _row, write_results
from course_lib.course.grading.kernel_session import (FILE_LIMIT, MEMORY_LIMIT, PROBE_SECONDS,
                                                      TREE_POLL_SECONDS, KernelSession, Limits,
                                                      kernel_zygote)
from course_lib.course.grading.learner import GRADING_ENV
from course_lib.i18n import LANG_ENV, _, language, language_of
from course_lib.course.overlay import HOME_ENV, USE_ENV
from course_lib.course.paths import ROOT

__all__ = ["FIELDS", "PROBE_SECONDS", "CLUSTER_START_SECONDS", "TREE_POLL_SECONDS", "SOURCE",
           "MEMORY_LIMIT", "FILE_LIMIT", "Limits", "Submission", "collect", "lesson_of",
           "KernelSession", "grade_submission", "Results", "write_results", "grade_all"]

CLUSTER_START_SECONDS = 90  # allowance for the grader's own cluster (distributed exercises)
SOURCE = ROOT / "solutions"  # the instructor's, in the repo


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




def _check_source(ex: Exercise, out: Path, time_limit: float | None) -> str:
    return ("from course_lib.course.grading.kernel import collect_to_file as _course_collect\n"
            f"_course_collect({ex.name!r}, globals().get({ex.function!r}), {str(out)!r}, "
            f"time_limit={time_limit!r})")


def _cell_error(cell: nbformat.NotebookNode) -> str:
    for out in cell.get("outputs", []):
        if out.get("output_type") == "error":
            return f"{out.get('ename')}: {out.get('evalue')}"[:judge.MAX_TEXT]
    return "no result"


def _read(sub: Submission, lesson: str | None) -> tuple:
    """(notebook or None, its lesson, the lesson's exercises, why it cannot be run or "")."""
    try:
        nb, error = nbformat.read(sub.path, as_version=4), ""
    except Exception as exc:  # noqa: BLE001 - bad JSON, bad schema, unreadable file
        nb, error = None, _("not a valid notebook: {error}", error=f"{type(exc).__name__}: {exc}")
    name = lesson_of(sub.path, nb, lesson)
    exercises = exercises_for(name) if name else []
    if not exercises and not error:
        error = (_("no exercises registered for lesson {lesson}", lesson=repr(name)) if name else
                 _("cannot tell which lesson this is: name the file after it "
                   "(e.g. 00_cluster.ipynb) or pass --lesson"))
    return nb, name, exercises, error


def _run_notebook(session: KernelSession, cells: list, timeout: float) -> tuple[str, str]:
    """Run the notebook's code cells within `timeout` seconds in all.
    Returns (a note for every reason, why nothing can be graded or "")."""
    deadline = time.monotonic() + timeout
    for i, cell in enumerate(cells):
        left = deadline - time.monotonic()
        status = session.run(cell, i, left) if left > 0 else "timeout"
        if status == "dead":
            return "", _("the kernel died while running code cell {cell} (a crash or exit in "
                         "the notebook)", cell=i + 1)
        if status == "timeout":
            note = _("the notebook ran past its {limit}s limit at code cell {cell}; the cells "
                     "after it were not run. ", limit=f"{timeout:g}", cell=i + 1)
            if not session.recover():
                return "", note + _("The kernel did not respond afterwards.")
            return note, ""
    return "", ""


def _judged(ex: Exercise, path: Path, limit: float) -> tuple[float, str]:
    """Points and reason for what the kernel wrote to `path`, judged here."""
    try:
        if path.stat().st_size > plain.MAX_BYTES:
            raise judge.Malformed(f"over {plain.MAX_BYTES} bytes")
        refused, outcomes = judge.validated(ex, json.loads(path.read_bytes()))
    except (ValueError, RecursionError) as exc:  # judge.Malformed is a ValueError
        return 0.0, _("the kernel's results for {name} are not valid: {error}", name=ex.name,
                      error=str(exc)[:200])
    result = judge.zero(ex, refused) if refused else judge.judge(ex, outcomes, limit)
    return result.points, result.reason


def _run_checks(session: KernelSession, exercises: list[Exercise], work: Path,
                exercise_timeout: float | None) -> list[tuple[Exercise, float, str]]:
    """The package's checks, one injected cell each: (exercise, points, reason) per exercise."""
    graded, hung = [], ""
    for ex in exercises:
        if hung:
            graded.append((ex, 0.0, _("not graded: {why}", why=hung)))
            continue
        out = work / f"{secrets.token_hex(16)}.json"  # unknown to the notebook until now
        call_limit = exercise_timeout or ex.time_limit
        limit = call_limit * len(ex.cases) + 15
        limit += CLUSTER_START_SECONDS if ex.distributed else 0
        status, cell = session.run_code(_check_source(ex, out, exercise_timeout), limit)
        if status == "ok" and out.is_file():
            graded.append((ex, *_judged(ex, out, float(call_limit))))
            continue
        if status == "ok":
            reason = _("grader error: {error}", error=_cell_error(cell))
        elif status == "dead":
            reason = hung = _("the kernel died while checking {name}", name=ex.name)
        else:
            reason = _("timed out: checking {name} took over {limit}s and was cut off",
                       name=ex.name, limit=f"{limit:g}")
            if not session.recover():
                hung = _("the kernel hung in {name} and was killed", name=ex.name)
        graded.append((ex, 0.0, reason))
    if not hung and any(e.distributed for e in exercises):
        session.run_code("from course_lib.course.grading.kernel import stop_clusters\n"
                         "stop_clusters()", 60)
    return graded


def grade_submission(sub: Submission, *, forked_from: subprocess.Popen,
                     limits: Limits = Limits(), lesson: str | None = None,
                     source: Path = SOURCE, env: dict[str, str] | None = None,
                     scratch: Path | None = None) -> list[dict]:
    """One row per exercise of the submission's lesson (or one row if that cannot be told).
    `source` holds the instructor's notebooks; `forked_from`, the run's kernel zygote;
    `scratch`, the run's folder for its work folders (the temporary folder by default).
    Reasons are written in the submission's edition (a Spanish notebook gets Spanish ones)."""
    nb, name, exercises, error = _read(sub, lesson)
    lang = language_of(nb) if nb is not None else None
    with language(lang):
        return _grade(sub, nb, name, exercises, error, limits, source,
                      dict(env or os.environ, **({LANG_ENV: lang} if lang else {})), forked_from,
                      scratch)


def _grade(sub: Submission, nb: nbformat.NotebookNode | None, name: str | None,
           exercises: list[Exercise], error: str, limits: Limits, source: Path,
           env: dict[str, str], forked_from: subprocess.Popen,
           scratch: Path | None) -> list[dict]:
    def rows(graded: list[tuple[Exercise, float, str]]) -> list[dict]:
        return [_row(sub.student, sub.path, ex.name, points, float(ex.points), reason)
                for ex, points, reason in graded]

    if not exercises:
        return [_row(sub.student, sub.path, "", 0.0, 0.0, error)]
    if not error:
        try:
            nb, changed = rebuild.rebuild(nb, rebuild.template(source, name))
        except (OSError, ValueError) as exc:  # NoSource, a source that breaks the build rules
            error = _("grader error: {error}", error=exc)
    if error:
        return rows([(ex, 0.0, error) for ex in exercises])
    # short: the kernel's Unix sockets are in it (a socket's path holds at most 107 bytes)
    work = Path(tempfile.mkdtemp(prefix="s-" if scratch else "course-grade-", dir=scratch))
    (work / "cwd").mkdir()
    token = secrets.token_hex(16)
    session = KernelSession(nb, work / "cwd")
    try:
        for ex in exercises:  # before the submission runs, and only here
            judge.prepare(ex)
        # The kernel and its engines import an answer-free package: the graded lesson's
        # components are the submission's own, the others the reference; no judge's side.
        sandbox.answer_free(work / "pkg", name, source)
        mine = sandbox.learner_components(nb, name, work / "home")
        nb.cells = [c for c in nb.cells if c.cell_type == "code"]
        path = os.pathsep.join(filter(None, [str(work / "pkg"), env.get("PYTHONPATH")]))
        session.start(dict(env, **{GRADING_ENV: "1", HOME_ENV: str(work / "home"),
                                   USE_ENV: ",".join(["reference", *(f"{m}=mine" for m in mine)]),
                                   "PYTHONPATH": path, containment.SUBMISSION_ENV: token}),
                      work, forked_from, limits)
        note, fatal = _run_notebook(session, list(nb.cells), limits.notebook_timeout)
        if fatal:
            return rows([(ex, 0.0, changed + fatal) for ex in exercises])
        return rows([(ex, points, changed + note + reason) for ex, points, reason
                     in _run_checks(session, exercises, work, limits.exercise_timeout)])
    except Exception as exc:  # noqa: BLE001 - e.g. the kernel would not start; grading goes on
        return rows([(ex, 0.0, _("grader error: {error}", error=f"{type(exc).__name__}: {exc}"))
                     for ex in exercises])
    finally:
        session.close()
        # Whatever escaped the namespace's end (or every process, where there is none) is
        # ended here: nothing of this submission runs when its row is written.
        containment.end_marked(token)
        shutil.rmtree(work, ignore_errors=True)


def grade_all(paths: list[str | os.PathLike], out_dir: str | os.PathLike, *,
              notebook_timeout: float = 600.0, exercise_timeout: float | None = None,
              lesson: str | None = None, exercise_files: list[str] = (),
              resume: bool = False, source: str | os.PathLike = SOURCE,
              memory_limit: int = MEMORY_LIMIT, file_limit: int = FILE_LIMIT,
              progress=print) -> list[dict]:
    """Grade every submission, writing the results after each one; returns all rows.
    With `resume`, rows already in `out_dir/grades.json` are kept and their notebooks skipped;
    whatever an interrupted run left running is ended first."""
    if exercise_files:
        os.environ[EXTRA_ENV] = os.pathsep.join(
            [p for p in os.environ.get(EXTRA_ENV, "").split(os.pathsep) if p]
            + [str(Path(f).resolve()) for f in exercise_files])
    if lesson and lesson not in lessons():
        raise ValueError(f"unknown lesson {lesson!r}; lessons with exercises: {lessons()}")
    limits = Limits(notebook_timeout, exercise_timeout, memory_limit, file_limit)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    ledger = containment.Ledger(out)
    for pid in ledger.end_leftovers():
        progress(f"ended PID {pid}, left running by an interrupted course-grade")
    containment.adopt_orphans()
    if containment.namespace_command() is None:
        progress("warning: this machine allows no PID namespace (Linux's unshare, as root or "
                 "with user namespaces): a submission's processes are ended by their marker "
                 "instead (docs/instructors.md, What the grader assumes)")
    results = Results(out, _previous(out) if resume else [])
    results.write()  # an interrupted run may have replaced one file and not the other
    done = {r["notebook"] for r in results.rows}
    env = dict(os.environ, **{containment.TOKEN_ENV: ledger.token})
    ledger.write()  # our token is on disk before anything we start can carry it
    forker = kernel_zygote()
    try:
        for sub in collect(paths):
            if str(sub.path) in done:
                progress(f"{sub.student} ({sub.path}): already graded, skipped")
                continue
            start = time.monotonic()
            new = grade_submission(sub, limits=limits, lesson=lesson, source=Path(source),
                                   env=env, forked_from=forker, scratch=ledger.scratch)
            if results.tampered():
                for r in new:
                    r["reason"] += (" [the submission wrote into the grades folder: "
                                    "the grades were rewritten]")
            results.rows += new
            results.write()
            done.add(str(sub.path))
            got, best = sum(r["points"] for r in new), sum(r["max_points"] for r in new)
            progress(f"{sub.student} ({sub.path}): {got:g} / {best:g} points "
                     f"[{time.monotonic() - start:.0f}s]")
    finally:
        zygote.end(forker)
        ledger.clear()
    return results.rows
