"""nbgrader 0.9 itself on our source: `generate_assignment` writes the student release the build
writes (every lesson), and `autograde` gives a solved lesson 00 full points and the untouched
release zero, through the build's nbgrader cell metadata and the check cells' behaviour under
nbgrader (they raise when they do not pass)."""

import copy
import os
import subprocess
import sys
from pathlib import Path

import nbformat
import pytest

from course_lib.course.exports import export_source
from course_lib.course.grading.nbgrader_course import write_course

pytest.importorskip("nbgrader", reason="nbgrader is in the dev extra: pip install -e .[dev]")
pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
LESSON = "00_cluster"


# nbgrader's own API, in one process for every lesson (a command per lesson costs 2-3 s each),
# configured by the nbgrader_config.py the course folder holds
GENERATE = """
import sys
from nbgrader.apps import NbGraderAPI
from traitlets.config.loader import PyFileConfigLoader
api = NbGraderAPI(config=PyFileConfigLoader("nbgrader_config.py", path=".").load_config())
for name in sys.argv[1:]:
    done = api.generate_assignment(name)
    if not done["success"]:
        sys.exit(done["log"])
"""


def _run(course: Path, *args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    # nbgrader runs `alembic` by name: the virtual environment's bin must be on PATH
    env = dict(os.environ, IPP_NONINTERACTIVE="1",
               PATH=os.pathsep.join([str(Path(sys.executable).parent), os.environ["PATH"]]))
    done = subprocess.run([sys.executable, *args], cwd=course, env=env,
                          capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, done.stderr[-3000:]
    return done


def _cells(nb) -> list[tuple[str, str]]:
    """(type, source) of each cell, build directives dropped as our build drops them."""
    out = []
    for c in nb.cells:
        src = c.source
        if c.cell_type == "code":
            src = "\n".join(line for line in src.split("\n") if not line.startswith("#|"))
            if not src.strip():
                continue
        out.append((c.cell_type, src))
    return out


@pytest.fixture(scope="module")
def course(tmp_path_factory):
    course = tmp_path_factory.mktemp("nbgrader")
    lessons = write_course(course)
    _run(course, "-c", GENERATE, *lessons)
    return course, lessons


def test_generate_assignment_gives_our_student_release(course):
    course, lessons = course
    assert len(lessons) == len(list((ROOT / "solutions").glob("*.ipynb")))
    for name in lessons:
        theirs = nbformat.read(course / "release" / name / f"{name}.ipynb", as_version=4)
        ours = nbformat.read(ROOT / "notebooks" / f"{name}.ipynb", as_version=4)
        assert _cells(theirs) == _cells(ours), name


def test_autograde_full_points_when_solved_zero_when_untouched(course):
    from nbgrader.api import Gradebook

    course, _ = course
    release = nbformat.read(course / "release" / LESSON / f"{LESSON}.ipynb", as_version=4)
    answers = {c.id: c.source for c in nbformat.read(ROOT / "solutions" / f"{LESSON}.ipynb",
                                                    as_version=4).cells}
    solved = copy.deepcopy(release)
    for cell in solved.cells:
        if cell.metadata.get("nbgrader", {}).get("solution"):
            cell.source = export_source(answers[cell.id], LESSON)  # the answer, without markers
    for student, nb in (("solved", solved), ("untouched", release)):
        folder = course / "submitted" / student / LESSON
        folder.mkdir(parents=True)
        nbformat.write(nb, folder / f"{LESSON}.ipynb")
    _run(course, "-m", "nbgrader", "autograde", LESSON)
    with Gradebook(f"sqlite:///{course / 'gradebook.db'}") as gb:
        scores = {s: (gb.find_submission(LESSON, s).score, gb.find_submission(LESSON, s).max_score)
                  for s in ("solved", "untouched")}
    assert scores == {"solved": (2.0, 2.0), "untouched": (0.0, 2.0)}
