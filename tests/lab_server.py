"""`python3 course.py lab` for a test: on a port the OS picks, ended by PID afterwards.

A port chosen in advance (bind to 0, close, pass it on) can be taken in the seconds JupyterLab
needs to start, by any process of the suite that listens (the other pytest worker's clusters
and kernels): the test then talks to a stranger. With `--port=0` the server binds first and
says its port in its runtime file, which lives in a folder of the test's own.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Iterator

import psutil

ROOT = Path(__file__).resolve().parents[1]


def end_family(proc: subprocess.Popen) -> None:
    """End a process and everything it started (a lab's kernels and engines), by PID."""
    try:
        family = [psutil.Process(proc.pid)]
        family += family[0].children(recursive=True)
    except psutil.NoSuchProcess:
        return
    for p in reversed(family):  # the server first, then course.py
        try:
            p.terminate()
        except psutil.NoSuchProcess:
            pass
    for p in psutil.wait_procs(family, 20)[1]:
        p.kill()
    proc.wait(10)


def _port(runtime: Path) -> int | None:
    """The port in the server's runtime file, once it has written it."""
    for info in runtime.glob("jpserver-*.json"):
        try:
            return int(json.loads(info.read_text())["port"])
        except (OSError, ValueError, KeyError):
            return None  # being written
    return None


@contextlib.contextmanager
def running_lab(args: list[str], token: str, env: dict | None = None,
                timeout: float = 120.0) -> Iterator[str]:
    """`course.py lab ARGS` until the block ends; yields its base URL once it answers."""
    with tempfile.TemporaryDirectory(prefix="lab-runtime-") as runtime:
        env = dict(env or os.environ, JUPYTER_RUNTIME_DIR=runtime)
        proc = subprocess.Popen(
            [sys.executable, "course.py", "lab", *args, "--no-browser", "--port=0",
             f"--IdentityProvider.token={token}"], cwd=ROOT, env=env,
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            deadline = time.monotonic() + timeout
            while True:
                assert proc.poll() is None, "course.py lab exited early"
                port = _port(Path(runtime))
                if port is not None:
                    base = f"http://127.0.0.1:{port}"
                    try:
                        urllib.request.urlopen(f"{base}/api/status?token={token}",
                                               timeout=5).close()
                        break
                    except OSError:
                        pass
                assert time.monotonic() < deadline, f"JupyterLab did not answer in {timeout:g} s"
                time.sleep(0.5)
            yield base
        finally:
            end_family(proc)
