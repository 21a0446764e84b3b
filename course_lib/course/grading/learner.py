"""Running a learner's function against an exercise: locally under a time limit, or on a cluster.

`check(name, fn)` is what a notebook's check cell calls; `grade_function` is the same check
returning a `Result` (tests use it): `collect` calls the function, `judge.judge` grades what it
did (the batch grader runs the two in different processes). Neither hangs: a local call runs in a
thread that is abandoned (and asked to stop) after the time limit; a cluster call uses
`Cluster.run(timeout=...)`, which interrupts the stuck ranks.
"""

from __future__ import annotations

import copy
import ctypes
import inspect
import os
import secrets
import sys
import threading
import traceback
from pathlib import Path
from typing import Any, Callable

from course_lib.course.grading import judge
from course_lib.course.catalogue import (Case, CheckTimeout, Exercise, get_exercise,
                                         substitute)
from course_lib.course.grading.report import Outcome, Result
from course_lib.i18n import _, language, language_of
from course_lib.course.paths import PACKAGE
from course_lib.course.overlay import describe_file
from course_lib.cluster import get_rank, get_world_size
from course_lib.course.grading import sub_worlds
from course_lib.cluster import ClusterError, EngineDied, RankError, RankTimeout
from course_lib.course import overlay
from course_lib.course.markers import BuildError

GRADING_ENV = "COURSE_LIB_GRADING"  # set by course-grade: check cells then do nothing
_NOT_LEARNER = tuple(str(Path(p).resolve()) for p in
                     {sys.prefix, sys.base_prefix, PACKAGE})


def learner_frame(exc: BaseException) -> str:
    """Where in the learner's code `exc` came from, e.g. "in shard_sum, line 3: x = 1 / 0"."""
    frames = traceback.extract_tb(exc.__traceback__)
    mine = [f for f in frames if not str(Path(f.filename).resolve()).startswith(_NOT_LEARNER)]
    if not (mine or frames):
        return ""
    f = (mine or frames)[-1]
    code = f": {f.line.strip()}" if f.line else ""

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


def _on_rank(fn: Callable, harness: Callable | None, args: tuple, kwargs: dict,
             serial: int = 0) -> dict:
    """Engine side: call `fn` with RANK / WORLD_SIZE replaced by this engine's values, in the
    case's own message tags, and note who this rank sent to and received from."""
    rank, world = get_rank(), get_world_size()
    sub_worlds.begin_case(serial)
    out = guarded_call(fn, harness, substitute(args, rank, world),
                       substitute(kwargs, rank, world))
    links = sub_worlds.case_links()
    return out if links is None else dict(out, links=links)


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
        return _("wrong signature: expected {expected}, got {got}", expected=ex.signature(),
                 got=f"{fn.__name__}{sig}")
    return None


def _collect_local(ex: Exercise, c: Case, fn: Callable, limit: float) -> dict:
    args, kwargs = copy.deepcopy((c.args, c.kwargs))
    return {"outs": [call_with_limit(fn, ex.harness, args, kwargs, limit)], "halt": ""}


def _collect_cluster(ex: Exercise, c: Case, fn: Callable, cluster: Any, limit: float,
                     serial: int = 0) -> dict:
    """Each rank's outcome, and why the remaining cases cannot run, if so."""
    world = cluster.world_size
    halt = ""
    try:
        outs = cluster.run(_on_rank, fn, ex.harness, c.args, c.kwargs, serial, timeout=limit)
    except RankTimeout as exc:
        outs = [{"status": Outcome.TIMEOUT} if r in exc.failures else
                {"status": Outcome.LOST, "note": _("finished, but other ranks hung")}
                for r in range(world)]
        halt = getattr(exc, "note", "")
        _settle(cluster)
    except RankError as exc:  # the call never ran or its result could not come back
        outs = [{"status": Outcome.LOST,
                 "note": exc.failures.get(r, _("no result: another rank failed"))}
                for r in range(world)]
        # ipyparallel may report an engine that exited mid-task as a plain EngineError
        if isinstance(exc, EngineDied) or any("EngineError" in m for m in exc.failures.values()):
            halt = _("an engine died during {case} (did the function exit the process?); call "
                     ".restart() on the cluster", case=c.describe(ex.function))
    except ClusterError:  # a stopped or broken cluster: not the learner's function's fault
        raise
    except Exception as exc:  # noqa: BLE001 - e.g. the function cannot be sent to the engines
        note = _("could not send it to the engines: {error}", error=f"{type(exc).__name__}: {exc}")
        outs = [{"status": Outcome.LOST, "note": note}] * world
    return {"outs": outs, "halt": halt}


def _settle(cluster: Any) -> None:
    """After a case was cut off: restart the engines, so that the next check starts clean. A rank
    interrupted inside a case can leave a narrowed world, a thread still blocked in C, or
    messages in flight that a later case would receive; not all of them can be told from here."""
    print(_("a case timed out: the engines are restarted so that the next check starts clean"),
          flush=True)
    cluster.restart()


def refusal(ex: Exercise, fn: Any) -> str | None:
    """Why `fn` cannot be checked at all (undefined, not a function, wrong signature), or None."""
    if fn is None:
        return _("{function} is not defined: run the cell that defines it", function=ex.function)
    if not callable(fn):
        return _("{function} should be a function, got {type}", function=ex.function,
                 type=type(fn).__name__)
    return signature_problem(ex, fn)


def collect(ex: Exercise, fn: Callable, cluster: Any, limit: float) -> list[dict]:
    """Call `fn` on the exercise's cases, one outcome per call (per rank), stopping where
    grading stops (not implemented, a timeout, an engine lost); `judge.judge` grades them."""
    if ex.distributed and cluster is None:
        raise ValueError(_("{name} runs on the cluster: {call} with c = "
                           "course_lib.cluster.start(...)", name=ex.name,
                           call=f"check({ex.name!r}, {ex.function}, cluster=c)"))
    found = []
    first = secrets.randbelow(2 ** 14)  # each case's message tags differ from the last check's
    for i, c in enumerate(ex.cases):
        found.append(_collect_cluster(ex, c, fn, cluster, limit, first + i) if ex.distributed
                     else _collect_local(ex, c, fn, limit))
        statuses = {out["status"] for out in found[-1]["outs"]}
        if found[-1]["halt"] or statuses & {Outcome.NOT_IMPLEMENTED, Outcome.TIMEOUT}:
            break
    return found


def grade_function(exercise: str | Exercise, fn: Any, cluster: Any = None, *,
                   time_limit: float | None = None) -> Result:
    """Check `fn` against every case of `exercise`; points in proportion to cases passed."""
    ex = exercise if isinstance(exercise, Exercise) else get_exercise(exercise)
    limit = float(time_limit or ex.time_limit)
    problem = refusal(ex, fn)
    if problem:
        return judge.zero(ex, problem)
    return judge.judge(ex, collect(ex, fn, cluster, limit), limit)


def _export_before_check(ex: Exercise, fn: Any, notebook: Path, cluster: Any) -> list[str]:
    """Write the learner's lesson into their overlay, so the check (on every rank) and later
    lessons run it; lines to show when that could not be done faithfully."""
    try:
        written = overlay.export(ex.notebook, notebook)
    except (BuildError, SyntaxError) as exc:
        return [_("Your lesson could not be exported into your course_lib: {error}", error=exc)]
    overlay.refresh([cluster] if cluster is not None else [])
    try:
        mine = inspect.getsource(fn).strip()
    except (OSError, TypeError):
        return []
    if not any(mine in p.read_text(encoding="utf-8") for p in written) and any(
            f"def {ex.function}(" in p.read_text(encoding="utf-8") for p in written):
        return [_("{notebook} as saved differs from the {function} you ran: save the notebook "
                  "(Ctrl+S) and check again, so that your course_lib gets this version",
                  notebook=notebook.name, function=ex.function)]
    return []


def _blame_earlier_lessons(ex: Exercise, fn: Any, cluster: Any, limit: float | None,
                           result: Result) -> Result:
    """A check that fails while it runs the learner's components from earlier lessons: rerun it
    with each of them replaced by the reference (latest lesson first) and name the one whose
    replacement makes it pass."""
    from dataclasses import replace


    clusters = [cluster] if cluster is not None else []
    earlier = [m for m in sorted(overlay.COMPONENTS, key=overlay.COMPONENTS.get, reverse=True)
               if overlay.COMPONENTS[m] < ex.notebook and overlay.resolve(m).mine
               and overlay.reference_shipped(m)]
    for module in earlier:
        with overlay.using({module: "reference"}, clusters):
            again = grade_function(ex, fn, cluster, time_limit=limit)
        if again.passed:
            lesson = overlay.lesson_of(module).split("_")[0]
            return replace(result, reason=_(
                "{reason}. It passes with the reference course_lib.{module} in place of yours: "
                "the cause is your lesson {lesson} (fix it there, or {use})", reason=result.reason,
                module=module, lesson=lesson,
                use=f"course_lib.use({module.rsplit('.', 1)[-1]}='reference')"))
    return result


def check(exercise: str, fn: Any, cluster: Any = None, *, time_limit: float | None = None,
          hint: int = 0) -> None:
    """A check cell: grade `fn` and show the per-case (per-rank) table under the cell. In a
    student notebook the lesson is first exported into the learner's course_lib (the check
    then runs it) and the outcome recorded, which decides whether later lessons use it.
    `hint=1`, then `hint=2`, also shows the exercise's hints up to that level (never code).
    Under nbgrader's autograder a check that does not pass raises, so its grade cell scores 0."""
    if isinstance(hint, bool) or not isinstance(hint, int) or hint < 0:
        raise ValueError(_("check(..., hint=...) takes a level: 0 (none), 1, 2, ...; got "
                           "{value}", value=repr(hint)))
    if os.environ.get(GRADING_ENV):
        print(_("check({exercise}) skipped: the grader runs its own checks",
                exercise=repr(exercise)))
        return

    ex = get_exercise(exercise)
    if os.environ.get(overlay.NBGRADER_ENV):  # nbgrader: a grade cell fails by raising
        result = grade_function(ex, fn, cluster, time_limit=time_limit)
        if not result.passed:
            raise AssertionError(str(result))
        print(result)
        return
    notebook = overlay.find_notebook(ex.notebook)
    with language(language_of(notebook) if notebook else None):  # the edition's language
        notes = _export_before_check(ex, fn, notebook, cluster) if notebook else []
        result = grade_function(ex, fn, cluster, time_limit=time_limit)
        if notebook:
            overlay.record(ex.name, result.passed)
            if not result.passed:
                result = _blame_earlier_lessons(ex, fn, cluster, time_limit, result)
        _show(result.with_hints(hint), notes)


def _show(result: Result, notes: list[str]) -> None:
    """The table under the check cell (HTML in JupyterLab), then any notes."""
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
