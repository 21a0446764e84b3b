"""ipyparallel's controller launcher, forking the controller from the engine zygote.

A controller started as a new Python imports ipyparallel first: a second of CPU per cluster,
every lesson and every restart. The zygote has it imported already (`course_lib.cluster.zygote`).
"""

from __future__ import annotations

import os

import psutil
from ipyparallel.cluster.launcher import LocalControllerLauncher

from course_lib.cluster import zygote
from course_lib.i18n import _


class ForkedControllerLauncher(LocalControllerLauncher):
    """ipyparallel's local controller launcher, the process forked instead of executed; the
    launcher watches and stops it by PID as it would its own."""

    def start(self) -> None:
        if self.state != "before":
            raise RuntimeError(_("the controller was already started (state {state})",
                                 state=self.state))
        argv = self.args[len(self.controller_cmd):]
        env = {**os.environ, **self.get_env()}
        pid = zygote.fork(argv, self.output_file, app="controller", env=env,
                          cwd=self.work_dir or os.getcwd())
        self.pid = pid
        self.process = psutil.Process(pid)
        self.notify_start(pid)
        self._start_waiting()
