"""Running a learner's function against an exercise: locally under a time limit, or on a cluster.

`check(name, fn)` is what a notebook's check cell calls; `grade_function` is the same check
returning a `Result` (the batch grader and tests use it). Neither hangs: a local call runs in a
thread that is abandoned (and asked to stop) after the time limit; a cluster call uses
`Cluster.run(timeout=...)`, which interrupts the stuck ranks.
"""

from __future__ import annotations

import copy
import ctypes
import inspect
import os
import sys
import threading
import traceback
from pathlib import Path
from typing import Any, Callable

from course_lib.grading.compare import WRONG_VALUE, mismatch, show
from course_lib.grading.catalogue import (Case, CheckTimeout, Exercise, get_exercise,
                                         substitute)
from course_lib.grading.report import CaseResult, Outcome, Result, Row

GRADING_ENV = "COURSE_LIB_GRADING"  # set by course-grade: check cells then do nothing
_NOT_LEARNER = tuple(str(Path(p).resolve()) for p in
                     {sys.prefix, sys.base_prefix, Path(__file__).resolve().parents[1]})


def learner_frame(exc: BaseException) -> str:
    """Where in the learner's code `exc` came from, e.g. "in shard_sum, line 3: x = 1 / 0"."""
    frames = traceback.extract_tb(exc.__traceback__)
    mine = [f for f in frames if not str(Path(f.filename).resolve()).startswith(_NOT_LEARNER)]
    if not (mine or frames):
        return ""
    f = (mine or frames)[-1]
    code = f": {f.line.strip()}" if f.line else ""
    from course_lib.overlay import describe_file

    owner = describe_file(f.filename)
    return f"in {f.name}, line {f.lineno}{code}" + (f" ({owner})" if owner else "")


def guarded_call(fn: Callable, harness: Callable | None, args: tuple, kwargs: dict) -> dict:
    """Call `fn` (through `harness`) and describe what happened as a plain dict, never raising."""
    try:
        value = harness(fn, *args, **kwargs) if harness else fn(*args, **kwargs)
        return {"status": Outcome.RETURNED, "value": value}
    except NotImplementedError as exc:
        return {"status": Outcome.NOT_IMPLEMENTED, "where": learner_frame(exc)}
    except CheckTimeout:
        return {"status": Outcome.TIMEOUT}
    except Exception as exc:  # noqa: BLE001 - the learner's error is the result here
        msg = str(exc).strip().splitlines()
        return {"status": Outcome.ERROR, "error": f"{type(exc).__name__}: {msg[0] if msg else ''}",
                "where": learner_frame(exc)}


def _on_rank(fn: Callable, harness: Callable | None, args: tuple, kwargs: dict) -> dict:
    """Engine side: call `fn` with RANK / WORLD_SIZE replaced by this engine's values."""
    from course_lib.cluster import get_rank, get_world_size

    rank, world = get_rank(), get_world_size()
    return guarded_call(fn, harness, substitute(args, rank, world),
                        substitute(kwargs, rank, world))


def call_with_limit(fn: Callable, harness: Callable | None, args: tuple, kwargs: dict,
                    limit: float) -> dict:
    """`guarded_call` in a daemon thread; after `limit` seconds, report a timeout and ask the
    thread to stop (a pure-Python loop stops; a call blocked in C finishes in the background)."""
    box: dict = {}
    worker = threading.Thread(target=lambda: box.update(guarded_call(fn, harness, args, kwargs)),
                              name="course_lib-check", daemon=True)
    worker.start()
    try:
        worker.join(limit)
    finally:
        if worker.is_alive():  # timed out, or the user interrupted the kernel
            ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(worker.ident),
                                                       ctypes.py_object(CheckTimeout))
            worker.join(1.0)
    if not box or box["status"] == Outcome.TIMEOUT:
        return {"status": Outcome.TIMEOUT, "stopped": not worker.is_alive()}
    return box


def signature_problem(ex: Exercise, fn: Callable) -> str | None:
    """Why `fn` cannot be called the way the exercise calls it, or None."""
    if ex.params is None:
        return None
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return None
    try:
        sig.bind(*ex.params)
    except TypeError:
        return f"wrong signature: expected {ex.signature()}, got {fn.__name__}{sig}"
    return None


def _outcome_row(rank: Any, out: dict, expected: Any, ex: Exercise, limit: float) -> Row:
    want = show(expected)
    status = Outcome(out["status"])
    if status is Outcome.RETURNED:
        diff = mismatch(out["value"], expected, ex.rtol, ex.atol)
        return Row(rank, diff is None, want, show(out["value"]), diff or "")
    if status is Outcome.NOT_IMPLEMENTED:
        return Row(rank, False, want, "NotImplementedError", "not implemented yet", status)
    if status is Outcome.TIMEOUT:
        note = f"timed out after {limit:g}s (endless loop or deadlock?)"
        if out.get("stopped") is False:
            note += "; it is still running in the background: restart the kernel if slow"
        return Row(rank, False, want, "no result", note, status)
    if status is Outcome.LOST:
        return Row(rank, False, want, "no result", out["note"], status)
    where = f" ({out['where']})" if out.get("where") else ""
    return Row(rank, False, want, out["error"], f"raised {out['error']}{where}", status)


class ReferenceMissing(Exception):
    """The expected values need a packaged module that this release ships without answers."""


RELEASED_EXPECTED = Path(__file__).with_name("expected.json")  # written by course.py release
_released: dict | None = None


def released_expected(ex: Exercise, c: Case, rank: int | None, world: int | None) -> Any:
    """A student release's expected value, computed by the instructor's reference when the
    release was made: used where the release does not ship the reference."""
    global _released
    if _released is None:
        from course_lib.grading import plain

        _released = plain.loads(RELEASED_EXPECTED.read_text()) if RELEASED_EXPECTED.is_file() else {}
    entry = _released.get(ex.name)
    index = next(i for i, x in enumerate(ex.cases) if x is c)
    if entry is None or entry["world"] != world or index >= len(entry["cases"]):
        raise ReferenceMissing(f"{ex.name}'s expected values need a reference that this "
                               "student release does not ship; check it in the instructor's "
                               "repository")
    return entry["cases"][index][rank]


def _expected(ex: Exercise, c: Case, rank: int | None = None, world: int | None = None) -> Any:
    """The expected value, from the packaged reference only (never the learner's overlay)."""
    from course_lib.components import COMPONENTS
    from course_lib.overlay import packaged_only, reference_shipped

    if c.has_expected:
        return c.expected
    args, kwargs = copy.deepcopy((c.args, c.kwargs))
    if rank is not None:
        args, kwargs = substitute(args, rank, world), substitute(kwargs, rank, world)
    with packaged_only():
        try:
            return ex.reference(*args, **kwargs)
        except Exception as exc:
            # In a release a stub's NotImplementedError may surface wrapped (a CheckpointError)
            if not isinstance(exc, NotImplementedError) and all(map(reference_shipped, COMPONENTS)):
                raise
    return released_expected(ex, c, rank, world)


def expected_values(ex: Exercise) -> dict:
    """Every expected value of an exercise, as `released_expected` reads them back."""
    world = ex.world_size if ex.distributed else None
    ranks = range(world) if world else [None]
    return {"world": world, "cases": [{r: _expected(ex, c, r, world) for r in ranks}
                                      for c in ex.cases]}


def _run_local(ex: Exercise, c: Case, fn: Callable, limit: float) -> tuple[list[Row], str]:
    expected = _expected(ex, c)
    args, kwargs = copy.deepcopy((c.args, c.kwargs))
    out = call_with_limit(fn, ex.harness, args, kwargs, limit)
    return [_outcome_row(None, out, expected, ex, limit)], ""


def _run_cluster(ex: Exercise, c: Case, fn: Callable, cluster: Any,
                 limit: float) -> tuple[list[Row], str]:
    """Rows per rank (and the total), and why the remaining cases cannot run, if so."""
    from course_lib.cluster import ClusterError, EngineDied, RankError, RankTimeout

    world = cluster.world_size
    expected = [_expected(ex, c, r, world) for r in range(world)]
    halt = ""
    try:
        outs = cluster.run(_on_rank, fn, ex.harness, c.args, c.kwargs, timeout=limit)
    except RankTimeout as exc:
        outs = [{"status": Outcome.TIMEOUT} if r in exc.failures else
                {"status": Outcome.LOST, "note": "finished, but other ranks hung"}
                for r in range(world)]
        halt = getattr(exc, "note", "")
    except RankError as exc:  # the call never ran or its result could not come back
        outs = [{"status": Outcome.LOST,
                 "note": exc.failures.get(r, "no result: another rank failed")}
                for r in range(world)]
        # ipyparallel may report an engine that exited mid-task as a plain EngineError
        if isinstance(exc, EngineDied) or any("EngineError" in m for m in exc.failures.values()):
            halt = (f"an engine died during {c.describe(ex.function)} (did the function exit "
                    "the process?); call .restart() on the cluster")
    except ClusterError:  # a stopped or broken cluster: not the learner's function's fault
        raise
    except Exception as exc:  # noqa: BLE001 - e.g. the function cannot be sent to the engines
        note = f"could not send it to the engines: {type(exc).__name__}: {exc}"
        outs = [{"status": Outcome.LOST, "note": note}] * world
    rows = [_outcome_row(r, out, expected[r], ex, limit) for r, out in enumerate(outs)]
    if ex.total is not None:
        if all(out["status"] == Outcome.RETURNED for out in outs):
            rows.append(_outcome_row("all", {"status": Outcome.RETURNED,
                                             "value": ex.total([o["value"] for o in outs])},
                                     ex.total(expected), ex, limit))
        else:
            rows.append(Row("all", False, show(ex.total(expected)), "no result",
                            "some ranks gave no value", Outcome.LOST))
    return rows, halt


def _summary(ex: Exercise, cases: list[CaseResult], stopped: str) -> tuple[float, str]:
    failed = [c for c in cases if not c.passed]
    points = round(ex.points * (len(cases) - len(failed)) / len(cases), 2)
    if stopped:
        return points, stopped
    if not failed:
        return points, f"all {len(cases)} cases passed"
    first = failed[0]
    row = next(r for r in first.rows if not r.passed)
    rank = "" if row.rank is None else ("all ranks: " if row.rank == "all" else
                                        f"rank {row.rank}: ")
    what = row.note
    if what == WRONG_VALUE:
        what = f"expected {row.expected}, got {row.got}"
    return points, f"{len(failed)} of {len(cases)} cases failed; first: {first.label}: {rank}{what}"


def grade_function(exercise: str | Exercise, fn: Any, cluster: Any = None, *,
                   time_limit: float | None = None) -> Result:
    """Check `fn` against every case of `exercise`; points in proportion to cases passed."""
    ex = exercise if isinstance(exercise, Exercise) else get_exercise(exercise)
    limit = float(time_limit or ex.time_limit)

    def zero(reason: str, cases: list | None = None) -> Result:
        return Result(ex.name, 0.0, float(ex.points), reason, cases or [], ex.hint)

    if fn is None:
        return zero(f"{ex.function} is not defined: run the cell that defines it")
    if not callable(fn):
        return zero(f"{ex.function} should be a function, got {type(fn).__name__}")
    problem = signature_problem(ex, fn)
    if problem:
        return zero(problem)
    if ex.distributed and cluster is None:
        raise ValueError(f"{ex.name} runs on the cluster: check({ex.name!r}, {ex.function}, "
                         f"cluster=c) with c = course_lib.cluster.start(...)")
    cases: list[CaseResult] = []
    stopped = ""
    for c in ex.cases:
        label = c.describe(ex.function)
        if stopped:
            cases.append(CaseResult(label, [Row(None, False, "", "", "not run", Outcome.NOT_RUN)]))
            continue
        try:
            rows, halt = (_run_cluster(ex, c, fn, cluster, limit) if ex.distributed
                          else _run_local(ex, c, fn, limit))
        except ReferenceMissing as exc:
            return zero(str(exc), cases)
        cases.append(CaseResult(label, rows))
        outcomes = {r.outcome for r in rows}
        if Outcome.NOT_IMPLEMENTED in outcomes:
            return zero(f"not implemented yet: {ex.function} raises NotImplementedError", cases)
        if Outcome.TIMEOUT in outcomes:
            where = [str(r.rank) for r in rows
                     if r.rank is not None and r.outcome is Outcome.TIMEOUT]
            ranks = f" on rank(s) {', '.join(where)}" if where else ""
            stopped = (f"timed out: {label} did not finish within {limit:g}s{ranks} "
                       f"(an endless loop or a deadlock?){'; ' + halt if halt else ''}")
        elif halt:
            stopped = halt
    points, reason = _summary(ex, cases, stopped)
    return Result(ex.name, points, float(ex.points), reason, cases, ex.hint)


def _export_before_check(ex: Exercise, fn: Any, notebook: Path, cluster: Any) -> list[str]:
    """Write the learner's lesson into their overlay, so the check (on every rank) and later
    lessons run it; lines to show when that could not be done faithfully."""
    from course_lib import overlay
    from course_lib.build import BuildError

    try:
        written = overlay.export(ex.notebook, notebook)
    except (BuildError, SyntaxError) as exc:
        return [f"Your lesson could not be exported into your course_lib: {exc}"]
    overlay.refresh([cluster] if cluster is not None else [])
    try:
        mine = inspect.getsource(fn).strip()
    except (OSError, TypeError):
        return []
    if not any(mine in p.read_text(encoding="utf-8") for p in written) and any(
            f"def {ex.function}(" in p.read_text(encoding="utf-8") for p in written):
        return [f"{notebook.name} as saved differs from the {ex.function} you ran: save the "
                "notebook (Ctrl+S) and check again, so that your course_lib gets this version"]
    return []


def _blame_earlier_lessons(ex: Exercise, fn: Any, cluster: Any, limit: float | None,
                           result: Result) -> Result:
    """A check that fails while it runs the learner's components from earlier lessons: rerun it
    with each of them replaced by the reference (latest lesson first) and name the one whose
    replacement makes it pass."""
    from dataclasses import replace

    from course_lib import overlay

    clusters = [cluster] if cluster is not None else []
    earlier = [m for m in sorted(overlay.COMPONENTS, key=overlay.COMPONENTS.get, reverse=True)
               if overlay.COMPONENTS[m] < ex.notebook and overlay.resolve(m).mine
               and overlay.reference_shipped(m)]
    for module in earlier:
        with overlay.using({module: "reference"}, clusters):
            again = grade_function(ex, fn, cluster, time_limit=limit)
        if again.passed:
            lesson = overlay.lesson_of(module).split("_")[0]
            return replace(result, reason=(
                f"{result.reason}. It passes with the reference course_lib.{module} in place "
                f"of yours: the cause is your lesson {lesson} (fix it there, or "
                f"course_lib.use({module.rsplit('.', 1)[-1]}='reference'))"))
    return result


def check(exercise: str, fn: Any, cluster: Any = None, *, time_limit: float | None = None) -> None:
    """A check cell: grade `fn` and show the per-case (per-rank) table under the cell. In a
    student notebook the lesson is first exported into the learner's course_lib (the check
    then runs it) and the outcome recorded, which decides whether later lessons use it."""
    if os.environ.get(GRADING_ENV):
        print(f"check({exercise!r}) skipped: the grader runs its own checks")
        return
    from course_lib import overlay

    ex = get_exercise(exercise)
    notebook = overlay.find_notebook(ex.notebook)
    notes = _export_before_check(ex, fn, notebook, cluster) if notebook else []
    result = grade_function(ex, fn, cluster, time_limit=time_limit)
    if notebook:
        overlay.record(ex.name, result.passed)
        if not result.passed:
            result = _blame_earlier_lessons(ex, fn, cluster, time_limit, result)
    try:
        from IPython import get_ipython
        from IPython.display import display

        if get_ipython() is not None:
            display(result)
            for note in notes:
                print(note)
            return
    except ImportError:
        pass
    print("\n".join([str(result), *notes]))
