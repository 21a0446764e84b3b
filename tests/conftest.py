"""Suite-wide guard: every process this test session starts must be gone when it ends.

Children inherit a per-session marker in their environment, so at the end we can find any
engine, controller or kernel the suite left behind (even one re-parented to init), fail the
run, and end it by PID.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import uuid
from typing import Any

import psutil
import pytest

MARKER = "COURSE_LIB_TEST_SESSION"


def pytest_configure(config: pytest.Config) -> None:
    os.environ.setdefault(MARKER, uuid.uuid4().hex)
    worker = os.environ.get("PYTEST_XDIST_WORKER")
    if worker and not os.environ[MARKER].endswith(f"-{worker}"):
        # A marker of its own per xdist worker, so one worker's checks for leftover processes
        # do not see the other worker's live clusters; the controller's check sees them all.
        os.environ[MARKER] = f"{os.environ[MARKER]}-{worker}"
    os.environ.setdefault("IPP_NONINTERACTIVE", "1")
    # One intra-op thread in every process of the suite, as every rank has (`course.py test`
    # sets it too, for the notebooks alone): before any process imports torch.
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    # Lesson 11c's run that learns takes minutes for a learner; under nbval, a few steps (its
    # outputs that depend on the length are not compared).
    os.environ.setdefault("COURSE_LIB_CAPSTONE_STEPS", "6")
    # The learner's overlay (course_lib.course.overlay) of this process and its children:
    # empty, and never the developer's own ~/.course_lib.
    if not os.environ.get("COURSE_LIB_HOME", "").startswith(tempfile.gettempdir()):
        os.environ["COURSE_LIB_HOME"] = tempfile.mkdtemp(prefix="course_lib_home-")
        config.add_cleanup(lambda: shutil.rmtree(os.environ["COURSE_LIB_HOME"], True))
    if config.pluginmanager.hasplugin("nbval"):
        from nbval.kernel import RunningKernel

        RunningKernel.stop = _stop_as_jupyterlab_does


def _stop_as_jupyterlab_does(kernel: Any) -> None:
    """nbval's `RunningKernel.stop`, with the kernel asked to shut down (as JupyterLab asks)
    rather than SIGKILLed at once: a killed kernel runs no exit handler, and one that started
    multiprocessing's fork server (`course_lib.spawn`) left its pymp-* folder in /tmp. Ending
    that server takes the kernel about a second, longer under the suite's load than the 2.5 s
    after which jupyter_client's default wait SIGTERMs it (no exit handler either); past the
    longer wait, jupyter_client still ends the kernel by PID."""
    kernel.kc.stop_channels()
    kernel.km.shutdown_wait_time = 30.0
    kernel.km.shutdown_kernel(now=False)
    del kernel.km


# Files that take a minute or more, run first: xdist hands whole files (--dist loadfile) to
# whichever worker is free, in collection order, so a long file collected last leaves the
# other workers idle at the end. Notebooks first, the later (longer) lessons before the earlier.
LONG_FILES = ("test_grading_batch.py", "test_browser.py", "test_train.py", "test_resume.py",
              "test_recovery.py", "test_lesson00_exercises.py", "test_zero.py", "test_cluster.py")


def _longest_first(item: pytest.Item) -> tuple[int, int]:
    name = item.path.name
    if item.path.suffix == ".ipynb":
        return 0, -int(name[:2]) if name[:2].isdigit() else 0
    if name in LONG_FILES:
        return 1, LONG_FILES.index(name)
    return 2, 0


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    items.sort(key=_longest_first)  # stable: each file's items keep their order


def leftover_processes() -> list[psutil.Process]:
    """Processes other than this one that carry this session's (or worker's) marker.

    multiprocessing's resource tracker and fork server (`course_lib.spawn` forks ranks from it)
    are exempt: they live until this process exits, by design; the ranks they forked are not.
    """
    token, me, found = os.environ[MARKER], os.getpid(), []
    for proc in psutil.process_iter(["pid"]):
        if proc.pid == me:
            continue
        try:
            mark = proc.environ().get(MARKER) or ""
            if mark != token and not mark.startswith(f"{token}-"):
                continue
            cmdline = " ".join(proc.cmdline())
            if proc.ppid() == me and ("multiprocessing.resource_tracker" in cmdline
                                      or "multiprocessing.forkserver" in cmdline):
                continue
            found.append(proc)
        except psutil.Error:
            continue
    return found


def full(name: str, fn, cluster=None, **kwargs):
    """Assert that `fn` scores full points on exercise `name`; returns the Result."""
    from course_lib.course.grading.learner import grade_function

    r = grade_function(name, fn, cluster, **kwargs)
    assert r.points == r.max_points, r
    return r


def less(name: str, fn, cluster=None, **kwargs):
    """Assert that `fn`, a realistic wrong version, scores less than full points on `name`;
    returns the Result (its reason says what is wrong)."""
    from course_lib.course.grading.learner import grade_function

    r = grade_function(name, fn, cluster, **kwargs)
    assert r.points < r.max_points, r
    assert_feedback_teaches_without_telling(name, r)
    return r


def assert_feedback_teaches_without_telling(name: str, result) -> None:
    """A failing check's default output, in both languages, says what is wrong and never shows
    code of the exercise's answer (course_lib.course.lesson_shape's code expressions)."""
    from pathlib import Path

    from course_lib import i18n
    from course_lib.course import lesson_shape
    from course_lib.course.grading import get_exercise

    ex = get_exercise(name)
    source = Path(__file__).resolve().parents[1] / "solutions" / f"{ex.notebook}.ipynb"
    if not source.is_file():  # a test's own exercise, not a lesson's
        return
    solution = lesson_shape.solution_of(source, ex.function)
    for lang in i18n.LANGUAGES:
        with i18n.language(lang):
            shown = str(result) + "\n" + result._repr_html_()
        shared = lesson_shape.code_in_feedback(shown, solution)
        assert not shared, f"{name}'s feedback ({lang}) shows the answer's code: {shared}"


@pytest.fixture(scope="session", autouse=True)
def shared_zygote():
    """One zygote for every cluster this process and its kernels start, and for the kernels
    themselves (as `course.py lab` gives a learner's): each would otherwise import torch."""
    from course_lib.cluster import zygote
    from course_lib.course import kernels as kernel_provisioner

    # As in `course.py lab`: what the zygote forks starts as a lesson's process does
    os.environ.setdefault("COURSE_LIB_STARTUP", "course_lib.course.overlay:install")
    proc, path = zygote.start_shared()
    os.environ[zygote.SOCKET_ENV] = path
    kernel_provisioner.use_in_this_process()  # nbval's and nbclient's kernels
    yield proc
    os.environ.pop(zygote.SOCKET_ENV, None)
    zygote.end(proc)


@pytest.fixture
def short_tmp():
    """A folder of its own right under the system's temporary folder, removed after the test:
    Unix sockets made in it stay within their 107-byte path, which tmp_path (longer with each
    pytest run and with the user's name) does not promise."""
    from pathlib import Path

    folder = Path(tempfile.mkdtemp(prefix="t-"))
    yield folder
    shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture(scope="session")
def scratch_cluster_4():
    """One 4-rank scratch cluster shared by a test file's exercise tests (each lesson's
    distributed checks run on the first 2, 3 and 4 ranks of it); one per pytest worker."""
    from course_lib.cluster import start

    with start(4, backend="scratch", timeout=60) as c:
        yield c


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    from course_lib.cluster import zygote

    zygote.stop()  # it lives as long as this process, like the fork server; end it now
    if os.environ.get("PYTEST_XDIST_WORKER"):
        return
    left = psutil.wait_procs(leftover_processes(), timeout=5)[1]
    if not left:
        return
    lines = []
    for proc in left:
        try:
            lines.append(f"  pid {proc.pid}: {' '.join(proc.cmdline())[:160]}")
            proc.kill()
        except psutil.Error:
            pass
    session.config.get_terminal_writer().line(
        "processes started by the test suite were still alive at the end (now killed):\n"
        + "\n".join(lines), red=True)
    session.exitstatus = pytest.ExitCode.TESTS_FAILED
