"""Jupyter kernels forked from the shared zygote instead of started as a new Python.

A lesson's kernel imports torch as its engines do: 4 to 7 s of CPU on a laptop for every
notebook opened and every kernel restart. Where a kernel's environment names a shared zygote
(`zygote.SOCKET_ENV`: `python3 course.py lab` and the test suite start one), this provisioner
has the zygote fork the ipykernel, with the kernel's argv, environment and folder. Anything else
(no shared zygote, another Python or kernel, a `preexec_fn` such as course-grade's limits) starts
as jupyter_client's `LocalProvisioner` would. Either way the kernel runs in its own session and
is signalled, interrupted and killed by PID (its process group), as LocalProvisioner does.
Registered as the entry point `course-zygote`; JupyterLab uses it with
`--KernelProvisionerFactory.default_provisioner_name=course-zygote`.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from typing import Any

import psutil
from jupyter_client.provisioning import LocalProvisioner

from course_lib.cluster import zygote
from course_lib.processes import alive

NAME = "course-zygote"  # the entry point's name (pyproject.toml)
CONTAIN_ENV = "COURSE_GRADE_CONTAIN"  # course-grade's zygote and bounds for one kernel (JSON)
LAUNCHER = ["-m", "ipykernel_launcher"]  # what the kernel command must run to be forked


class ForkedKernel:
    """The Popen-like handle LocalProvisioner keeps, for a kernel that is the zygote's child:
    its exit status is not ours to collect, so an exited kernel reads as returncode 0."""

    stdin = stdout = stderr = None

    def __init__(self, pid: int):
        self.pid, self.returncode = pid, None
        self._proc = psutil.Process(pid)

    def poll(self) -> int | None:
        if self.returncode is None and not alive(self._proc):
            self.returncode = 0
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(f"kernel {self.pid}", timeout)
            time.sleep(0.05)
        return self.returncode

    def send_signal(self, signum: int) -> None:
        if self.poll() is None:
            try:
                self._proc.send_signal(signum)  # psutil refuses a PID reused since
            except psutil.NoSuchProcess:
                pass

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


def contained(env: dict[str, str]) -> dict | None:
    """course-grade's request for this kernel (`CONTAIN_ENV`: the zygote's socket, the limits,
    whether in a PID namespace of its own), taken out of `env` (not the kernel's to see)."""
    text = env.pop(CONTAIN_ENV, None)
    return json.loads(text) if text else None


def forkable(cmd: list[str], kwargs: dict[str, Any]) -> str | None:
    """The shared zygote's socket if this launch can be forked from it, else None."""
    env = kwargs.get("env") or os.environ
    if kwargs.get("preexec_fn") is not None or not hasattr(os, "fork"):
        return None
    if len(cmd) < 3 or cmd[1:3] != LAUNCHER:
        return None
    return env.get(zygote.SOCKET_ENV) or None


class ZygoteProvisioner(LocalProvisioner):
    """jupyter_client's local provisioner, the ipykernel forked from the shared zygote."""

    async def launch_kernel(self, cmd: list[str], **kwargs: Any):
        env = dict(kwargs.get("env") or os.environ, JPY_PARENT_PID=str(os.getpid()))
        contain = contained(env)
        path = contain["socket"] if contain else forkable(cmd, kwargs)
        if path is None:
            return await super().launch_kernel(cmd, **kwargs)
        # ipykernel read its parent from the zygote's environment at import: said again here
        argv = cmd[3:] + [f"--IPKernelApp.parent_handle={os.getpid()}"]
        request = zygote.request(argv, None, app="kernel", env=env,
                                 cwd=str(kwargs.get("cwd") or os.getcwd()), executable=cmd[0])
        request["parent"] = os.getpid()  # the kernel ends with this process, as ipykernel's would
        if contain:
            request["contain"] = {k: contain[k] for k in ("limits", "namespace")}
        pid = zygote.ask_shared(request, zygote.START_TIMEOUT, path)
        if pid is None and contain:  # never a kernel outside the bounds it was asked in
            raise RuntimeError(f"course-grade's kernel zygote at {path} did not fork the kernel")
        if pid is None:  # the zygote is gone or refused (another Python): a new Python, then
            return await super().launch_kernel(cmd, **kwargs)
        self.process = ForkedKernel(pid)
        self.pid, self.pgid = pid, pid  # the zygote's child called setsid()
        self.cwd = request["cwd"]
        self.log.debug("kernel %s forked from the zygote at %s", pid, path)
        return self.connection_info


def use_in_this_process() -> None:
    """Kernels this process starts (nbval's, nbclient's) use the provisioner from now on."""
    from jupyter_client.provisioning import KernelProvisionerFactory

    KernelProvisionerFactory.instance().default_provisioner_name = NAME
