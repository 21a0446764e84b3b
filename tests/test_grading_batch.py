"""course-grade on the fixture lesson 97: every kind of submission, one kernel each.

One grading run covers them all (a kernel start costs ~1-2 s); each test reads its rows.
"""

import csv
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import nbformat
import psutil
import pytest

from course_lib.course.notebooks import student_notebook
from course_lib.processes import end_processes
from tagged import tagged_processes
from course_lib.course.grading import batch, cli

pytestmark = pytest.mark.slow

FIXTURES = Path(__file__).parent / "fixtures" / "grading"
SOLUTION = FIXTURES / "97_fixture.ipynb"
EXERCISES = FIXTURES / "exercises_97.py"
NOTEBOOK_TIMEOUT = 8.0
DEF_MEAN, CHECK_MEAN, DEF_WORDS, CHECK_WORDS = 2, 3, 4, 5  # cell indices in the fixture

MEAN_INT_DIV = "def mean(xs):\n    return sum(xs) // len(xs)"
MEAN_SPINS = "def mean(xs):\n    while True:\n        pass"
WORDS_SLEEPS = "import time\n\ndef count_words(text):\n    time.sleep(60)\n    return 0"
WORDS_SPLIT_SPACE = "def count_words(text):\n    return len(text.split(' '))"
WORDS_OK = "def count_words(text):\n    return len(text.split())"


HANG = "COURSE_GRADE_TEST_HANG"  # in the hanging child's environment: found by it afterwards


def spawn_and_hang(pids: Path) -> str:
    """Answer-cell code that starts a child (marked in its environment), notes both PIDs as
    the kernel sees them in `pids` (in a PID namespace of its own, the kernel is 1), and hangs."""
    return ("import os, subprocess, time\n"
            f"child = subprocess.Popen(['sleep', '300'], env=dict(os.environ, {HANG}='1'))\n"
            f"open({str(pids)!r}, 'w').write(f'{{os.getpid()}} {{child.pid}}')\n"
            "time.sleep(600)")


def _kernel_seen(kernel_pid: int, kernels: list[int]) -> bool:
    """The PID the submission's kernel saw as its own: 1 in a PID namespace of its own, else
    one of the kernels the grader started."""
    from course_lib.course.grading import containment

    return kernel_pid == 1 if containment.namespace_command() else kernel_pid in kernels


def _make(path: Path, *, release: bool = False, edit: dict | None = None,
          drop: tuple = (), extra: list | None = None, lang: str | None = None) -> Path:
    nb = nbformat.read(SOLUTION, as_version=4)
    if release:
        nb = student_notebook(nb, SOLUTION.name)
    if lang:  # the edition, as the build marks notebooks/es/
        nb.metadata.setdefault("course_lib", {})["lang"] = lang
    for index, source in (edit or {}).items():
        nb.cells[index].source = source
    nb.cells = [c for i, c in enumerate(nb.cells) if i not in drop]
    nb.cells += [nbformat.v4.new_code_cell(s) for s in extra or []]
    path.parent.mkdir(parents=True, exist_ok=True)
    nbformat.write(nb, path)
    return path


@pytest.fixture(scope="module")
def graded(tmp_path_factory):
    """Grade every submission once; returns {student: {exercise: row}} and run details."""
    subs = tmp_path_factory.mktemp("subs")
    lesson = "97_fixture.ipynb"
    _make(subs / "carol" / lesson, release=True)
    _make(subs / "dave" / lesson, release=True, drop=(CHECK_MEAN,),
          edit={DEF_MEAN: MEAN_INT_DIV, DEF_WORDS: WORDS_SPLIT_SPACE,
                CHECK_WORDS: 'print("all passed")'})
    _make(subs / "frank" / lesson, edit={DEF_MEAN: MEAN_SPINS, DEF_WORDS: WORDS_SLEEPS})
    (subs / "gina").mkdir()
    (subs / "gina" / lesson).write_text('{"cells": [')
    _make(subs / "hank" / lesson, edit={DEF_MEAN: "import os\nos._exit(1)"})
    _make(subs / "ivy" / lesson, edit={DEF_WORDS: WORDS_OK + "\n" + spawn_and_hang(
        subs / "ivy" / "pids.txt")})
    _make(subs / "kate.ipynb", release=True, edit={DEF_MEAN: "def mean(xs):\n    "
                                                   "return sum(xs) / len(xs)",
                                                   DEF_WORDS: WORDS_OK})
    _make(subs / "lucia" / lesson, release=True, lang="es", edit={DEF_MEAN: MEAN_INT_DIV})
    out = tmp_path_factory.mktemp("out")
    kernels: list[int] = []
    seen_rows: list[int] = []
    original = batch.KernelSession.start

    def recording_start(self, *args, **kwargs):
        original(self, *args, **kwargs)
        kernels.append(self.pid)

    def progress(line):  # results must be on disk as each submission finishes
        seen_rows.append(len(json.loads((out / "grades.json").read_text())))

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("COURSE_LIB_EXERCISES", str(EXERCISES))
        mp.setattr(batch.KernelSession, "start", recording_start)
        rows = batch.grade_all([subs], out, notebook_timeout=NOTEBOOK_TIMEOUT, source=FIXTURES,
                               progress=progress)
    by_student: dict = {}
    for row in rows:
        by_student.setdefault(row["student"], {})[row["exercise"]] = row
    return {"rows": rows, "by": by_student, "out": out, "kernels": kernels,
            "seen_rows": seen_rows, "subs": subs}


def _points(graded, student):
    return {ex: row["points"] for ex, row in graded["by"][student].items()}


def test_renamed_release_with_correct_code_is_found_by_metadata(graded):
    assert _points(graded, "kate") == {"lesson97.mean": 2.0, "lesson97.count_words": 1.0}


def test_untouched_release_scores_zero_with_not_implemented(graded):
    rows = graded["by"]["carol"]
    assert _points(graded, "carol") == {"lesson97.mean": 0.0, "lesson97.count_words": 0.0}
    assert rows["lesson97.mean"]["reason"] == "not implemented yet: mean raises NotImplementedError"
    assert rows["lesson97.mean"]["max_points"] == 2.0


def test_deleted_or_faked_check_cells_graded_on_real_code(graded):
    # dave's mean check cell is deleted, his count_words check cell prints "all passed"
    rows = graded["by"]["dave"]
    assert _points(graded, "dave") == {"lesson97.mean": 1.33, "lesson97.count_words": 0.33}
    assert "expected 1.75, got 1.0" in rows["lesson97.mean"]["reason"]
    assert "2 of 3 cases failed" in rows["lesson97.count_words"]["reason"]
    assert rows["lesson97.mean"]["reason"].startswith(
        "given code cell(s) 3, 5 edited or deleted in the submission: the original ran")


def test_a_spanish_submission_is_graded_in_spanish(graded):
    rows = graded["by"]["lucia"]
    assert _points(graded, "lucia") == {"lesson97.mean": 1.33, "lesson97.count_words": 0.0}
    assert "fallaron 1 de 3 casos; el primero: " in rows["lesson97.mean"]["reason"]
    assert "se esperaba 1.75, se obtuvo 1.0" in rows["lesson97.mean"]["reason"]
    assert rows["lesson97.count_words"]["reason"] == (
        "todavía sin implementar: count_words lanza NotImplementedError")
    assert graded["by"]["carol"]["lesson97.mean"]["reason"].startswith("not implemented")


def test_hangs_cut_off_and_next_exercise_still_graded(graded):
    rows = graded["by"]["frank"]
    assert _points(graded, "frank") == {"lesson97.mean": 0.0, "lesson97.count_words": 0.0}
    assert rows["lesson97.mean"]["reason"].startswith("timed out: mean([1, 2, 3]) did not "
                                                      "finish within 2s")
    # the pure-Python loop was stopped, so the next exercise ran (a call blocked in C, too)
    assert rows["lesson97.count_words"]["reason"].startswith("timed out: count_words('a b c')")
    assert graded["by"]["kate"]["lesson97.mean"]["points"] == 2.0  # and the next submission


def test_invalid_json_scores_zero_with_reason(graded):
    rows = graded["by"]["gina"]
    assert _points(graded, "gina") == {"lesson97.mean": 0.0, "lesson97.count_words": 0.0}
    assert rows["lesson97.mean"]["reason"].startswith("not a valid notebook:")


def test_kernel_crash_scores_zero_with_reason(graded):
    rows = graded["by"]["hank"]
    assert _points(graded, "hank") == {"lesson97.mean": 0.0, "lesson97.count_words": 0.0}
    assert "kernel died while running code cell 2" in rows["lesson97.mean"]["reason"]


def test_notebook_timeout_then_graded_on_what_it_defined(graded):
    rows = graded["by"]["ivy"]
    assert _points(graded, "ivy") == {"lesson97.mean": 2.0, "lesson97.count_words": 1.0}
    assert rows["lesson97.mean"]["reason"].startswith(
        f"the notebook ran past its {NOTEBOOK_TIMEOUT:g}s limit at code cell 4")


def test_no_process_left_behind(graded):
    kernel_pid, child_pid = map(int, (graded["subs"] / "ivy" / "pids.txt").read_text().split())
    assert _kernel_seen(kernel_pid, graded["kernels"])
    assert len(graded["kernels"]) == 7  # every submission but the invalid file got a kernel
    for pid in graded["kernels"]:
        assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == "zombie", pid
    assert tagged_processes(HANG, "1") == []  # the child it started, wherever its PID came from


def test_results_written_after_each_submission(graded):
    assert graded["seen_rows"] == [2 * k for k in range(1, 9)]
    with open(graded["out"] / "grades.csv", newline="") as f:
        table = list(csv.DictReader(f))
    assert len(table) == 16 and table[0].keys() >= {"student", "exercise", "points",
                                                    "max_points", "reason"}
    assert json.loads((graded["out"] / "grades.json").read_text()) == graded["rows"]


def test_command_line_and_resume(tmp_path):
    sub = _make(tmp_path / "subs" / "97_fixture.ipynb")
    bad = tmp_path / "subs" / "nobody.ipynb"
    bad.write_text("not json")
    command = [sys.executable, "-m", "course_lib.course.grading.cli", "--out", str(tmp_path / "out"),
               "--exercises", str(EXERCISES), "--timeout-exercise", "1", "--source", str(FIXTURES)]
    first = subprocess.run(command + [str(sub)], capture_output=True, text=True, timeout=120)
    assert first.returncode == 0, first.stderr
    again = subprocess.run(command + ["--resume", str(sub), str(bad)], capture_output=True,
                           text=True, timeout=120)  # as after an interrupted run
    assert again.returncode == 0, again.stderr
    assert "97_fixture" in again.stderr and "already graded, skipped" in again.stderr
    with open(tmp_path / "out" / "grades.csv", newline="") as f:
        table = list(csv.DictReader(f))
    assert [(r["student"], r["exercise"], r["points"]) for r in table] == [
        ("97_fixture", "lesson97.mean", "2.0"), ("97_fixture", "lesson97.count_words", "1.0"),
        ("nobody", "", "0.0")]
    assert table[2]["reason"].startswith("not a valid notebook")


def test_command_line_rejects_bad_limits(tmp_path, capsys):
    with pytest.raises(SystemExit) as exc:
        cli.main([str(SOLUTION), "--out", str(tmp_path), "--timeout-notebook", "0"])
    assert exc.value.code == 2
    assert "--timeout-notebook must be positive" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cli.main([str(tmp_path / "missing.ipynb"), "--out", str(tmp_path), "--lesson", "nope"])
    assert "unknown lesson 'nope'" in capsys.readouterr().err


def test_interrupted_grader_keeps_results_and_leaves_no_process(tmp_path):
    first = _make(tmp_path / "subs" / "a_97_fixture.ipynb")
    pids = tmp_path / "subs" / "pids.txt"
    hang = _make(tmp_path / "subs" / "b_97_fixture.ipynb",
                 edit={DEF_WORDS: WORDS_OK + "\n" + spawn_and_hang(pids)})
    grader_run = subprocess.Popen(
        [sys.executable, "-m", "course_lib.course.grading.cli", str(first), str(hang), "--out",
         str(tmp_path / "out"), "--exercises", str(EXERCISES), "--source", str(FIXTURES)],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while not pids.exists() and time.monotonic() < deadline:
            time.sleep(0.2)
        assert pids.exists(), "the second submission never started"
        time.sleep(0.5)
        grader_run.terminate()  # SIGTERM while the second notebook hangs
        assert grader_run.wait(timeout=60) == 128 + signal.SIGTERM
    finally:
        if grader_run.poll() is None:
            grader_run.kill()
    rows = json.loads((tmp_path / "out" / "grades.json").read_text())
    assert [(r["student"], r["points"]) for r in rows] == [("a_97_fixture", 2.0),
                                                            ("a_97_fixture", 1.0)]
    assert len(pids.read_text().split()) == 2  # the kernel and its child had started
    assert tagged_processes(HANG, "1") == []


STARTS_A_KERNEL = """
import os, sys, tempfile
from pathlib import Path
import nbformat
from course_lib.course.grading.kernel_session import KernelSession, kernel_zygote
work = Path(tempfile.mkdtemp(dir=sys.argv[1]))
(work / "cwd").mkdir()
session = KernelSession(nbformat.v4.new_notebook(), work / "cwd")
session.start(dict(os.environ), work, kernel_zygote())
print(session.pid, session.client.km.connection_file, flush=True)
sys.stdin.read()  # until the test kills this process
"""


def test_a_kernel_ends_with_its_grader_killed_outright(short_tmp):
    """No close(), no atexit: the kernel's keeper sees its grader gone and the namespace ends
    (a kernel started by `unshare` alone outlived it: its parent poller sees no parent there)."""
    tag = "COURSE_GRADE_ORPHAN_TEST"
    scratch = short_tmp  # the kernel's Unix sockets are made in it
    grader = subprocess.Popen([sys.executable, "-c", STARTS_A_KERNEL, str(scratch)],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                              env={**os.environ, tag: "1"})
    try:
        pid, connection_file = grader.stdout.readline().split()
        kernel = int(pid)
        assert psutil.pid_exists(kernel)
        # The channels' key is in the submission's folder, which a resumed run removes.
        assert Path(connection_file).parent.parent == scratch, connection_file
        grader.kill()
        grader.wait(10)
        left = psutil.wait_procs(tagged_processes(tag, "1"), timeout=15)[1]
        assert left == [], [p.cmdline() for p in left]
    finally:
        end_processes([(p.pid, p.create_time()) for p in tagged_processes(tag, "1")], grace=1.0,
                      reap=False)
