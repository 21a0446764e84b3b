"""The catalogue of exercises: what each learner's function is called with and must return.

Each lesson registers its exercises in `course_lib/course/grading/exercises/lessonNN.py` (or the
package `lessonNN/`, a module per part); learners' check cells and the batch grader both look
them up here, so a notebook cannot change them.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import pkgutil
import re
import sys
from pathlib import Path
from dataclasses import dataclass, field
from typing import Any, Callable

from course_lib.course.compare import show
from course_lib.i18n import _

_NAME = re.compile(r"^[A-Za-z_]\w*\.[A-Za-z_]\w*$")
_NOTSET = object()


class CheckTimeout(Exception):
    """Raised inside a learner's call that ran past its time limit, to stop it (a harness
    that catches exceptions must let it through)."""


class _RankArg:
    """Placeholder argument replaced on each rank by that rank's rank or world size."""

    def __init__(self, which: str):
        self.which = which

    def __repr__(self) -> str:
        return self.which

    def __reduce__(self):  # unpickles as the module's own constant
        return (_rank_arg, (self.which,))

    def value(self, rank: int, world_size: int) -> int:
        return rank if self.which == "rank" else world_size


def _rank_arg(which: str) -> _RankArg:
    return RANK if which == "rank" else WORLD_SIZE


RANK, WORLD_SIZE = _RankArg("rank"), _RankArg("world_size")


def substitute(values, rank: int | None, world_size: int | None):
    """`values` (a tuple or dict) with RANK / WORLD_SIZE replaced for one rank."""
    def one(v):
        return v.value(rank, world_size) if isinstance(v, _RankArg) else v
    if isinstance(values, dict):
        return {k: one(v) for k, v in values.items()}
    return tuple(one(v) for v in values)


@dataclass(frozen=True)
class Case:
    """One call of the learner's function: `fn(*args, **kwargs)`, and what it must return."""

    args: tuple = ()
    kwargs: dict = field(default_factory=dict)
    expected: Any = _NOTSET
    label: str | None = None

    @property
    def has_expected(self) -> bool:
        return self.expected is not _NOTSET

    def describe(self, fn_name: str) -> str:
        """How the case reads in a report, e.g. `shard_sum(rank, world_size, 10)`."""
        if self.label:
            return _(self.label)  # labels are in the package's catalogue (course_lib.course.messages)
        parts = [show(a) for a in self.args] + [f"{k}={show(v)}" for k, v in self.kwargs.items()]
        text = f"{fn_name}({', '.join(parts)})"
        return text if len(text) <= 60 else text[:57] + "..."


def case(*args: Any, expected: Any = _NOTSET, label: str | None = None, **kwargs: Any) -> Case:
    """`case(RANK, WORLD_SIZE, 10)` is shorter than `Case(args=(RANK, WORLD_SIZE, 10))`."""
    return Case(args=args, kwargs=kwargs, expected=expected, label=label)


@dataclass(frozen=True)
class Exercise:
    """An exercise: the function the learner writes, its test cases, points and limits.

    The expected value of a case is `case.expected` if given, else `reference(*args, **kwargs)`.
    A lesson's references live apart from its declaration, in
    `course_lib/course/grading/references/lessonNN.py` (or the package `lessonNN/`), named here as
    "lessonNN:function" and imported only where the judge runs: the processes that run a
    submission (its kernel, its engines) are given a package without them, so no answer cell
    can compute what the judge expects
    (computed by the judge, with RANK / WORLD_SIZE substituted per rank for distributed
    exercises: there it must not communicate). The learner's value is `fn(*args, **kwargs)`, or
    `harness(fn, *args, **kwargs)` when the function is tested through a wrapper (for example
    one that builds a tensor, calls `fn` on it in place and returns it); on the cluster the
    harness runs on every rank, so it must live in an importable module.
    """

    name: str                          # "lessonNN.function_name"; the part after the dot is
    notebook: str                      # the function the learner defines; notebook: "NN_stem"
    cases: tuple[Case, ...]
    params: tuple[str, ...] | None = None  # expected parameters, e.g. ("rank", "world_size", "n")
    reference: Callable[..., Any] | str | None = None  # a callable, or "lessonNN:function"
    points: float = 1.0
    # Shown only on request, `check(..., hint=1)` then `hint=2`: the idea or invariant, then
    # a step or a picture; never code, nor the index arithmetic that is the answer.
    hints: tuple[str, ...] = ()
    time_limit: float = 10.0           # seconds per call (per case; on every rank at once)
    distributed: bool = False          # run on every rank of a course_lib.cluster Cluster
    world_size: int = 4                # the grader's cluster size for distributed exercises
    backend: str = "scratch"           # the grader's cluster backend
    total: Callable[[list], Any] | None = None  # distributed: also check total(values by rank)
    harness: Callable[..., Any] | None = None
    rtol: float = 1e-5
    atol: float = 1e-8
    # Why a failing value is wrong, in the lesson's terms ("rank 2 ends with chunk 1 summed over
    # 2 of 3 ranks"): explain(case, rank, expected, got) -> str or None (then the generic
    # difference). Runs where the judge runs, on plain values.
    explain: Callable[[Case, Any, Any, Any], str | None] | str | None = None

    def __post_init__(self):
        object.__setattr__(self, "cases", tuple(self.cases))
        if isinstance(self.hints, str):
            raise ValueError(f"{self.name}: hints is a tuple of levels, not one string")
        object.__setattr__(self, "hints", tuple(self.hints))
        if self.params is not None:
            object.__setattr__(self, "params", tuple(self.params))
        if not _NAME.match(self.name):
            raise ValueError(f"exercise name {self.name!r} must look like 'lesson00.function'")
        if not self.cases or not all(isinstance(c, Case) for c in self.cases):
            raise ValueError(f"{self.name}: needs at least one Case (use grading.case(...))")
        if self.reference is None and not all(c.has_expected for c in self.cases):
            raise ValueError(f"{self.name}: give a reference or an expected value for each case")
        for what in ("reference", "explain"):
            value = getattr(self, what)
            if isinstance(value, str) and not _REFERENCE_NAME.match(value):
                raise ValueError(f"{self.name}: {what}={value!r} must name a judge-side "
                                 f"function as 'lessonNN:function'")
        if not self.points > 0 or not self.time_limit > 0:
            raise ValueError(f"{self.name}: points and time_limit must be positive")
        uses_rank = any(isinstance(v, _RankArg) for c in self.cases
                        for v in (*c.args, *c.kwargs.values()))
        if uses_rank and not self.distributed:
            raise ValueError(f"{self.name}: RANK / WORLD_SIZE only make sense when distributed")
        if self.total is not None and not self.distributed:
            raise ValueError(f"{self.name}: `total` only applies to distributed exercises")

    @property
    def function(self) -> str:
        """The name of the learner's function (the part of `name` after the dot)."""
        return self.name.split(".", 1)[1]

    def signature(self) -> str:
        return f"{self.function}({', '.join(self.params or ())})"

    def judge_side(self, what: str) -> Callable[..., Any] | None:
        """`reference` or `explain` as a callable: a "lessonNN:function" name is imported from
        `course_lib.course.grading.references` (ModuleNotFoundError where a submission runs)."""
        value = getattr(self, what)
        if not isinstance(value, str):
            return value
        module, _, function = value.partition(":")
        return getattr(importlib.import_module(f"{REFERENCES}.{module}"), function)


REFERENCES = "course_lib.course.grading.references"  # the judge's side of every lesson
_REFERENCE_NAME = re.compile(r"^lesson\w+:[A-Za-z_]\w*$")
_REGISTRY: dict[str, Exercise] = {}


def register(exercise: Exercise) -> Exercise:
    """Add an exercise to the registry; returns it. A name belongs to one notebook."""
    old = _REGISTRY.get(exercise.name)
    if old is not None and old.notebook != exercise.notebook:  # same notebook: a reload
        raise ValueError(f"exercise {exercise.name!r} is registered by both {old.notebook} "
                         f"and {exercise.notebook}")
    _REGISTRY[exercise.name] = exercise
    return exercise


# Each lesson's declarations, found by name and imported only when asked for (they import this
# module: a plug-in folder, not a dependency).
EXERCISES = "course_lib.course.grading.exercises"
EXERCISES_DIR = Path(__file__).resolve().parent / "grading" / "exercises"
EXTRA_ENV = "COURSE_LIB_EXERCISES"  # os.pathsep-separated .py files with more exercises
_EXTRA_LOADED: set[str] = set()


def load_exercise_file(path: str | os.PathLike) -> None:
    """Register the exercises of a .py file outside the package (tests, a private course)."""
    path = str(Path(path).resolve())
    if path in _EXTRA_LOADED:
        return
    name = "course_lib_exercises_" + re.sub(r"\W", "_", Path(path).stem) + f"_{len(_EXTRA_LOADED)}"
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise ValueError(f"cannot load exercises from {path}: not a Python file")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # so that its functions pickle by reference
    spec.loader.exec_module(module)
    _EXTRA_LOADED.add(path)


LOAD_ERRORS: dict[str, str] = {}  # exercise module -> why it failed to import


def _load_all(lesson: str | None = None) -> None:
    """Import every lesson's exercise module (or only `lesson`'s, e.g. "lesson05", and the
    extra files); one broken lesson does not break the others."""
    modules = [f"{EXERCISES}.{info.name}" for info in pkgutil.iter_modules([str(EXERCISES_DIR)])
               if lesson is None or info.name == lesson]
    for name in modules + list(filter(None, os.environ.get(EXTRA_ENV, "").split(os.pathsep))):
        if name in LOAD_ERRORS:
            continue
        try:
            load_exercise_file(name) if name.endswith(".py") else importlib.import_module(name)
        except Exception as exc:  # noqa: BLE001 - reported by get_exercise and a test
            LOAD_ERRORS[name] = f"{type(exc).__name__}: {exc}"


def get_exercise(name: str) -> Exercise:
    """The registered exercise called `name`; a KeyError lists the known ones."""
    # Its own lesson's module first: the others import torch, which a pure-Python lesson's
    # kernel need not pay for.
    _load_all(name.split(".")[0])
    if name not in _REGISTRY:
        _load_all()
    if name not in _REGISTRY:
        known = ", ".join(sorted(_REGISTRY)) or "none"
        broken = "".join(f"; {m} failed to load: {e}" for m, e in sorted(LOAD_ERRORS.items()))
        raise KeyError(f"no exercise named {name!r}; known exercises: {known}{broken}")
    return _REGISTRY[name]


def exercises_for(notebook: str) -> list[Exercise]:
    """The exercises of one lesson notebook (its stem, e.g. "00_cluster"), as declared."""
    _load_all()
    return [e for e in _REGISTRY.values() if e.notebook == notebook]


def lessons() -> list[str]:
    """Every notebook stem that has exercises."""
    _load_all()
    return sorted({e.notebook for e in _REGISTRY.values()})
