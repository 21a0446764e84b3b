"""The components alone: `pip install` of the package, without the course's extras, into a
fresh virtual environment, trains DDP on two spawned ranks (gloo and our own process group)
equal to one process, and never imports the course's machinery."""

from __future__ import annotations

import importlib.metadata
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = Path(__file__).parent / "fixtures" / "bare" / "ddp_two_ranks.py"
COURSE_ONLY = ("jupyterlab", "nbformat", "nbclient", "matplotlib", "nbval", "pytest")


def _requirements(name: str = "course_lib") -> set[str]:
    """The installed distributions that `name` needs without extras, recursively (with the
    extras each requirement asks of its own dependency), as this environment resolved them."""
    found, todo = set(), [(name, ("",))]
    while todo:
        dist_name, extras = todo.pop()
        dist = importlib.metadata.distribution(dist_name)
        for text in dist.requires or []:
            req = Requirement(text)
            if req.marker and not any(req.marker.evaluate({"extra": e}) for e in extras):
                continue
            key = canonicalize_name(req.name)
            if key not in found:
                found.add(key)
                todo.append((req.name, ("", *req.extras)))
    return found


def _link_installed(site: Path, names: set[str]) -> None:
    """Install these distributions into `site` as hard links of this environment's installed
    files (their RECORD included, so pip sees them installed): unpacking torch and the rest
    again would be most of this test's time. pip still resolves the package's requirements
    against them, so a course-only requirement would still be installed and caught."""
    present = {canonicalize_name(d.metadata["Name"])
               for d in importlib.metadata.distributions(path=[str(site)])}
    for name in names - present:  # the new venv's own pip and setuptools: pip's to upgrade
        dist = importlib.metadata.distribution(name)
        for file in dist.files or []:
            if file.parts[0] == "..":  # console scripts: not needed here
                continue
            src, dst = Path(dist.locate_file(file)), site / file
            if not src.is_file():
                continue
            dst.parent.mkdir(parents=True, exist_ok=True)
            try:
                os.link(src, dst)
            except OSError:  # another filesystem: a copy
                shutil.copy2(src, dst)


@pytest.fixture(scope="module")
def bare_python(tmp_path_factory) -> Path:
    venv = tmp_path_factory.mktemp("bare") / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    python = venv / "bin" / "python"
    site = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_path("
                           "'purelib'))"], capture_output=True, text=True, check=True).stdout
    _link_installed(Path(site.strip()), _requirements())
    done = subprocess.run([str(python), "-m", "pip", "install", "--quiet", "-c",
                           str(ROOT / "constraints.txt"), str(ROOT)],
                          capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    return python


def test_the_bare_package_installs_none_of_the_course_s_extras(bare_python: Path):
    listed = subprocess.run([str(bare_python), "-m", "pip", "list", "--format=freeze"],
                            capture_output=True, text=True, timeout=120).stdout.lower()
    names = {line.split("==")[0].replace("_", "-") for line in listed.split()}
    assert "torch" in names and "course-lib" in names
    assert not names & set(COURSE_ONLY), sorted(names & set(COURSE_ONLY))


BACKENDS = ("gloo", "scratch")


@pytest.fixture(scope="module")
def trained(bare_python: Path, tmp_path_factory) -> tuple[dict[str, float], str]:
    """The script run once for every backend: (max |difference| by backend, its output)."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "COURSE_ZYGOTE_SOCKET")}
    done = subprocess.run([str(bare_python), str(SCRIPT), *BACKENDS],
                          cwd=tmp_path_factory.mktemp("trained"), env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.splitlines()
    diffs = {line.split()[0]: float(line.split()[1]) for line in lines[:len(BACKENDS)]}
    return diffs, done.stdout


@pytest.mark.parametrize("backend", BACKENDS)
def test_ddp_on_two_spawned_ranks_equals_one_process(trained: tuple[dict[str, float], str],
                                                    backend: str):
    diffs, stdout = trained
    assert diffs.get(backend, float("inf")) <= 1e-12, stdout
    assert "course machinery imported: False" in stdout
