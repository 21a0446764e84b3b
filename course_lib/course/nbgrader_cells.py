"""Which cells of a lesson are the learner's, which grade, which are given: nbgrader's metadata.

The build writes nbgrader's cell metadata (schema 3) into every solution notebook, so an
instructor can run nbgrader itself on our source: a cell with a solution region is a solution
cell (the learner's), a cell calling `check("lessonNN.name", ...)` is a locked grade cell worth
its exercises' points, every other code cell is locked (given). `course-grade` reads the same
marks to rebuild a submission (`rebuild`).
"""

from __future__ import annotations

import copy
import re
from typing import TYPE_CHECKING

from course_lib.course.catalogue import get_exercise
from course_lib.course.markers import BEGIN_SOLUTION, BuildError

if TYPE_CHECKING:
    import nbformat

SCHEMA = 3
_CHECK = re.compile(r"""\bcheck\(\s*["']([\w.\-]+)["']""")


def checked_exercises(source: str) -> list[str]:
    """The exercises a cell's `check(...)` calls grade, in order."""
    return _CHECK.findall(source)


def is_solution(cell: dict) -> bool:
    """A cell whose content is the learner's answer."""
    return bool(cell.get("metadata", {}).get("nbgrader", {}).get("solution"))


def grade_id(cell: dict) -> str | None:
    return cell.get("metadata", {}).get("nbgrader", {}).get("grade_id")


def _marks(cell: dict, where: str) -> dict | None:
    if cell["cell_type"] not in ("code", "markdown"):
        return None
    solution = BEGIN_SOLUTION in cell["source"]
    if cell["cell_type"] == "markdown" and not solution:
        return None
    names = checked_exercises(cell["source"]) if cell["cell_type"] == "code" else []
    if solution and names:
        raise BuildError(f"{where}: a cell holds both a solution region and a check; "
                         "split it, so the check stays locked")
    marks = {"grade": bool(names), "grade_id": f"cell-{cell['id']}", "locked": not solution,
             "schema_version": SCHEMA, "solution": solution, "task": False}
    if names:
        try:
            marks["points"] = sum(get_exercise(n).points for n in names)
        except KeyError as exc:
            raise BuildError(f"{where}: check of an unknown exercise: {exc}") from None
    return marks


def with_nbgrader(nb: nbformat.NotebookNode, name: str) -> nbformat.NotebookNode:
    """A copy of a solution notebook with nbgrader's metadata on every code cell and every
    markdown answer cell (ids as grade ids; the cells must have ids, nbformat 4.5)."""
    out = copy.deepcopy(nb)
    for i, cell in enumerate(out.cells):
        if not cell.get("id"):
            raise BuildError(f"{name}, cell {i}: no cell id (nbformat 4.5 notebooks have them)")
        marks = _marks(cell, f"{name}, cell {i}")
        if marks is None:
            cell.metadata.pop("nbgrader", None)
        else:
            cell.metadata["nbgrader"] = marks
    return out
