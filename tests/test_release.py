"""The student bundle (`python3 course.py release DIR`): notebooks and machinery without one
line of any solution region, and, played by a learner, lessons that run on the learner's own
components (their sampler and DDP in lesson 05) with gloo standing in for lesson 01's wire."""

from __future__ import annotations

import contextlib
import io
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import nbformat
import pytest

from course_lib.course import build, exports, markers, release
from course_lib.course.components import COMPONENTS
from course_lib.course.grading import judge, plain
from course_lib.course.catalogue import exercises_for, lessons
from course_lib.course.compare import mismatch
from learners import MARK_DDP, MARK_ENV, MARK_SAMPLER, ROOT, fill

SCORE = re.compile(r"^(lesson\d\d\.\w+): (\d+) / (\d+) points", re.M)


@pytest.fixture(scope="module")
def made(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str, int]:
    """A bundle made by the command, with what it printed and its exit status."""
    dest = tmp_path_factory.mktemp("release") / "course"
    with contextlib.redirect_stdout(io.StringIO()) as out:
        code = release.main([str(dest)])
    return dest, out.getvalue(), code


@pytest.fixture(scope="module")
def bundle(made: tuple[Path, str, int]) -> Path:
    return made[0]


def bundle_files(bundle: Path) -> set[str]:
    return {p.relative_to(bundle).as_posix() for p in bundle.rglob("*") if p.is_file()}


def test_the_bundle_holds_the_student_notebooks_and_machinery_and_no_solution(bundle: Path):
    files = bundle_files(bundle)
    assert not [f for f in files if f.startswith(("solutions/", "tests/"))]
    student = {p.relative_to(ROOT).as_posix() for p in (ROOT / "notebooks").rglob("*.ipynb")}
    assert student and student <= files
    assert any(f.startswith("notebooks/es/") for f in student)  # both editions
    for f in student:  # the student notebooks as the build writes them, not the solutions
        assert (bundle / f).read_bytes() == (ROOT / f).read_bytes()
    machinery = ("course_lib/cluster/client.py", "course_lib/course/grading/learner.py",
                 "course_lib/course/bench/__init__.py", "course_lib/dist/__init__.py",
                 "course_lib/locale/es/course_lib.po", "course_lib/i18n.py",
                 "README.md", "README.es.md", "docs/glossary.es.md", "pyproject.toml",
                 "constraints.txt", "course.py")
    assert [m for m in machinery if m not in files] == []
    for module in COMPONENTS:
        text = (bundle / exports.module_path(module)).read_text()
        assert text.startswith(exports.STUB_HEADER.split("{")[0]), module
        assert "NotImplementedError" in text and markers.BEGIN_SOLUTION not in text, module
        assert "notebooks/es/" not in text, module  # built from the English edition


def test_no_line_of_any_solution_region_ships_beyond_the_listed_gaps(bundle: Path):
    windows = release.solution_windows(ROOT)
    regions = set(windows.values())
    assert len(regions) >= 50  # every lesson's exercises, not a handful
    assert set(release.leaks(bundle, windows)) == set(release.KNOWN_GAPS)
    # The detector finds what it looks for: the repository's package carries every exported
    # answer, re-indented and with comments, and the solutions carry all of them.
    assert set(release.leaks(ROOT / "solutions", windows)) == regions
    exported = set(release.leaks(ROOT / "course_lib", windows))
    assert {f"{lesson}.ipynb" for lesson in COMPONENTS.values()} <= {
        r.split(",")[0] for r in exported}


def test_the_release_command_refuses_a_used_folder_and_one_inside_the_repository(
        made: tuple[Path, str, int], capsys: pytest.CaptureFixture):
    bundle, out, code = made
    assert code == 0
    assert f"{len(COMPONENTS)} components without their answers" in out
    assert out.count("known gap:") == len(release.KNOWN_GAPS)
    assert release.main([str(bundle)]) == 2
    assert "is not empty" in capsys.readouterr().err
    assert release.main([str(ROOT / "build" / "course")]) == 2
    assert "inside the repository" in capsys.readouterr().err


def test_the_bundle_holds_every_expected_value_as_the_instructors_reference_computes_it(
        bundle: Path):
    table = plain.loads((bundle / "course_lib" / "course" / "grading" / "expected.json").read_text())
    every = [ex for lesson in lessons() for ex in exercises_for(lesson)]
    assert sorted(table) == sorted(ex.name for ex in every)
    for ex in every:  # its first and last case recomputed (every case costs 20 s more)
        saved, world = table[ex.name], ex.world_size if ex.distributed else None
        assert saved["world"] == world and len(saved["cases"]) == len(ex.cases), ex.name
        ends = sorted({0, len(ex.cases) - 1})
        wants = judge.expected_values(ex, [ex.cases[i] for i in ends])["cases"]
        for i, want in zip(ends, wants):
            assert mismatch(saved["cases"][i], want, 0.0, 0.0) is None, (ex.name, i)


def test_every_module_of_the_bundle_imports_and_its_course_py_says_what_it_is(bundle: Path,
                                                                            tmp_path: Path):
    modules = [f"course_lib.{m}" for m in COMPONENTS] + [
        "course_lib.cluster", "course_lib.course.grading", "course_lib.course.bench", "course_lib.gpt"]
    code = ("import importlib, sys\n"
            "for m in sys.argv[1:]:\n"
            "    print(importlib.import_module(m).__file__)\n")
    env = dict(os.environ, PYTHONPATH=str(bundle), COURSE_LIB_HOME=str(tmp_path / "home"))
    out = subprocess.run([sys.executable, "-c", code, *modules], env=env, cwd=tmp_path,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert all(Path(f).is_relative_to(bundle) for f in out.stdout.split())
    tests = subprocess.run([sys.executable, str(bundle / "course.py"), "test"],
                           capture_output=True, text=True, timeout=60)
    assert tests.returncode == 2 and "this is the student release" in tests.stdout


def run_notebook(path: Path) -> str:
    """Execute a learner's notebook in a fresh kernel in its folder; its text outputs."""
    from nbclient import NotebookClient

    nb = nbformat.read(path, as_version=4)
    NotebookClient(nb, kernel_name="python3", timeout=600,
                   resources={"metadata": {"path": str(path.parent)}}).execute()
    texts = []
    for cell in nb.cells:
        for out in cell.get("outputs", []):
            texts.append(out.get("text") or out.get("data", {}).get("text/plain", ""))
    return "\n".join(texts)


def scores(text: str) -> dict[str, tuple[int, int]]:
    return {name: (int(got), int(of)) for name, got, of in SCORE.findall(text)}


@pytest.mark.cluster
@pytest.mark.slow
def test_a_learner_runs_the_bundles_lesson00_and_then_lesson05_on_their_own_components(
        bundle: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    learner, marks = tmp_path / "notebooks", tmp_path / "marks"
    shutil.copytree(bundle / "notebooks", learner)
    marks.mkdir()
    for name, value in {"PYTHONPATH": str(bundle), "COURSE_LIB_HOME": str(tmp_path / "home"),
                        "IPP_NONINTERACTIVE": "1", MARK_ENV: str(marks)}.items():
        monkeypatch.setenv(name, value)  # the kernels and their engines inherit them

    # Lesson 00, done: every check passes; gloo runs until the learner's lesson 01 does.
    out = run_notebook(fill(learner / "00_cluster.ipynb"))
    assert "process group: gloo until your lesson 01 passes its checks" in out
    got = scores(out)
    assert got and all(g == of for g, of in got.values()), got

    # Lessons 03 and 04 done and exported (the sampler and DDP carry a marker), then lesson 05.
    done = (("03_data_sharding", {"DistributedSampler": MARK_SAMPLER}),
            ("04a_data_parallel", {}),
            ("04b_ddp_overlap", {"DistributedDataParallel": MARK_DDP}))
    for lesson, plant in done:
        fill(learner / f"{lesson}.ipynb", plant)
    exported = subprocess.run(  # `course.py export 03`, then 04a and 04b, in one process
        [sys.executable, "-c", "import sys; from course_lib.course.overlay import main; "
         "sys.exit(max(main([lesson]) for lesson in sys.argv[1:]))",
         *(lesson.split("_")[0] for lesson, _ in done)],
        cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert exported.returncode == 0, exported.stderr
    out = run_notebook(fill(learner / "05_grad_accumulation.ipynb"))
    assert "course_lib.ddp: yours, from lesson 04b" in out
    assert "course_lib.data: yours, from lesson 03" in out
    assert "max |w - w_one| < 1e-9: True" in out  # the learner's sampler and DDP = 1 process
    # Every check passes, saved_activation_bytes's from the release's table of expected values
    # (its reference is lesson 05's own answer, which the bundle does not ship).
    got = scores(out)
    assert set(got) == {"lesson05.no_sync", "lesson05.accumulation_step",
                        "lesson05.saved_activation_bytes"}
    assert all(g == of > 0 for g, of in got.values()), (got, out[-6000:])  # the check tables
    ran = {f.name.split("-")[0] for f in marks.iterdir()}
    assert ran == {"ddp", "sampler"}
    assert len(list(marks.glob("ddp-*"))) >= 4  # on the engines of both clusters
