#!/usr/bin/env python3
"""The course's entry point, standard library only: `python3 course.py lab` or `... test`.

Each command first makes sure `.venv` holds the pinned dependencies (constraints.txt), so a
fresh machine with only Python 3.11+ needs nothing else.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent
VENV = ROOT / ".venv"
BIN = VENV / ("Scripts" if os.name == "nt" else "bin")
PY = BIN / ("python.exe" if os.name == "nt" else "python")
STAMP = VENV / ".course-installed"
DEPENDENCY_FILES = ("pyproject.toml", "constraints.txt")


def run(*cmd: object, env: dict | None = None) -> int:
    """Run `cmd` in the repository and return its exit code. A SIGTERM or SIGHUP sent to
    course.py is passed on to it, so ending course.py by PID never leaves it running."""
    print("+", " ".join(str(c) for c in cmd), flush=True)
    with subprocess.Popen([str(c) for c in cmd], cwd=ROOT, env=env) as proc:
        def pass_on(signum: int, _frame: object) -> None:
            proc.send_signal(signum)
        caught = [s for s in (getattr(signal, "SIGTERM", None), getattr(signal, "SIGHUP", None))
                  if s is not None]
        previous = {s: signal.signal(s, pass_on) for s in caught}
        try:
            return proc.wait()
        except BaseException:  # Ctrl-C here, as subprocess.call does
            proc.kill()
            raise
        finally:
            for s, handler in previous.items():
                signal.signal(s, handler)


def dependency_hash() -> str:
    h = hashlib.sha256()
    for name in DEPENDENCY_FILES:
        h.update((ROOT / name).read_bytes())
    return h.hexdigest()


def ensure_env() -> None:
    """Create .venv and install the pinned dependencies, unless they are already current."""
    if sys.version_info < (3, 11):
        sys.exit(f"course_lib needs Python 3.11 or newer; this is {sys.version.split()[0]}")
    wanted = dependency_hash()
    if STAMP.exists() and STAMP.read_text() == wanted and PY.exists():
        return
    if not PY.exists() and run(sys.executable, "-m", "venv", VENV) != 0:
        sys.exit("could not create .venv (on Debian/Ubuntu: apt install python3-venv)")
    wanted_set = ("-c", "constraints.txt", "-e", ".[course,mpi,dev]")
    # uv installs the same pinned set several times faster than pip; pip does it where uv
    # cannot be had or fails.
    uv = BIN / ("uv.exe" if os.name == "nt" else "uv")
    if (run(PY, "-m", "pip", "install", "--quiet", "-c", "constraints.txt", "uv") == 0
            and run(uv, "pip", "install", "--quiet", "--python", PY, "--compile-bytecode",
                    *pip_sources(), *wanted_set) == 0):
        STAMP.write_text(wanted)
        return
    steps = [(PY, "-m", "pip", "install", "--quiet", "--upgrade", "pip"),
             (PY, "-m", "pip", "install", "--quiet", *wanted_set)]
    for step in steps:
        if run(*step) != 0:
            sys.exit("installing the dependencies failed (see pip's message above)")
    STAMP.write_text(wanted)


def pip_sources() -> list[str]:
    """pip's configured package sources (its config files and PIP_* variables: the CPU wheel's
    index, a local folder of wheels) as uv's flags, which reads neither; like pip, uv then takes
    a release from whichever source has it (`--index-strategy unsafe-best-match`)."""
    listed = subprocess.run([str(PY), "-m", "pip", "config", "list"], capture_output=True,
                            text=True).stdout
    sources: dict[tuple[str, str], None] = {}  # in order, each once (a file and a variable)
    for line in listed.splitlines():
        key, _, value = line.partition("=")
        name = key.rsplit(".", 1)[-1]
        if name in ("index-url", "extra-index-url", "find-links"):
            sources.update(dict.fromkeys(("--" + name, v)
                                         for v in value.strip().strip("'\"").split()))
    return ["--index-strategy", "unsafe-best-match", *(x for pair in sources for x in pair)]


LOCALES = {"en": "en", "es": "es_ES"}  # the course's editions -> JupyterLab's language packs


def lab_settings(lang: str) -> Path:
    """The course's JupyterLab settings for an edition: its language pack selected and the news
    pop-up off (it covers cells). Kept in .venv, so the learner's own settings elsewhere stay."""
    folder = VENV / "share" / "course-lab" / lang
    wanted = {"@jupyterlab/translation-extension/plugin": {"locale": LOCALES[lang]},
              "@jupyterlab/apputils-extension/notification": {"fetchNews": "false"}}
    for plugin, values in wanted.items():
        path = folder / f"{plugin}.jupyterlab-settings"
        try:
            current = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError):  # missing, or edited into JSON5 that json cannot read
            current = {}
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({**current, **values}, indent=2), encoding="utf-8")
    return folder


# nbgrader's instructor interface (Create Assignment, Formgrader, Validate, the assignment and
# course lists): in the instructor's lab, not in a learner's.
NBGRADER_SERVER = ("formgrader", "validate_assignment", "assignment_list", "course_list")
NBGRADER_LAB = "@jupyter/nbgrader"


def learner_config() -> Path:
    """A Jupyter config folder, first on JUPYTER_CONFIG_PATH for a learner's lab, that turns
    nbgrader's server and lab extensions off (they stay installed for `--instructor`)."""
    folder = VENV / "share" / "course-lab" / "learner-config"
    server = {"ServerApp": {"jpserver_extensions": {
        f"nbgrader.server_extensions.{name}": False for name in NBGRADER_SERVER}}}
    (folder / "labconfig").mkdir(parents=True, exist_ok=True)
    (folder / "jupyter_server_config.json").write_text(json.dumps(server, indent=2))
    (folder / "labconfig" / "page_config.json").write_text(
        json.dumps({"disabledExtensions": {NBGRADER_LAB: True}}, indent=2))
    return folder


def lab(rest: list[str], env: dict[str, str]) -> int:
    """`lab [--lang en|es] [--instructor] [jupyter lab options]`: the student notebooks of that
    edition; `--instructor` adds nbgrader's instructor interface."""
    instructor = "--instructor" in rest
    if instructor:
        rest.remove("--instructor")
    else:
        env = dict(env, JUPYTER_CONFIG_PATH=os.pathsep.join(
            filter(None, [str(learner_config()), env.get("JUPYTER_CONFIG_PATH")])))
    lang = "en"
    if "--lang" in rest:
        i = rest.index("--lang")
        lang = rest[i + 1] if i + 1 < len(rest) else ""
        del rest[i:i + 2]
    if lang not in LOCALES:
        print(f"course.py lab --lang: choose one of {', '.join(LOCALES)}")
        return 2
    folder = "notebooks" if lang == "en" else f"notebooks/{lang}"
    if any(a.startswith(("--ServerApp.root_dir", "--notebook-dir")) for a in rest):
        folder = None  # the caller's folder (the browser test serves solutions beside lessons)
    # The lab's processes start as a lesson does: the learner's components win from their first
    # import (course_lib.course.overlay), in the kernels and the engines forked for them.
    env = dict(env, COURSE_LANG=lang, JUPYTERLAB_SETTINGS_DIR=str(lab_settings(lang)),
               COURSE_LIB_STARTUP="course_lib.course.overlay:install")
    root = ["--allow-root"] if hasattr(os, "geteuid") and os.geteuid() == 0 else []  # containers
    where = [f"--ServerApp.root_dir={folder}"] if folder else []
    zygote = shared_zygote(env)
    forked = ["--KernelProvisionerFactory.default_provisioner_name=course-zygote"] if zygote else []
    try:
        return run(BIN / "jupyter", "lab", *where, *root, *forked, *rest, env=env)
    finally:
        if zygote is not None:
            zygote.stdin.close()  # it exits; by PID if it has not
            try:
                zygote.wait(5)
            except subprocess.TimeoutExpired:
                zygote.kill()


def shared_zygote(env: dict[str, str]) -> subprocess.Popen | None:
    """One zygote for the lab (course_lib/cluster/zygote.py): kernels are forked from it
    (course_lib/course/kernels.py), and their clusters' engines, skipping torch's
    imports. Its socket goes into `env`; None where it cannot run (no fork), and each kernel
    starts as a new Python and its first cluster its own zygote."""
    if not hasattr(os, "fork"):
        return None
    # By its path: importing the package would import torch, and this is the system's Python.
    spec = importlib.util.spec_from_file_location(
        "course_zygote", ROOT / "course_lib" / "cluster" / "zygote.py")
    zygote = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(zygote)
    try:
        proc, socket = zygote.start_shared(PY, env)
    except RuntimeError as exc:
        print(f"course.py lab: {exc}; each kernel starts without it")
        return None
    env[zygote.SOCKET_ENV] = socket
    return proc


def main(argv: list[str]) -> int:
    commands = {
        "lab": "install, then open the course in JupyterLab (--lang es: the Spanish edition; "
               "--instructor: with nbgrader's instructor interface)",
        "test": "install, then run the whole test suite (extra args go to pytest; --quick: "
                "the tests that start no engines, kernels or servers, and no notebooks)",
        "build": "regenerate exported modules and the student notebooks (--check: verify only)",
        "engines": "start engines here that join a notebook's cluster on another machine: "
                   "engines COUNT --file ipcontroller-engine.json (README, More than one "
                   "machine)",
        "bench": "run a benchmark: bench NAME ... (see python -m course_lib.course.bench -h)",
        "export": "write a lesson you completed into your own course_lib: export 04 (--status)",
        "release": "write the student bundle, without solutions, into a new folder: release DIR",
        "nbgrader": "lay out an nbgrader 0.9 course from the source: nbgrader DIR [LESSON...]",
    }
    if not argv or argv[0] not in commands:
        print(__doc__)
        for name, what in commands.items():
            print(f"  python3 course.py {name:6} {what}")
        return 2
    command, rest = argv[0], argv[1:]
    if command in ("test", "build", "release", "nbgrader") and not (ROOT / "solutions").is_dir():
        print(f"course.py {command}: this is the student release, which has no solutions/ or "
              "tests: each notebook's checks grade your work (python3 course.py lab)")
        return 2
    start = time.monotonic()  # the test command's time includes installing
    ensure_env()
    env = dict(os.environ, IPP_NONINTERACTIVE="1")
    if command == "lab":
        return lab(rest, env)
    if command == "test":
        # One intra-op thread in every process, as every rank has: three workers on two cores
        # would otherwise spin against each other, and the notebooks' compared outputs (a
        # reference computed in the kernel) were saved with one.
        env["OMP_NUM_THREADS"] = "1"
        paths = [a for a in rest if not a.startswith("-") and Path(a.split("::")[0]).exists()]
        if "--quick" in rest:
            rest.remove("--quick")
            what = ("-m", "not cluster and not slow") + (() if paths else ("tests",))
        else:
            what = ("--nbval",) + (() if paths else ("tests", "solutions"))
        # The whole suite on three workers: on the two cores CI and the budget assume, two left
        # the CPU idle 15% of the run (tests wait on processes, servers and timeouts), three
        # keep it busy. A file's tests stay on one worker, in order, so a notebook's cells and a
        # module's fixtures stay together.
        workers = () if paths or any(a.startswith("-n") for a in rest) else (
            "-n", "3", "--dist", "loadfile")
        code = run(PY, "-m", "pytest", *what, *workers, *rest, env=env)
        minutes, seconds = divmod(round(time.monotonic() - start), 60)
        print(f"course.py test: {minutes} min {seconds} s (budget on 2 cores: 15 min)", flush=True)
        return code
    if command == "build":
        return run(PY, "-m", "course_lib.course.build", *rest)
    if command == "engines":  # the connection file is named from where the user stands
        rest = [f"--file={os.path.abspath(a[7:])}" if a.startswith("--file=") else
                os.path.abspath(a) if i and rest[i - 1] == "--file" else a
                for i, a in enumerate(rest)]
        return run(PY, "-m", "course_lib.cluster.join", *rest, env=env)
    if command == "export":
        # not `-m course_lib.course.overlay`: the package imports that module before it could run
        return run(PY, "-c", "import sys; from course_lib.course.overlay import main; "
                   "sys.exit(main(sys.argv[1:]))", *rest)
    if command == "release":
        return run(PY, "-m", "course_lib.course.release", *rest)
    if command == "nbgrader":
        return run(PY, "-m", "course_lib.course.grading.nbgrader_course", *rest)
    return run(PY, "-m", "course_lib.course.bench", *rest, env=env)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
