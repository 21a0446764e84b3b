"""The kernel a submission runs in, on the grader's side: forked from the run's kernel zygote
under memory and file-size limits in its scratch folder (in a PID namespace of its own where Linux allows), one cell at a
time with a timeout, interrupted and probed after one, and ended with everything it started
(escaped double-forks included: `containment`) by PID."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import nbformat
from nbclient import NotebookClient
from nbclient.exceptions import CellTimeoutError, DeadKernelError
from nbclient.util import run_sync

from course_lib.cluster import zygote
from course_lib.course import kernels
from course_lib.course.overlay import STARTUP_ENV
from course_lib.course.grading import containment
from course_lib.processes import ProcessSet

PROBE_SECONDS = 15      # a kernel that cannot run `pass` in this long is killed
TREE_POLL_SECONDS = 0.2
MEMORY_LIMIT = 8 * 2**30  # bytes of address space per kernel process (and each it starts)
FILE_LIMIT = 2**30        # bytes of any one file a kernel writes


@dataclass(frozen=True)
class Limits:
    """How long and how much a submission may take."""

    notebook_timeout: float = 600.0
    exercise_timeout: float | None = None
    memory: int = MEMORY_LIMIT
    file_size: int = FILE_LIMIT


def kernel_zygote() -> subprocess.Popen:
    """A zygote for one run's kernels (its `.socket`), with torch and ipykernel imported once
    and no course_lib module: nothing of the reference is in what it forks."""
    env = {k: v for k, v in os.environ.items() if k not in (zygote.SOCKET_ENV, STARTUP_ENV)}
    return zygote.start_shared(sys.executable, env)[0]


class KernelSession:
    """A fresh kernel for one submission; `close()` ends it and its process tree by PID."""

    def __init__(self, nb: nbformat.NotebookNode, cwd: Path):
        self.client = NotebookClient(nb, kernel_name="python3", allow_errors=True,
                                     interrupt_on_timeout=False, shutdown_kernel="graceful",
                                     resources={"metadata": {"path": str(cwd)}})
        self.cwd = cwd
        self.pid: int | None = None
        self.tree = ProcessSet()  # the kernel and everything it starts
        self._closing = threading.Event()
        self._started = 0.0
        self._spare: int | None = None

    def start(self, env: dict[str, str], sockets: Path, forked_from: subprocess.Popen,
              limits: Limits = Limits()) -> None:
        """Start the kernel with `env`, forked from the run's `kernel_zygote` under `limits`, in
        its scratch folder, talking over Unix sockets in the folder `sockets`; in a PID namespace
        of its own where Linux allows, whose keeper ends it when this process ends."""
        # A submission's engines are forked inside its containment (limits, this subreaper),
        # by its kernel's own zygote, never by a zygote shared with anything else.
        env = {k: v for k, v in env.items() if k != zygote.SOCKET_ENV}
        kernels.use_in_this_process()
        env[kernels.CONTAIN_ENV] = json.dumps({
            "socket": forked_from.socket, "namespace": containment.namespace_command() is not None,
            "limits": containment.rlimits(limits.memory, limits.file_size)})
        self._spare = forked_from.pid  # our child too, but every kernel's: not this one's
        self.client.km = self.client.create_kernel_manager()
        # Unix sockets in our own temp folder: no TCP port, nothing written next to the notebook.
        self.client.km.transport, self.client.km.ip = "ipc", str(sockets / "kernel")
        # Its connection file (the channels' HMAC key) too: gone with the folder, even when
        # the grader is killed before it can remove the file.
        self.client.km.connection_file = str(sockets / "kernel.json")
        self._started = time.time() - 1.0  # create_time is rounded; a second of slack
        self.client.start_new_kernel(env=env, cwd=str(self.cwd))
        self.pid = self.client.km.provisioner.pid
        self._note()
        # Keep noting the kernel's descendants: if the kernel dies, they are re-parented to us.
        threading.Thread(target=self._watch_tree, daemon=True, name="course-grade-tree").start()
        self.client.start_new_kernel_client()

    def _note(self) -> None:
        self.tree.add(self.pid)
        for child in containment.adopted_since(self._started):
            if child.pid != self._spare:
                self.tree.add(child)

    def _watch_tree(self) -> None:
        while not self._closing.wait(TREE_POLL_SECONDS):
            self._note()

    def run(self, cell: nbformat.NotebookNode, index: int, timeout: float) -> str:
        """Execute one cell: "ok" (errors included), "timeout" or "dead"."""
        self.client.timeout = max(1, math.ceil(timeout))
        try:
            self.client.execute_cell(cell, index)
            return "ok"
        except CellTimeoutError:
            return "timeout"
        except DeadKernelError:
            return "dead"

    def run_code(self, source: str, timeout: float) -> tuple[str, nbformat.NotebookNode]:
        """Append a cell with `source` to the notebook and run it."""
        cell = nbformat.v4.new_code_cell(source)
        self.client.nb.cells.append(cell)
        return self.run(cell, len(self.client.nb.cells) - 1, timeout), cell

    def recover(self) -> bool:
        """After a timeout: interrupt the kernel and check it answers again."""
        try:
            run_sync(self.client.km.interrupt_kernel)()
        except Exception:  # noqa: BLE001 - a dead kernel fails the probe below
            pass
        # Fresh channels: the timed-out cell's reply and outputs must not reach later cells.
        self.client.kc.stop_channels()
        self.client.kc = None
        self.client.start_new_kernel_client()
        return self.run_code("pass", PROBE_SECONDS)[0] == "ok"

    def close(self) -> list[int]:
        """Shut the kernel down (its atexit stops clusters), then kill whatever is left.
        Returns the PIDs that had to be killed."""
        if self.client.km is None:
            return []
        self._note()
        self._closing.set()
        try:
            self.client._cleanup_kernel()  # nbclient's own shutdown + cleanup
        except Exception:  # noqa: BLE001 - ending the tree below is the backstop
            pass
        killed = self.tree.end(grace=5.0)
        for child in containment.adopted_since(self._started):  # forked while we ended the rest
            if child.pid != self._spare:
                self.tree.add(child)
        return killed + self.tree.end(grace=2.0)
