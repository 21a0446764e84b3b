"""JupyterLab in a real browser: lessons run through the UI, and what a learner sees.

`python3 course.py lab` is started as the README says, headless Chromium (Debian's `chromium`
package, driven by Playwright's Python API pointed at that executable) opens notebooks, runs
them with Run > Run All Cells, and the test reads the page. Screenshots land in
test-output/browser/. Without Chromium or Playwright the tests are skipped, saying what to
install; `.ci/run` installs Chromium, the dev extra Playwright.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import time
import urllib.request
from pathlib import Path

import pytest
from lab_server import ROOT, running_lab

pytestmark = pytest.mark.slow

ARTIFACTS = ROOT / "test-output" / "browser"
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
# As root in a container, and on a machine whose network is closed: no sandbox, no GPU, no
# background connections (each refused one would be retried at every start).
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update",
                 "--disable-sync", "--disable-dev-shm-usage"]
TOKEN = "course-browser-test"


def _needs_a_browser():
    if CHROMIUM is None:
        pytest.skip("needs a Chromium: apt-get install chromium (Debian's package; .ci/run "
                    "installs it)")
    return pytest.importorskip("playwright.sync_api",
                               reason="needs Playwright: pip install -e '.[dev]'")


@pytest.fixture(scope="module")
def browser():
    """One headless Chromium for the module's tests."""
    sync_api = _needs_a_browser()
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    with sync_api.sync_playwright() as pw:
        chromium = pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        try:
            yield chromium
        finally:
            chromium.close()


@contextlib.contextmanager
def _lab(root: Path, *args: str):
    """`course.py lab ARGS` serving `root`; yields its base URL."""
    env = dict(os.environ, COURSE_LIB_HOME=str(root / "home"))  # the learner's own package
    with running_lab([*args, f"--ServerApp.root_dir={root}",
                      f"--LabApp.workspaces_dir={root.parent / (root.name + '-workspaces')}"],
                     TOKEN, env) as base:  # a fresh layout
        yield base


@pytest.fixture(scope="module")
def lab(browser, tmp_path_factory):
    """The English lab on lesson 00's student release and the solutions of lessons 00, 03."""
    root = tmp_path_factory.mktemp("lab")
    shutil.copy(ROOT / "notebooks" / "00_cluster.ipynb", root)
    (root / "solution").mkdir()
    for name in ("00_cluster.ipynb", "03_data_sharding.ipynb"):
        shutil.copy(ROOT / "solutions" / name, root / "solution")
    with _lab(root) as base:
        yield browser, base


RUN_MENU = re.compile(r"^(Run|Ejecutar)$")  # the language pack translates what it knows
RUN_ALL = re.compile(r"^(Run All Cells|Ejecutar todas las celdas)$")


def run_all(lab, path: str, shot: str, timeout: float) -> str:
    """Open `path` in JupyterLab, run every cell through the Run menu, wait until the last
    cell has run; return the notebook's text. Screenshots: when done, and of the check's table."""
    browser, base = lab
    page = browser.new_page(viewport={"width": 1400, "height": 1000})
    try:
        page.goto(f"{base}/lab/tree/{path}?reset&token={TOKEN}")  # only this notebook open
        page.wait_for_selector(".jp-NotebookPanel:not(.lm-mod-hidden) .jp-Cell",
                               state="attached", timeout=90_000)
        _wait_for_an_idle_kernel(base)
        menus = page.locator("#jp-MainMenu .lm-MenuBar-itemLabel")
        menus.filter(has_text=RUN_MENU).click()
        page.locator(".lm-Menu-itemLabel").filter(has_text=RUN_ALL).click()
        prompts = page.locator(".jp-NotebookPanel:not(.lm-mod-hidden) .jp-CodeCell "
                               ".jp-InputPrompt")
        deadline, started = time.monotonic() + timeout, False
        while True:  # queued cells show "[*]:" (in the DOM even when scrolled out of view)
            shown = [p.strip() for p in prompts.all_text_contents()]
            started = started or "[*]:" in shown
            if started and "[*]:" not in shown:
                break
            if time.monotonic() > deadline:
                page.screenshot(path=str(ARTIFACTS / f"{shot}-timeout.png"))
                pytest.fail(f"{path}: cells still running after {timeout}s: {shown}")
            time.sleep(0.5)
        assert all(p[1:-2].isdigit() for p in shown), shown  # every code cell ran
        page.screenshot(path=str(ARTIFACTS / f"{shot}.png"))
        text = page.locator(".jp-NotebookPanel:not(.lm-mod-hidden) .jp-Notebook").text_content()
        news = page.locator(".jp-Notification-Toast").all_text_contents()
        assert not any("news" in n.lower() for n in news), news  # its pop-up stays off
        table = page.locator(".jp-OutputArea-output", has_text="lesson00.shard_sum:").last
        if not table.count():
            table = page.locator(".jp-OutputArea-output", has_text=" / ").last
        table.evaluate("e => e.scrollIntoView({block: 'center'})")  # the check's feedback
        page.wait_for_timeout(500)  # cells scrolled in are painted on the next frames
        page.screenshot(path=str(ARTIFACTS / f"{shot}-check.png"))
        return text
    finally:
        page.close()
        _shut_down_kernels(base)


def _wait_for_an_idle_kernel(base: str, timeout: float = 90) -> None:
    """The notebook's kernel has started (asked of the server: the status bar's words change
    with the language)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            with urllib.request.urlopen(f"{base}/api/kernels?token={TOKEN}", timeout=10) as r:
                if any(k["execution_state"] == "idle" for k in json.load(r)):
                    return
        except OSError:  # the server answered 500 once while the kernel was starting
            pass
        assert time.monotonic() < deadline, f"no kernel became idle within {timeout}s"
        time.sleep(0.5)


def _shut_down_kernels(base: str) -> None:
    """What a learner does with Kernel > Shut Down All Kernels, through the server's API."""
    with urllib.request.urlopen(f"{base}/api/sessions?token={TOKEN}", timeout=10) as r:
        sessions = json.load(r)
    for session in sessions:
        urllib.request.urlopen(urllib.request.Request(
            f"{base}/api/sessions/{session['id']}?token={TOKEN}", method="DELETE"),
            timeout=30).close()


RANKS_IN_ORDER = "rank 0 of 4\nrank 1 of 4\nrank 2 of 4\nrank 3 of 4"
HANG_CUT = "rank 2: still running after 2s (a hang or deadlock?)"


def test_the_student_release_of_lesson_00_in_the_browser(lab):
    text = run_all(lab, "00_cluster.ipynb", "00_cluster-student", timeout=240)
    assert RANKS_IN_ORDER in text
    assert HANG_CUT in text and "the stuck ranks were interrupted" in text
    assert "lesson00.shard_sum: 0 / 2 points. not implemented yet: shard_sum raises " \
           "NotImplementedError" in text
    assert "Traceback" not in text  # feedback, not a stack


def test_the_solution_of_lesson_00_in_the_browser(lab):
    text = run_all(lab, "solution/00_cluster.ipynb", "00_cluster-solution", timeout=240)
    assert RANKS_IN_ORDER in text and HANG_CUT in text
    assert "lesson00.shard_sum: 2 / 2 points. all 5 cases passed" in text
    assert "2 ranks, n=13 (remainder)" in text  # the check's per-rank table
    assert "Traceback" not in text


def test_lesson_03_runs_to_completion_on_four_engines_in_the_browser(lab):
    text = run_all(lab, "solution/03_data_sharding.ipynb", "03_data_sharding-solution",
                   timeout=150)
    assert "lesson03.shard_indices:" in text and "all " in text and "cases passed" in text
    assert "Traceback" not in text


SPANISH_HEADINGS = ("Conoce tu clúster", "Ejercicio: tu propio fragmento")


def _text_once_it_shows(page, wanted: tuple[str, ...], timeout: float = 30) -> str:
    """The open notebook's text once every string of `wanted` is in it, or at `timeout`:
    JupyterLab renders the cells below the first screen in idle time after the page loads."""
    notebook = page.locator(".jp-NotebookPanel:not(.lm-mod-hidden) .jp-Notebook")
    deadline = time.monotonic() + timeout
    while True:
        text = notebook.text_content()
        if all(w in text for w in wanted) or time.monotonic() > deadline:
            return text
        time.sleep(0.5)


def test_the_spanish_edition_in_the_browser(browser, tmp_path):
    """`course.py lab --lang es`: JupyterLab's own menus and the lesson in Spanish. (The check's
    and the cluster's messages in Spanish are tests/test_i18n.py's; running the lesson again
    here would repeat the English run above for a minute of the suite's budget.)"""
    shutil.copy(ROOT / "notebooks" / "es" / "00_cluster.ipynb", tmp_path)
    with _lab(tmp_path, "--lang", "es") as base:
        page = browser.new_page(viewport={"width": 1400, "height": 1000})
        try:
            page.goto(f"{base}/lab/tree/00_cluster.ipynb?reset&token={TOKEN}")
            page.wait_for_selector(".jp-NotebookPanel:not(.lm-mod-hidden) .jp-Cell",
                                   state="attached", timeout=90_000)
            _wait_for_an_idle_kernel(base)
            page.screenshot(path=str(ARTIFACTS / "00_cluster-es.png"))
            menus = page.locator("#jp-MainMenu .lm-MenuBar-itemLabel").all_text_contents()
            text = _text_once_it_shows(page, SPANISH_HEADINGS)
        finally:
            page.close()
            _shut_down_kernels(base)
    assert menus[:3] == ["Archivo", "Editar", "Ver"] and "Ayuda" in menus
    assert all(heading in text for heading in SPANISH_HEADINGS), text
