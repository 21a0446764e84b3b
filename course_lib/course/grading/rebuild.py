"""A submission rebuilt from the instructor's source: only the learner's cells are theirs.

As nbgrader restores its locked cells, `course-grade` runs the lesson's student release with
each solution cell replaced by the submission's cell of the same grade id (or cell id); an
edited or deleted given cell, or a cell the learner added, cannot change the grade. The
reason says when the submission differed.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from course_lib.course.notebooks import _read, student_notebook
from course_lib.course.nbgrader_cells import grade_id, is_solution, with_nbgrader
from course_lib.i18n import _

if TYPE_CHECKING:
    import nbformat


class NoSource(FileNotFoundError):
    """The instructor's source of a lesson is not where `course-grade` was told to look."""


def template(source: Path, lesson: str) -> nbformat.NotebookNode:
    """The lesson's student release, made from the instructor's notebook `source/lesson.ipynb`."""

    path = Path(source) / f"{lesson}.ipynb"
    if not path.is_file():
        raise NoSource(f"no instructor source for lesson {lesson}: {path} is missing "
                       "(pass --source, the folder of the solution notebooks)")
    return student_notebook(with_nbgrader(_read(path), path.name), path.name)


def _numbers(found: list[int]) -> str:
    return ", ".join(map(str, found))


def rebuild(submitted: nbformat.NotebookNode,
            release: nbformat.NotebookNode) -> tuple[nbformat.NotebookNode, str]:
    """The release's code cells with the submission's solution cells in place; and a note
    (empty when the submission changed nothing it should not have)."""
    import copy

    by_key: dict[str, dict] = {}
    for cell in submitted.cells:
        for key in (cell.get("id"), grade_id(cell)):
            if key and cell.cell_type == "code":
                by_key.setdefault(key, cell)
    used: set[int] = set()
    cells, edited, deleted, missing = [], [], [], []
    code = [c for c in release.cells if c.cell_type == "code"]
    for number, cell in enumerate(code, 1):
        theirs = by_key.get(grade_id(cell) or "") or by_key.get(cell.get("id") or "")
        mine = copy.deepcopy(cell)
        if theirs is not None:
            used.add(id(theirs))
        if is_solution(cell):
            if theirs is None:
                missing.append(number)
            else:
                mine.source = theirs.source
        elif theirs is None:
            deleted.append(number)
        elif theirs.source.strip() != cell.source.strip():
            edited.append(number)
        cells.append(mine)
    added = sum(1 for c in submitted.cells if c.cell_type == "code" and id(c) not in used)
    notes = []
    if missing:
        notes.append(_("answer cell(s) {cells} missing: their stubs ran", cells=_numbers(missing)))
    if edited or deleted:
        notes.append(_("given code cell(s) {cells} edited or deleted in the submission: the "
                       "original ran", cells=_numbers(sorted(edited + deleted))))
    if added:
        notes.append(_("{n} code cell(s) added to the notebook were not run (only answer "
                       "cells count)", n=added))
    out = copy.deepcopy(release)
    out.cells = cells
    return out, ("; ".join(notes) + ". ") if notes else ""
