"""The README's commands: `python3 course.py lab` serves the student notebooks."""

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


def test_lab_command_serves_every_student_notebook():
    port, token = free_port(), "course-test"
    proc = subprocess.Popen([sys.executable, "course.py", "lab", "--no-browser", f"--port={port}",
                             f"--IdentityProvider.token={token}"], cwd=ROOT,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        listing, deadline = None, time.monotonic() + 90
        while listing is None and time.monotonic() < deadline:
            assert proc.poll() is None, "course.py lab exited early"
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/api/contents?token={token}",
                                            timeout=5) as r:
                    listing = json.load(r)
            except OSError:
                time.sleep(0.5)
        assert listing is not None, "JupyterLab did not answer within 90 s"
        served = sorted(item["name"] for item in listing["content"])
        assert served == sorted(p.name for p in (ROOT / "notebooks").glob("*.ipynb"))
        assert "00_cluster.ipynb" in served
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
