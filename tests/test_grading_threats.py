"""course-grade against a determined student: each attack below was written for this test, one
per class of the instructors' threat model (docs/instructors.md). One run grades them all, then
an honest submission, which must keep full points.

- forged outcomes: the answer asks the grading code for the expected values and returns them;
- the reference within reach: the answer calls the package's own implementation;
- a process that outlives grading: it answers every SIGTERM with a fresh copy of itself and
  keeps rewriting the grades after the grader is gone.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
import uuid
from pathlib import Path

import nbformat
import pytest

from course_lib.processes import end_processes
from tagged import tagged_processes

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
FIXTURES = Path(__file__).parent / "fixtures" / "grading"
TAG = "COURSE_GRADE_THREAT_TEST"

# lesson 00: every rank sums its shard of range(n); the forger returns what the judge expects
FORGER = '''
def shard_sum(rank, world_size, n):
    from course_lib.course.grading import judge
    from course_lib.course.catalogue import get_exercise
    ex = get_exercise("lesson00.shard_sum")
    case = next(c for c in ex.cases if tuple(c.args[2:]) == (world_size, n))
    return judge.expected(ex, case, rank, ex.world_size)
'''
# lesson 03: the sampler's shard of the dataset; the borrower calls course_lib.data's own
BORROWER = '''
def shard_indices(*args, **kwargs):
    import course_lib.data
    return course_lib.data.shard_indices(*args, **kwargs)
'''
# fixture lesson 96: right answers, and a process that will not die
PHOENIX = '''
def scale(t, k):
    return t * k

import os, signal, time, pathlib
def _phoenix():
    def again(*_):
        if os.fork() == 0:
            _phoenix_body()
        os._exit(0)
    signal.signal(signal.SIGTERM, again)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    _phoenix_body()

def _phoenix_body():
    out = pathlib.Path({out!r})
    end = time.time() + 30
    while time.time() < end:
        time.sleep(0.2)
        for name in ("grades.csv", "grades.json"):
            try:
                text = (out / name).read_text()
                (out / name).write_text(text.replace("0.0", "2.0").replace(",0,", ",2,"))
                pathlib.Path({evidence!r} + ".tmp").write_text("rewrote")
                os.replace({evidence!r} + ".tmp", {evidence!r})  # whole, even if killed
            except OSError:
                pass
    os._exit(0)

if os.fork() == 0:
    os.setsid()
    if os.fork() == 0:
        _phoenix()
    os._exit(0)
time.sleep(0.5)
'''
WRONG_96 = "def scale(t, k):\n    return t + k\n"


def _submission(template: Path, function: str, code: str, folder: Path, name: str) -> None:
    nb = nbformat.read(template, as_version=4)
    (cell,) = [c for c in nb.cells if c.cell_type == "code" and f"def {function}(" in c.source]
    cell.source = code
    (folder / name).mkdir(parents=True)
    nbformat.write(nb, folder / name / template.name)


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    root = tmp_path_factory.mktemp("threats")
    subs, out, evidence = root / "subs", root / "out", root / "evidence"
    evidence.mkdir()
    fill = lambda code, who: code.replace("{out!r}", repr(str(out))).replace(  # noqa: E731
        "{evidence!r}", repr(str(evidence / who)))
    lesson00 = ROOT / "notebooks" / "00_cluster.ipynb"
    _submission(lesson00, "shard_sum", FORGER, subs, "forger")
    lesson03 = next((ROOT / "notebooks").glob("03*.ipynb"))
    _submission(lesson03, "shard_indices", BORROWER, subs, "borrower")
    _submission(FIXTURES / "96_cheats.ipynb", "scale", fill(PHOENIX + WRONG_96, "phoenix"), subs,
                "phoenix")
    _submission(FIXTURES / "96_cheats.ipynb", "scale", "def scale(t, k):\n    return t * k\n",
                subs, "zz_honest_96")
    source = root / "source"  # the instructor's notebooks of the three lessons graded
    source.mkdir()
    for path in [*(ROOT / "solutions").glob("0[03]*.ipynb"), FIXTURES / "96_cheats.ipynb"]:
        shutil.copy(path, source / path.name)
    marker = uuid.uuid4().hex
    env = dict(os.environ, **{TAG: marker})
    try:
        done = subprocess.run(
            [sys.executable, "-m", "course_lib.course.grading.cli", str(subs), "--out", str(out),
             "--exercises", str(FIXTURES / "exercises_96.py"), "--source", str(source),
             "--timeout-notebook", "300"],
            env=env, capture_output=True, text=True, timeout=900)
        left = [p.pid for p in tagged_processes(TAG, marker)]  # the whole process table, by marker
        graded = (out / "grades.json").read_text()
        time.sleep(3)  # a phoenix that survived would rewrite the grades by now
        later = (out / "grades.json").read_text()
    finally:  # whatever the assertions say, leave nothing behind
        end_processes([(p.pid, p.create_time()) for p in tagged_processes(TAG, marker)], grace=2.0,
                      reap=False)
    assert done.returncode == 0, done.stderr
    rows = {(r["student"], r["exercise"]): r for r in json.loads(later)}
    return {"rows": rows, "left": left, "graded": graded, "later": later,
            "evidence": evidence, "stderr": done.stderr}


def _points(run, student: str) -> float:
    return sum(r["points"] for (who, _), r in run["rows"].items() if who == student)


def _best(run, student: str) -> float:
    return sum(r["max_points"] for (who, _), r in run["rows"].items() if who == student)


def test_honest_submissions_keep_full_points(run):
    """Graded after the attacks, in the same run. (A real lesson's honest submission scoring
    full points is tests/test_nbgrader.py's.)"""
    assert _points(run, "zz_honest_96") == _best(run, "zz_honest_96") > 0, run["rows"]


def test_a_forged_outcome_scores_nothing(run):
    """The expected values are computed only where the judge runs: the kernel cannot import
    the references the judge computes them from."""
    assert _points(run, "forger") == 0.0, run["rows"]
    (row,) = [r for (who, _), r in run["rows"].items() if who == "forger"]
    assert "ReferenceMissing" in row["reason"], row


def test_calling_the_package_s_own_implementation_scores_nothing(run):
    """In the submission's package, the graded lesson's components are its own answers: the
    borrower calls itself."""
    assert _best(run, "borrower") > 0
    assert _points(run, "borrower") == 0.0, run["rows"]


def test_no_process_outlives_grading_and_the_grades_stay(run):
    assert (run["evidence"] / "phoenix").read_text() == "rewrote"  # it ran, and wrote
    assert run["left"] == [], "processes of a graded submission still run"
    assert run["later"] == run["graded"]
    assert _points(run, "phoenix") == 0.0, run["rows"]
