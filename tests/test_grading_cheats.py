"""course-grade against submissions that cheat: each tries to raise its points or harm the run.

One command-line run grades them all (fixture lesson 96, a tensor exercise), each cheat placed
in the answer cell, the one cell of a submission the grader runs. A plain wrong answer scores 0;
every cheater with that wrong answer must score 0 as well, the honest student graded last must
get full points, grades.csv must be what the grader computed, and nothing may be left running.
"""

import csv
import json
import os
import subprocess
import sys
import uuid
from pathlib import Path

import nbformat
import pytest

from course_lib.processes import end_processes
from tagged import tagged_processes

pytestmark = pytest.mark.slow

FIXTURES = Path(__file__).parent / "fixtures" / "grading"
SOLUTION = FIXTURES / "96_cheats.ipynb"
ANSWER = 2  # the answer cell's index in the fixture
RIGHT = "def scale(t, k):\n    return t * k\n"
WRONG = "def scale(t, k):\n    return t + k\n"
TAG = "COURSE_GRADE_CHEAT_TEST"

CHEATS = {
    # the comparison and the grading functions, patched in the kernel
    "patch_compare": WRONG + """
import course_lib.course.compare as _c, course_lib.course.grading.judge as _j
import course_lib.course.grading.learner as _l
from course_lib.course.grading.report import Result
_full = lambda ex, *a, **k: Result(getattr(ex, 'name', ex), 2.0, 2.0, 'all 3 cases passed')
_c.mismatch = lambda *a, **k: None
_j.judge = _l.grade_function = _full
""",
    # the function that reports to the grader, wrapped to report full points
    "wrap_grading": WRONG + """
import json, course_lib.course.grading.kernel as _k
from course_lib.course.grading.report import Result
def _report(name, fn, path, *a, **k):
    json.dump(Result(name, 2.0, 2.0, 'all 3 cases passed').to_dict(), open(path, 'w'))
_k.collect_to_file = _report
""",
    # a result file in the grader's format, claiming passes, and files where results once went
    "fake_result": WRONG + """
import json, os, course_lib.course.grading.kernel as _k
_ok = {"status": "returned", "value": True, "passed": True, "points": 2}
def _report(name, fn, path, *a, **k):
    json.dump({"exercise": name, "points": 2, "passed": True,
               "cases": [{"outs": [_ok], "halt": ""}] * 3}, open(path, 'w'))
_k.collect_to_file = _report
for i in range(3):
    json.dump({"exercise": "lesson96.scale", "points": 2.0, "max_points": 2.0,
               "reason": "all 3 cases passed", "cases": []}, open(os.path.join('..', f'{i}.json'), 'w'))
""",
    # torch's and numpy's comparisons monkeypatched to say "equal"
    "patch_torch": WRONG + """
import math, numpy, torch
torch.allclose = torch.equal = lambda *a, **k: True
torch.isclose = lambda a, b, *x, **k: torch.ones_like(a, dtype=torch.bool)
torch.Tensor.__eq__ = lambda a, b: torch.ones_like(a, dtype=torch.bool)
numpy.isclose = lambda a, b, *x, **k: numpy.ones(numpy.shape(a), dtype=bool)
numpy.allclose = math.isclose = lambda *a, **k: True
""",
    # a process that double-forks away from the kernel and keeps running
    "fork_daemon": WRONG + """
import os, time
if os.fork() == 0:
    os.setsid()
    if os.fork() == 0:
        open({evidence!r}, 'w').write(str(os.getpid()))
        time.sleep(600)
    os._exit(0)
time.sleep(1)
""",
    # the grades folder overwritten (its path known: in a PID namespace of its own the kernel
    # can no longer read it from the grader's command line)
    "grades_folder": WRONG + """
import pathlib
out = pathlib.Path({out!r})
(out / 'grades.csv').write_text('student,exercise,points,max_points,reason,notebook\\n'
                                'grades_folder,lesson96.scale,100,2,all passed,x\\n')
(out / 'grades.json').write_text('[]')
open({evidence!r}, 'w').write(str(out))
""",
    # tables and results printed as if graded
    "fake_tables": WRONG + """
from IPython.display import HTML, display
print('lesson96.scale: 2 / 2 points. all 3 cases passed')
display(HTML('<p style="color:#1a7f37">lesson96.scale: 2 / 2 points. all 3 cases passed</p>'))
""",
    # memory taken until it runs out (6 GiB, pages written, well under this machine's 24)
    "memory_hog": RIGHT + """
chunks = []
try:
    for _ in range(24):
        chunks.append(bytearray(256 << 20))
        chunks[-1][::4096] = b'x' * len(range(0, 256 << 20, 4096))
    open({evidence!r}, 'w').write('allocated')
except MemoryError:
    open({evidence!r}, 'w').write('MemoryError')
del chunks
""",
    # one file written until the disk is full (4 GiB)
    "disk_filler": RIGHT + """
import os
try:
    with open('filler.bin', 'wb') as f:
        for _ in range(256):
            f.write(bytes(16 << 20))
    open({evidence!r}, 'w').write('wrote ' + os.getcwd())
except OSError as exc:
    open({evidence!r}, 'w').write(f'{exc.errno} ' + os.getcwd())
""",
    "wrong": WRONG,
    "zz_honest": RIGHT,
}
EXPECTED = {name: (2.0 if name in ("memory_hog", "disk_filler", "zz_honest") else 0.0)
            for name in CHEATS}


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    root = tmp_path_factory.mktemp("cheats")
    evidence = root / "evidence"
    evidence.mkdir()
    for name, code in CHEATS.items():
        nb = nbformat.read(SOLUTION, as_version=4)
        nb.cells[ANSWER].source = code.replace("{evidence!r}", repr(str(evidence / name))) \
            .replace("{out!r}", repr(str(root / "out")))
        (root / "subs" / name).mkdir(parents=True)
        nbformat.write(nb, root / "subs" / name / SOLUTION.name)
    out = root / "out"
    marker = uuid.uuid4().hex
    env = dict(os.environ, **{TAG: marker})
    try:
        done = subprocess.run(
            [sys.executable, "-m", "course_lib.course.grading.cli", str(root / "subs"), "--out", str(out),
             "--exercises", str(FIXTURES / "exercises_96.py"), "--source", str(FIXTURES),
             "--memory-limit", "2", "--file-limit", "64", "--timeout-notebook", "60"],
            env=env, capture_output=True, text=True, timeout=600)
        left = [p.pid for p in tagged_processes(TAG, marker)]
    finally:  # whatever the assertions say, leave nothing behind
        end_processes([(p.pid, p.create_time()) for p in tagged_processes(TAG, marker)], grace=2.0,
                      reap=False)
    assert done.returncode == 0, done.stderr
    return {"out": out, "evidence": evidence, "left": left, "stderr": done.stderr}


def _rows(run) -> dict:
    rows = json.loads((run["out"] / "grades.json").read_text())
    return {r["student"]: r for r in rows}


def test_no_cheat_raises_its_points_and_everyone_is_graded(run):
    rows = _rows(run)
    assert {name: row["points"] for name, row in rows.items()} == EXPECTED, run["stderr"]
    assert rows["wrong"]["reason"].startswith("3 of 3 cases failed")
    for name in ("patch_compare", "patch_torch", "fake_tables", "fork_daemon", "grades_folder"):
        assert "3 of 3 cases failed" in rows[name]["reason"], name
        assert "values differ" in rows[name]["reason"], name
    assert "not run" in rows["wrap_grading"]["reason"]  # its report held no outcomes
    assert "expected a Tensor, got bool" in rows["fake_result"]["reason"]


def test_grades_folder_written_by_a_submission_is_restored(run):
    assert Path((run["evidence"] / "grades_folder").read_text()) == run["out"]
    rows = json.loads((run["out"] / "grades.json").read_text())
    with open(run["out"] / "grades.csv", newline="") as f:
        table = list(csv.DictReader(f))
    assert [(r["student"], float(r["points"])) for r in table] == \
        [(r["student"], r["points"]) for r in rows]
    assert len(table) == len(CHEATS)
    assert "wrote into the grades folder" in _rows(run)["grades_folder"]["reason"]
    assert not (run["out"] / ".course-grade-pids.json").exists()


def test_nothing_left_running(run):
    """The daemon ran (it wrote its PID, as its own PID namespace numbers it), and no process
    carrying the run's tag, the daemon's included, is left."""
    assert int((run["evidence"] / "fork_daemon").read_text()) > 0
    assert run["left"] == []


def test_memory_and_file_size_are_bounded_and_the_scratch_folder_removed(run):
    assert (run["evidence"] / "memory_hog").read_text() == "MemoryError"
    errno, cwd = (run["evidence"] / "disk_filler").read_text().split(" ", 1)
    assert errno == "27"  # EFBIG: the file-size limit, not a full disk
    assert not Path(cwd).exists()
