"""The learner's own course_lib: each lesson's completed export cells, used by later lessons.

A student notebook's export cells (the build marks them in their metadata) are written into the
overlay, `$COURSE_LIB_HOME` or `~/.course_lib`, as `course_lib/<module>.py`, generated the way
the build generates the reference. An import finder then resolves each component module (see
`course_lib.course.components`) to the learner's version or the reference, and says which in one
line. `use("mine" | "reference", ddp=...)` chooses, in the client and on running clusters;
engines started later inherit the choice through the environment.

The rule: "mine" takes your module when your lesson's checks all pass (or when you name the
module, `use(ddp="mine")`); otherwise the reference. A release without the reference (see
`course_lib.course.release`) has nothing else to run, so your module is used as it stands.

The learner's package on disk (its folder, the record of checks, a lesson exported into it) is
`course_lib.course.learner_package`'s; its names are importable from here too.
"""

from __future__ import annotations

import contextlib
import importlib.abc
import importlib.util
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable, Iterator

from course_lib.course.exports import STUDENT_HEADER, module_path
from course_lib.i18n import _, ngettext
from course_lib.course.learner_package import (HOME_ENV, OVERLAY_HEADER, export, find_notebook,
                                               home, lesson_of, modules_of, not_passed, record)
from course_lib.course.markers import BuildError
from course_lib.course.paths import PACKAGE
from course_lib.course.components import COMPONENTS

__all__ = ["HOME_ENV", "NBGRADER_ENV", "USE_ENV", "CHOICES", "OVERLAY_HEADER", "home",
           "lesson_of", "modules_of", "record", "not_passed", "find_notebook", "export",
           "reference_shipped", "Resolution", "resolve", "install", "forget", "packaged_only",
           "refresh", "use", "using", "describe_file", "main"]

NBGRADER_ENV = "NBGRADER_EXECUTION"  # set by nbgrader while it autogrades or validates
USE_ENV = "COURSE_LIB_USE"     # "mine" or "reference", then ",module=choice" overrides
CHOICES = ("mine", "reference")


# -- resolving a component ------------------------------------------------------------------


def _choices() -> dict[str, str]:
    """{"*": default, module: choice} from the environment (the client's and engines')."""
    # nbgrader's autograder grades on the instructor's machine: its references, as course-grade
    default = "reference" if os.environ.get(NBGRADER_ENV) else "mine"
    parts = [p.strip() for p in os.environ.get(USE_ENV, default).split(",") if p.strip()]
    found = {"*": "mine"}
    for part in parts:
        module, _sep, choice = part.rpartition("=")
        found[module or "*"] = choice
    return found


def reference_shipped(module: str) -> bool:
    """False in a student release, whose packaged module has its exercise regions removed."""
    try:
        with (PACKAGE / module_path(module).split("/", 1)[1]).open(encoding="utf-8") as f:
            return not f.readline().startswith(STUDENT_HEADER)
    except OSError:
        return False


@dataclass(frozen=True)
class Resolution:
    """Which code `course_lib.<module>` runs, and the line that says so."""

    module: str
    path: Path | None  # the learner's file, or None for the packaged module
    line: str

    @property
    def mine(self) -> bool:
        return self.path is not None


def resolve(module: str) -> Resolution:
    """Apply the rule in this module's docstring to one component."""
    lesson = lesson_of(module)
    number, choices = lesson.split("_", 1)[0], _choices()
    named = module in choices
    choice = choices.get(module, choices["*"])
    name, mine = f"course_lib.{module}", home() / module_path(module)
    why = _("your lesson {number} is not exported yet", number=number)
    if mine.is_file():  # only then read the record (it loads the exercises)
        failing, unchecked = not_passed(lesson)
        why = (ngettext("your lesson {number} has {n} failing check",
                        "your lesson {number} has {n} failing checks", len(failing),
                        number=number) if failing else
               ngettext("{n} check of your lesson {number} not run yet",
                        "{n} checks of your lesson {number} not run yet", len(unchecked),
                        number=number) if unchecked else "")
    shipped = reference_shipped(module)
    if choice == "mine" and mine.is_file() and (named or not why or not shipped):
        line = (_("{name}: yours, from lesson {number} ({why})", name=name, number=number,
                  why=why) if why else
                _("{name}: yours, from lesson {number}", name=name, number=number))
        return Resolution(module, mine, line)
    if not shipped:
        return Resolution(module, None, _("{name}: not written yet: {why}, and this release "
                                          "ships no reference; complete lesson {number}",
                                          name=name, why=why, number=number))
    if choice == "reference":
        return Resolution(module, None, _("{name}: the reference (you chose it)", name=name))
    return Resolution(module, None, _("{name}: the reference: {why}", name=name, why=why))


def _running(module: str, app: str) -> bool:
    """Whether this process runs the Jupyter application `module.app` (imported is not enough:
    a kernel forked from the zygote has the engine's modules too)."""
    found = sys.modules.get(module)
    # not initialized(): that also answers for the instance of a sibling class
    return found is not None and isinstance(getattr(found, app)._instance, getattr(found, app))


def _quiet() -> bool:
    """Engines, spawned ranks and scripts resolve silently; a learner's kernel says the line."""
    return (not _running("ipykernel.kernelapp", "IPKernelApp")
            or _running("ipyparallel.engine.app", "IPEngine"))


class _Finder(importlib.abc.MetaPathFinder):
    """Loads `course_lib.<component>` from the learner's overlay when the rule says so."""

    announced: set[str] = set()
    disabled = 0  # inside `packaged_only`

    def find_spec(self, fullname, path=None, target=None):
        module = fullname.removeprefix("course_lib.")
        if module == fullname or module not in COMPONENTS or self.disabled:
            return None
        found = resolve(module)
        if (module not in self.announced and not _quiet() and (found.mine or _active())
                and not _later_than_this_lesson(module)):
            print(found.line, flush=True)
        self.announced.add(module)
        if found.mine:
            return importlib.util.spec_from_file_location(fullname, found.path)
        return None  # the regular finders load the packaged module


def _later_than_this_lesson(module: str) -> bool:
    """Whether `module` is built by a lesson after the one this kernel runs (lesson 02's kernel
    imports lesson 09b's `dist.diagnosis` through `dist`): its line would be noise there."""
    session = Path(os.environ.get("JPY_SESSION_NAME", "")).stem
    return bool(session) and session[:1].isdigit() and lesson_of(module) > session


def _active() -> bool:
    """Whether the learner has an overlay at all (else, in the repository, stay silent)."""
    return (home() / "checks.json").exists() or not all(map(reference_shipped, COMPONENTS))


STARTUP_ENV = "COURSE_LIB_STARTUP"  # "module:function" the processes a lesson starts call first


def install() -> None:
    """Make the learner's components win in this process: the finder first on `sys.meta_path`
    (once) and the components loaded before it resolved again. Processes started from here on
    (a cluster's zygote and engines) call it before they import anything (STARTUP_ENV)."""
    os.environ[STARTUP_ENV] = f"{__name__}:install"
    if any(isinstance(f, _Finder) for f in sys.meta_path):
        return
    sys.meta_path.insert(0, _Finder())
    forget()


def _no_clusters() -> Iterable:
    return ()


live_clusters: Callable[[], Iterable] = _no_clusters  # set by course_lib.course.startup


def _resolvable(modules: set[str]) -> dict[str, object]:
    """The loaded modules that a new resolution may change: those components, and every
    generated module (they import the components)."""
    found = {}
    for name, mod in list(sys.modules.items()):
        short = name.removeprefix("course_lib.")
        if short == name:
            continue
        generated = False
        if short not in modules and getattr(mod, "__file__", None):
            with contextlib.suppress(OSError, UnicodeDecodeError):
                with open(mod.__file__, encoding="utf-8") as f:
                    generated = f.readline().startswith(("# AUTOGENERATED", STUDENT_HEADER))
        if short in modules or generated:
            found[name] = mod
    return found


def forget(modules: Iterable[str] | None = None) -> None:
    """Drop components (and the generated modules built on them) from `sys.modules`, so the
    next import resolves again; objects made before keep the code they were made with."""
    wanted = set(COMPONENTS if modules is None else modules)
    for name in _resolvable(wanted):
        del sys.modules[name]
    _Finder.announced -= wanted


_PACKAGED: dict[str, object] = {}  # packaged modules loaded inside `packaged_only`, reused


def _is_mine(mod: object) -> bool:
    return Path(getattr(mod, "__file__", None) or "/").resolve().is_relative_to(home().resolve())


@contextlib.contextmanager
def packaged_only() -> Iterator[None]:
    """Within the block, `course_lib` imports load the packaged modules, never the learner's:
    a check's expected values must not come from the code it checks. Afterwards, imports
    resolve as before (and what was loaded before is back)."""
    saved = _resolvable(set(COMPONENTS))
    tainted = any(map(_is_mine, saved.values()))
    if tainted:
        for name in saved:
            del sys.modules[name]
        sys.modules.update(_PACKAGED)
    _Finder.disabled += 1
    try:
        yield
    finally:
        _Finder.disabled -= 1
        if tainted or _active():
            fresh = {n: m for n, m in _resolvable(set(COMPONENTS)).items()
                     if saved.get(n) is not m}
            _PACKAGED.update(fresh)
            for name in fresh:
                del sys.modules[name]
            sys.modules.update(saved)


def _set(spec: str) -> None:
    """Engine and client side: adopt a choice (`USE_ENV`'s format) and resolve afresh."""
    os.environ[USE_ENV] = spec
    forget()


def _spec(choices: dict[str, str]) -> str:
    default = choices.get("*", "mine")
    return ",".join([default] + [f"{m}={c}" for m, c in sorted(choices.items()) if m != "*"])


def _module_named(key: str) -> str:
    """A keyword of `use` to its module: `ddp`, or `wire` / `dist_wire` for `dist.wire`."""
    for module in COMPONENTS:
        if key in (module, module.replace(".", "_"), module.rsplit(".", 1)[-1]):
            return module
    raise TypeError(_("use() got {key}: not a component the learner writes; they are: {names}",
                      key=repr(key), names=", ".join(sorted(COMPONENTS))))


def _apply(choices: dict[str, str], clusters: Iterable | None) -> None:
    spec = _spec(choices)
    _set(spec)

    for cluster in (live_clusters() if clusters is None else clusters):
        cluster.run(_set, spec)


def refresh(clusters: Iterable | None = None) -> None:
    """Resolve every component afresh (after an export), here and on the clusters."""
    _apply(_choices(), clusters)


def use(default: str | None = None, /, *, clusters: Iterable | None = None,
        **modules: str) -> list[str]:
    """Choose the learner's components or the reference, all at once and/or per module:
    `use("mine")`, `use("reference")`, `use(ddp="reference")`. Applies here and on every
    running cluster (or those given); returns, and prints, each component's line."""
    choices = _choices()
    for value in [default, *modules.values()]:
        if value is not None and value not in CHOICES:
            raise ValueError(_("use() takes 'mine' or 'reference', got {value}",
                               value=repr(value)))
    if default is not None:
        choices = {"*": default}
    choices.update({_module_named(k): v for k, v in modules.items()})
    _apply(choices, clusters)
    lines = [resolve(m).line for m in sorted(COMPONENTS, key=COMPONENTS.get)]
    for line in lines:
        print(line)
    return lines


@contextlib.contextmanager
def using(choices: dict[str, str], clusters: Iterable | None = None) -> Iterator[None]:
    """`use` for the duration of a block, then the previous choice again (checks use it to
    rerun with the reference)."""
    before = _choices()
    after = dict(before, **choices)
    _apply(after, clusters)
    try:
        yield
    finally:
        _apply(before, clusters)


def describe_file(filename: str) -> str | None:
    """"your lesson 04's course_lib/ddp.py" for a file of the overlay, else None."""
    try:
        rel = Path(filename).resolve().relative_to(home().resolve())
    except (ValueError, OSError):
        return None
    module = rel.with_suffix("").as_posix().removeprefix("course_lib/").replace("/", ".")
    if module not in COMPONENTS:
        return None
    return _("your lesson {number}'s {file}", number=lesson_of(module).split("_")[0],
             file=rel.as_posix())


def main(argv: list[str] | None = None) -> int:
    """`python3 course.py export LESSON [NOTEBOOK]`: export on demand; `... export --status`."""
    import argparse


    parser = argparse.ArgumentParser(prog="course.py export", description=main.__doc__)
    parser.add_argument("lesson", nargs="?", help='a lesson notebook\'s stem or number: "04" '
                                                  '(all its parts) or "04b"')
    parser.add_argument("notebook", nargs="?", help="its path (default: notebooks/LESSON.ipynb)")
    parser.add_argument("--status", action="store_true", help="say what each component runs")
    args = parser.parse_args(argv)
    if args.status or not args.lesson:
        for module in sorted(COMPONENTS, key=COMPONENTS.get):
            print(resolve(module).line)
        return 0
    lessons = sorted(set(COMPONENTS.values()))
    number = args.lesson.split("_")[0]  # "04" names every part of lesson 04 (04a, 04b)
    matches = [x for x in lessons if x == args.lesson or x.split("_")[0] == number
               or x.split("_")[0].rstrip("abcdefgh") == number]
    if not matches:
        print(_("course.py export: no lesson {lesson} with exercises to export; they are: "
                "{lessons}", lesson=repr(args.lesson), lessons=", ".join(lessons)),
              file=sys.stderr)
        return 2
    if args.notebook and len(matches) > 1:
        print(_("course.py export: {lesson} has {n} parts ({parts}): name one to give its "
                "notebook", lesson=repr(args.lesson), n=len(matches), parts=", ".join(matches)),
              file=sys.stderr)
        return 2
    written = []
    try:
        for lesson in matches:
            written += export(lesson, args.notebook)
    except (FileNotFoundError, BuildError, SyntaxError) as exc:
        print(_("course.py export: {exc}", exc=exc), file=sys.stderr)
        return 1
    for path in written:
        print(_("wrote {path}", path=path))
    return 0
