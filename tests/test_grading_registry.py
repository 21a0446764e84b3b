"""Every registered exercise is wired into its lesson: solution, check cell, student stub.

Static checks (no kernel): the batch grader finds the learner's function by name in the
notebook's kernel, so the names here must match the notebooks exactly.
"""

import ast
import re
from pathlib import Path

import nbformat
import pytest

from course_lib.course.grading import exercises_for, lessons
from course_lib.course.catalogue import LOAD_ERRORS

ROOT = Path(__file__).resolve().parent.parent
PACKAGE_FILES = ROOT / "course_lib" / "course" / "grading" / "exercises"
# Only the package's lessons (test modules register fixture exercises of their own): a lesson's
# module, or its package (one module per part).
EXERCISES = [ex for lesson in lessons() for ex in exercises_for(lesson)
             if (PACKAGE_FILES / f"{ex.name.split('.')[0]}.py").exists()
             or (PACKAGE_FILES / ex.name.split('.')[0] / "__init__.py").exists()]


def test_every_exercise_module_loads():
    assert LOAD_ERRORS == {}
    assert "lesson00.shard_sum" in {ex.name for ex in EXERCISES}


def _defining_cell(path: Path, function: str) -> str:
    nb = nbformat.read(path, as_version=4)
    found = [c.source for c in nb.cells if c.cell_type == "code"
             and re.search(rf"^def {function}\(", c.source, re.M)]
    assert len(found) == 1, f"{path.name}: {len(found)} cells define {function}()"
    return found[0]


@pytest.mark.parametrize("ex", EXERCISES, ids=lambda ex: ex.name)
def test_exercise_is_wired_into_its_lesson(ex):
    solution = ROOT / "solutions" / f"{ex.notebook}.ipynb"
    release = ROOT / "notebooks" / f"{ex.notebook}.ipynb"
    assert solution.exists(), f"{ex.name}: no solutions/{ex.notebook}.ipynb"
    source = _defining_cell(solution, ex.function)
    assert "### BEGIN SOLUTION" in source
    if ex.params is not None:
        fn = next(n for n in ast.walk(ast.parse(source))
                  if isinstance(n, ast.FunctionDef) and n.name == ex.function)
        names = [a.arg for a in fn.args.posonlyargs + fn.args.args]
        assert tuple(names[:len(ex.params)]) == ex.params, f"{ex.name}: def {fn.name}{names}"
    text = solution.read_text()
    assert re.search(rf"check\(\s*\\?[\"']{re.escape(ex.name)}\\?[\"']", text), \
        f"{ex.name}: no check cell in solutions/{ex.notebook}.ipynb"
    assert "raise NotImplementedError" in _defining_cell(release, ex.function)
