"""The README's commands: `python3 course.py lab [--lang es]` serves the student notebooks."""

from __future__ import annotations

import contextlib
import json
import urllib.request

import pytest
from lab_server import ROOT, running_lab

pytestmark = pytest.mark.slow
TOKEN = "course-test"


@pytest.fixture(scope="module")
def lab():
    """`lab(flags)`: the address of `course.py lab FLAGS`, each started once for the module."""
    with contextlib.ExitStack() as stack:
        started: dict[tuple, str] = {}

        def address(flags: list[str]) -> str:
            if tuple(flags) not in started:
                started[tuple(flags)] = stack.enter_context(running_lab(flags, TOKEN))
            return started[tuple(flags)]

        yield address


@pytest.mark.parametrize("flags, folder, locale", [([], "notebooks", "en"),
                                                   (["--lang", "es"], "notebooks/es", "es_ES")],
                         ids=["en", "es"])
def test_lab_command_serves_every_student_notebook(lab, flags, folder, locale):
    """`course.py lab [--lang es]` serves that edition's notebooks with JupyterLab's own language
    pack selected (Spanish: jupyterlab-language-pack-es-ES) and its news pop-up off."""
    base = lab(flags)

    def get(path: str) -> dict:
        with urllib.request.urlopen(f"{base}{path}?token={TOKEN}", timeout=5) as r:
            return json.load(r)

    listing = get("/api/contents")
    served = sorted(item["name"] for item in listing["content"] if item["type"] == "notebook")
    assert served == sorted(p.name for p in (ROOT / folder).glob("*.ipynb"))
    assert "00_cluster.ipynb" in served
    settings = get("/lab/api/settings/@jupyterlab/translation-extension:plugin")
    assert settings["settings"]["locale"] == locale
    news = get("/lab/api/settings/@jupyterlab/apputils-extension:notification")
    assert news["settings"]["fetchNews"] == "false"
    if flags:  # Spanish: the pack is installed and JupyterLab serves its strings
        packs = get("/lab/api/translations")["data"]
        assert "es_ES" in packs
        strings = get("/lab/api/translations/es_ES")["data"]
        assert strings["jupyterlab"]["Run"] == ["Ejecutar"]


@pytest.mark.parametrize("flags, shown", [([], False), (["--instructor"], True)],
                         ids=["learner", "instructor"])
def test_the_learner_s_lab_has_no_instructor_interface(lab, flags, shown):
    """`course.py lab` hides nbgrader's Create Assignment, Formgrader and Validate (its lab
    extension disabled, its server handlers not loaded); `course.py lab --instructor` has them."""
    import urllib.error

    base = lab(flags)
    with urllib.request.urlopen(f"{base}/lab?token={TOKEN}", timeout=10) as r:
        page = r.read().decode()
    config = json.loads(page.split('id="jupyter-config-data" type="application/json">')[1]
                        .split("</script>")[0])
    disabled = config.get("disabledExtensions", [])
    assert ("@jupyter/nbgrader" in disabled) is not shown, disabled
    try:
        with urllib.request.urlopen(f"{base}/formgrader?token={TOKEN}", timeout=10) as r:
            status = r.status
    except urllib.error.HTTPError as exc:
        status = exc.code
    assert (status == 200) is shown, status


def test_a_sigterm_to_course_py_ends_the_command_it_runs(tmp_path):
    """`course.py lab` ended by PID (a SIGTERM, as a process manager or a test sends) passes
    the signal on: the program it started does not outlive it."""
    import os
    import signal
    import subprocess
    import sys
    import time

    import psutil

    marker = tmp_path / "started"
    code = ("import sys; sys.path.insert(0, sys.argv[1]); import course; "
            "course.run(sys.executable, '-c', 'import pathlib, sys, time; '"
            "f'pathlib.Path({sys.argv[2]!r}).touch(); time.sleep(60)')")
    proc = subprocess.Popen([sys.executable, "-c", code, str(ROOT), str(marker)])
    children: list = []
    try:
        deadline = time.monotonic() + 30
        while not marker.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        children = psutil.Process(proc.pid).children()
        assert marker.exists() and children, "the command never started"
        os.kill(proc.pid, signal.SIGTERM)
        proc.wait(10)
        gone, alive = psutil.wait_procs(children, timeout=10)
        assert not alive, f"still running after course.py ended: {[p.pid for p in alive]}"
    finally:  # whatever the assertions say, nothing of this test is left running
        proc.kill()
        for child in children:
            try:
                child.kill()
            except psutil.NoSuchProcess:
                pass


def test_course_py_hands_pip_s_package_sources_to_uv(monkeypatch):
    """The install goes through uv, which reads no pip setting: the indexes and wheel folders
    pip is given (the README's CPU index among them) reach uv as flags, each once."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("course_entry", ROOT / "course.py")
    course = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(course)
    monkeypatch.setenv("PIP_FIND_LINKS", "/somewhere/wheels")
    monkeypatch.setenv("PIP_EXTRA_INDEX_URL",
                       "https://download.pytorch.org/whl/cpu https://mirror.example/simple")
    flags = course.pip_sources()
    pairs = list(zip(flags[::2], flags[1::2]))
    assert pairs[0] == ("--index-strategy", "unsafe-best-match")  # pip's: any source's release
    assert {("--find-links", "/somewhere/wheels"),
            ("--extra-index-url", "https://download.pytorch.org/whl/cpu"),
            ("--extra-index-url", "https://mirror.example/simple")} <= set(pairs)
    assert len(pairs) == len(set(pairs)) == len(flags) // 2
