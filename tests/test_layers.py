"""The package's two rooms and its layers (.importlinter, CONTRIBUTING.md "Layers"), enforced:
no module imports from a layer above its own, no import cycle anywhere, every module placed."""

from __future__ import annotations

import configparser
import os
import shutil
import subprocess
import sys
from pathlib import Path

import grimp
import pytest

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / ".importlinter"
LINT = Path(sys.executable).with_name("lint-imports")


def lint(package_parent: Path) -> subprocess.CompletedProcess:
    """Run import-linter's contracts on the `course_lib` found in `package_parent`."""
    env = dict(os.environ, PYTHONPATH=str(package_parent))
    return subprocess.run([str(LINT), "--config", str(CONFIG), "--no-cache"], cwd=package_parent,
                          env=env, capture_output=True, text=True, timeout=300)


def test_every_contract_is_kept():
    done = lint(ROOT)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "BROKEN" not in done.stdout and "KEPT" in done.stdout


def test_a_planted_upward_import_breaks_the_layers(tmp_path: Path):
    """The process group (the lowest room) importing the course's build, even inside a
    function, is named as the import that breaks the layers."""
    shutil.copytree(ROOT / "course_lib", tmp_path / "course_lib",
                    ignore=shutil.ignore_patterns("__pycache__"))
    p2p = tmp_path / "course_lib" / "dist" / "p2p.py"
    p2p.write_text(p2p.read_text() + "\n\ndef _planted():\n"
                   "    from course_lib.course import build\n    return build\n")
    done = lint(tmp_path)
    assert done.returncode != 0
    assert "course_lib.dist.p2p -> course_lib.course.build" in done.stdout, done.stdout


def _layered() -> set[str]:
    parser = configparser.ConfigParser()
    parser.read(CONFIG)
    layers = parser["importlinter:contract:layers"]["layers"]
    return {m.strip() for line in layers.split("\n") for m in line.replace("|", ":").split(":")
            if m.strip()}


@pytest.fixture(scope="module")
def graph() -> grimp.ImportGraph:
    return grimp.build_graph("course_lib", exclude_type_checking_imports=True, cache_dir=None)


def test_every_module_sits_in_a_layer(graph):
    """A new module must be placed (a module in no layer would be free to import anything)."""
    layered = _layered()
    for module in graph.modules - {"course_lib"}:
        assert any(module == m or module.startswith(m + ".") for m in layered), \
            f"{module} is in no layer of .importlinter"


def test_no_cycle_in_the_import_graph(graph):
    """No strongly connected set of modules (Tarjan's algorithm over every import)."""
    index, low, stack, on_stack, cycles = {}, {}, [], set(), []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.find_modules_directly_imported_by(v):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = set()
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.add(w)
                if w == v:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    sys.setrecursionlimit(max(10000, sys.getrecursionlimit()))
    for module in sorted(graph.modules):
        if module not in index:
            visit(module)
    assert not cycles, cycles
