"""The README's commands: `python3 course.py lab [--lang es]` serves the student notebooks."""

from __future__ import annotations

import json
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import psutil
import pytest

from course_lib.backend import free_port

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]


def _get(port: int, token: str, path: str) -> dict:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}?token={token}", timeout=5) as r:
        return json.load(r)


@pytest.mark.parametrize("lang, folder, locale", [("en", "notebooks", "en"),
                                                  ("es", "notebooks/es", "es_ES")])
def test_lab_command_serves_every_student_notebook(lang, folder, locale):
    """`course.py lab --lang LANG` serves that edition's notebooks with JupyterLab's own language
    pack selected (Spanish: jupyterlab-language-pack-es-ES) and its news pop-up off."""
    port, token = free_port(), "course-test"
    proc = subprocess.Popen([sys.executable, "course.py", "lab", "--lang", lang, "--no-browser",
                             f"--port={port}", f"--IdentityProvider.token={token}"], cwd=ROOT,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        listing, deadline = None, time.monotonic() + 90
        while listing is None and time.monotonic() < deadline:
            assert proc.poll() is None, "course.py lab exited early"
            try:
                listing = _get(port, token, "/api/contents")
            except OSError:
                time.sleep(0.5)
        assert listing is not None, "JupyterLab did not answer within 90 s"
        served = sorted(item["name"] for item in listing["content"] if item["type"] == "notebook")
        assert served == sorted(p.name for p in (ROOT / folder).glob("*.ipynb"))
        assert "00_cluster.ipynb" in served
        settings = _get(port, token, "/lab/api/settings/@jupyterlab/translation-extension:plugin")
        assert settings["settings"]["locale"] == locale
        news = _get(port, token, "/lab/api/settings/@jupyterlab/apputils-extension:notification")
        assert news["settings"]["fetchNews"] == "false"
        if lang == "es":  # the pack is installed and JupyterLab serves its strings
            packs = _get(port, token, "/lab/api/translations")["data"]
            assert "es_ES" in packs
            strings = _get(port, token, "/lab/api/translations/es_ES")["data"]
            assert strings["jupyterlab"]["Run"] == ["Ejecutar"]
    finally:
        me = psutil.Process(proc.pid)
        family = [me] + me.children(recursive=True)
        for p in reversed(family):  # the server first, then course.py; by PID
            try:
                p.terminate()
            except psutil.NoSuchProcess:
                pass
        psutil.wait_procs(family, 15)
        proc.wait(15)
