"""The package a submission runs against: the course without the answers of the lesson graded.

`course-grade` runs each submission's kernel (and its engines) on a copy of `course_lib` made
for it: no judge's side (`grading/references`, no expected values), the graded lesson's
components as the student release has them (exercise regions stubbed), and the submission's
own answers for them in an overlay of its own. Calling "the library's version" of an exercise
from an answer cell therefore fails or runs the learner's own code. Components of the other
lessons are the reference (the grader says so in the reason when a submission used one).
A fresh copy per submission: nothing one submission writes there reaches the next.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import nbformat

from course_lib.course import build, overlay
from course_lib.course.grading import rebuild
from course_lib.course.exports import stub_modules
from course_lib.course.paths import PACKAGE

# never where a submission runs
JUDGE_SIDE = ("course/grading/references", "course/grading/expected.json")
SKIP = ("__pycache__", ".egg-info")


def answer_free(dest: Path, lesson: str, source: Path) -> Path:
    """Write the package into `dest/course_lib`, without the judge's side and with `lesson`'s
    components stubbed (from the instructor's `source` notebooks); returns `dest`, the folder
    to put first on the submission's PYTHONPATH."""
    target = Path(dest) / "course_lib"

    def ignore(folder: str, names: list[str]) -> set[str]:
        rel = Path(folder).relative_to(PACKAGE).as_posix()
        return {n for n in names if any(s in n for s in SKIP)
                or (f"{rel}/{n}" if rel != "." else n) in JUDGE_SIDE}

    shutil.copytree(PACKAGE, target, ignore=ignore)
    release = rebuild.template(source, lesson)
    for path, text in stub_modules({f"{build.NOTEBOOKS}/{lesson}.ipynb":
                                    nbformat.writes(release).encode()}).items():
        (Path(dest) / path).write_text(text, encoding="utf-8")
    return Path(dest)


def learner_components(notebook: nbformat.NotebookNode, lesson: str, home: Path) -> list[str]:
    """Export the rebuilt submission's answer cells into the overlay at `home` (as a learner's
    check would); returns the modules written, each to be used as the learner's."""
    path = home / f"{lesson}.ipynb"
    home.mkdir(parents=True, exist_ok=True)
    nbformat.write(notebook, path)
    try:
        written = overlay.export(lesson, path, into=home)
    finally:
        path.unlink(missing_ok=True)
    return [p.relative_to(home).with_suffix("").as_posix().removeprefix("course_lib/")
            .replace("/", ".") for p in written]
