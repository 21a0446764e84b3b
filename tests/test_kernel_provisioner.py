"""Kernels forked from the shared zygote (course_lib.course.kernels) behave as kernels
jupyter_client starts itself: the folder, environment and inline plots they were given, interrupt,
restart, shutdown, and an end with their manager; anything that cannot be forked starts the usual
way."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import psutil
import pytest
from jupyter_client.manager import KernelManager

from course_lib.cluster import zygote
from course_lib.course.kernels import NAME, ZygoteProvisioner

pytestmark = pytest.mark.cluster


def run(kc, code: str) -> str:
    """Execute `code`; what it printed (an error's name and value if it raised)."""
    out = []

    def keep(msg):
        content = msg["content"]
        if msg["msg_type"] == "stream":
            out.append(content["text"])
        elif msg["msg_type"] == "error":
            out.append(f"{content['ename']}: {content['evalue']}")

    kc.execute_interactive(code, timeout=60, output_hook=keep)
    return "".join(out)


def touched_at_exit(kc, mark: Path) -> Path:
    """Have the kernel create the file `mark` from an exit hook (atexit); returns `mark`."""
    run(kc, f"import atexit, pathlib\n_ = atexit.register(pathlib.Path({str(mark)!r}).touch)")
    return mark


@pytest.fixture
def managers():
    """New KernelManagers, their kernels shut down at the end."""
    made: list[KernelManager] = []
    yield lambda: made.append(KernelManager(kernel_name="python3")) or made[-1]
    for km in made:
        if km.has_kernel:
            km.shutdown_kernel(now=True)



def _gone(pid: int, timeout: float = 10.0) -> bool:
    """Whether `pid` ended and was reaped (by the zygote, its parent, which reaps
    asynchronously: a loaded machine shows the ended kernel as a zombie for a moment)."""
    deadline = time.monotonic() + timeout
    while psutil.pid_exists(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    return not psutil.pid_exists(pid)

def test_a_kernel_is_forked_with_its_folder_environment_and_inline_plots(managers, tmp_path,
                                                                         shared_zygote):
    manager = managers()
    manager.start_kernel(cwd=str(tmp_path), env=dict(os.environ, COURSE_TEST_VALUE="given",
                                                    TMPDIR=str(tmp_path)))
    assert isinstance(manager.provisioner, ZygoteProvisioner)
    pid = manager.provisioner.pid
    assert psutil.Process(pid).ppid() == shared_zygote.pid  # forked, not a new Python
    kc = manager.client()
    kc.start_channels()
    try:
        kc.wait_for_ready(timeout=60)
        got = run(kc, "import os, tempfile, matplotlib, torch\n"
                      "print(os.getcwd(), os.environ['COURSE_TEST_VALUE'], os.getpid(), "
                      "tempfile.gettempdir())\n"
                      "print(matplotlib.get_backend())")
        # the given TMPDIR, not the one the zygote had read when it started
        assert got.split("\n")[0] == f"{tmp_path} given {pid} {tmp_path}"
        assert "inline" in got.split("\n")[1]
        assert "sys.path has the folder: True" in run(
            kc, "import sys; print('sys.path has the folder:', '' in sys.path)")

        kc.execute("import time; print('sleeping', flush=True); time.sleep(60)")
        while kc.get_iopub_msg(timeout=30)["content"].get("text") != "sleeping\n":
            pass  # inside the cell now (an interrupt between cells is ignored)
        manager.interrupt_kernel()  # SIGINT to the kernel's process group
        reply = kc.get_shell_msg(timeout=30)
        while reply["parent_header"].get("msg_type") != "execute_request":
            reply = kc.get_shell_msg(timeout=30)
        assert reply["content"]["ename"] == "KeyboardInterrupt"

        manager.restart_kernel(now=True)
        kc.wait_for_ready(timeout=60)
        new = manager.provisioner.pid
        assert new != pid and _gone(pid)
        assert psutil.Process(new).ppid() == shared_zygote.pid
        assert run(kc, "print(6 * 7)") == "42\n"
        mark = touched_at_exit(kc, tmp_path / "atexit-ran")
    finally:
        kc.stop_channels()
    manager.shutdown_kernel(now=False)
    assert not manager.is_alive() and _gone(new)
    assert mark.exists(), "a graceful shutdown ran none of the kernel's exit hooks"


def test_what_cannot_be_forked_starts_as_a_new_python(managers, tmp_path):
    no_zygote = {k: v for k, v in os.environ.items() if k != zygote.SOCKET_ENV}
    for kwargs in (dict(preexec_fn=lambda: None),  # course-grade's limits come this way
                   dict(env=no_zygote)):
        manager = managers()
        manager.start_kernel(cwd=str(tmp_path), **kwargs)
        assert isinstance(manager.provisioner, ZygoteProvisioner)
        assert psutil.Process(manager.provisioner.pid).ppid() == os.getpid()


MANAGER = textwrap.dedent("""
    import os, sys
    from jupyter_client.manager import KernelManager
    from course_lib.course import kernels as kernel_provisioner
    kernel_provisioner.use_in_this_process()
    # In the test's folder: killed, this process cannot remove its connection file.
    km = KernelManager(kernel_name="python3", connection_file=os.path.abspath("kernel.json"))
    km.start_kernel()
    print(km.provisioner.pid, type(km.provisioner).__name__, flush=True)
    sys.stdin.read()
""")


def test_a_forked_kernel_ends_when_its_manager_is_killed(tmp_path, shared_zygote):
    proc = subprocess.Popen([sys.executable, "-c", MANAGER], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True, cwd=tmp_path)
    try:
        pid, kind = proc.stdout.readline().split()
        kernel = psutil.Process(int(pid))
        assert kind == ZygoteProvisioner.__name__ and kernel.ppid() == shared_zygote.pid
    finally:
        os.kill(proc.pid, signal.SIGKILL)  # no shutdown: the kernel must notice by itself
        proc.wait(10)
    assert psutil.wait_procs([kernel], timeout=15)[1] == []


def test_the_provisioner_is_registered_under_its_name():
    from jupyter_client.provisioning import KernelProvisionerFactory

    assert KernelProvisionerFactory.instance()._check_availability(NAME)


def test_nbval_asks_its_kernels_to_shut_down_so_their_exit_hooks_run(tmp_path, shared_zygote):
    """The suite's nbval kernels end as JupyterLab ends them (conftest's stop): asked to shut
    down, so their exit hooks run (multiprocessing's among them, which removes a fork server's
    pymp-* folder: tests/test_spawn.py). nbval's own stop SIGKILLs them, and none ran."""
    from nbval.kernel import CURRENT_ENV_KERNEL_NAME, RunningKernel

    kernel = RunningKernel(CURRENT_ENV_KERNEL_NAME, cwd=str(tmp_path))
    pid = kernel.km.provisioner.pid
    try:
        mark = touched_at_exit(kernel.kc, tmp_path / "atexit-ran")
    finally:
        kernel.stop()
    assert _gone(pid), f"kernel {pid} still running after its shutdown"
    assert mark.exists(), "nbval's stop ran none of the kernel's exit hooks"
