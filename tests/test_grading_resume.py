"""course-grade killed outright (SIGKILL) at several moments, then resumed: every student is
graded exactly once, the results files are whole after every kill, and nothing the killed runs
started is left running."""

import csv
import json
import os
import random
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import nbformat
import psutil
import pytest

from course_lib.processes import end_processes
from tagged import tagged_processes

pytestmark = pytest.mark.slow

FIXTURES = Path(__file__).parent / "fixtures" / "grading"
SOLUTION = FIXTURES / "97_fixture.ipynb"
DEF_WORDS = 4
TAG = "COURSE_GRADE_RESUME_TEST"
STUDENTS = [f"s{i}" for i in range(8)]
# s2's answer cell leaves a child running for a while: a kill then orphans it
SPAWNS = "import subprocess, time\nsubprocess.Popen(['sleep', '120'])\ntime.sleep(2)\n"


def _whole(out: Path) -> list[dict]:
    """The rows on disk; fails if either file is half-written or they disagree in kind."""
    if not (out / "grades.json").exists():
        return []
    rows = json.loads((out / "grades.json").read_text())  # raises on a half-written file
    with open(out / "grades.csv", newline="") as f:
        table = list(csv.DictReader(f))
    assert all(len(r) == 6 and None not in r.values() for r in table)
    assert len(rows) % 2 == 0 and len(table) % 2 == 0  # two exercises per student, always
    return rows


def test_killed_at_random_moments_then_resumed_grades_everyone_once(tmp_path, short_tmp):
    subs = tmp_path / "subs"
    subs.mkdir()
    for name in STUDENTS:
        nb = nbformat.read(SOLUTION, as_version=4)
        if name == "s2":
            nb.cells[DEF_WORDS].source = SPAWNS + nb.cells[DEF_WORDS].source
        nbformat.write(nb, subs / f"{name}_97_fixture.ipynb")
    out = tmp_path / "out"
    command = [sys.executable, "-m", "course_lib.course.grading.cli", str(subs), "--out", str(out),
               "--exercises", str(FIXTURES / "exercises_97.py"), "--source", str(FIXTURES),
               "--resume"]
    scratch = short_tmp  # the runs' temporary folder, where a killed run's work is left
    marker = uuid.uuid4().hex
    env = dict(os.environ, **{TAG: marker, "TMPDIR": str(scratch)})
    # Each run is killed at a random moment once the students graded so far (by every run) reach
    # a count: while it starts, runs a kernel or writes results; on a slow machine as on a
    # fast one the kills land at different submissions (a fixed clock once let all four land
    # before the first result).
    rng, seen = random.Random(17), []
    try:
        for graded_before in (0, 1, 3):
            run = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL,
                                   stderr=subprocess.DEVNULL)
            deadline = time.monotonic() + 120
            while (len(_whole(out)) < 2 * graded_before and run.poll() is None
                   and time.monotonic() < deadline):
                time.sleep(0.05)
            time.sleep(rng.uniform(0.5, 3.0))
            run.send_signal(signal.SIGKILL)
            run.wait(timeout=30)
            seen.append(len(_whole(out)))
        final = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
        assert final.returncode == 0, final.stderr
        # a killed run's kernel notices its parent is gone within a second when idle; on a
        # loaded machine, or killed mid-start (its parent watcher starts only after its
        # imports), it took over 15 s in a full clean-clone run
        psutil.wait_procs(tagged_processes(TAG, marker), timeout=60)
        left = [p.pid for p in tagged_processes(TAG, marker)]  # zombies: their parent reaps them
    finally:
        end_processes([(p.pid, p.create_time()) for p in tagged_processes(TAG, marker)], grace=2.0,
                      reap=False)
    rows = _whole(out)
    graded = [r["student"] for r in rows if r["exercise"] == "lesson97.mean"]
    assert sorted(graded) == [f"{s}_97_fixture" for s in STUDENTS]  # each exactly once
    assert all(r["points"] == r["max_points"] for r in rows), [r["reason"] for r in rows]
    assert seen == sorted(seen) and seen[-1] < len(rows), seen  # every kill interrupted it
    assert len(set(seen)) > 1, seen  # and at different submissions
    assert left == []
    assert not (out / ".course-grade-pids.json").exists()
    assert list(scratch.glob("course-grade-*")) == []  # the killed runs' work folders too
