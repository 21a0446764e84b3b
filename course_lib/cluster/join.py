"""Engines that join a cluster from another machine: `python3 course.py engines COUNT --file F`.

The notebook's machine runs `start(n, joining=k, controller_ip=...)`, which prints where its
engine connection file is. Copied here (it holds the controller's addresses and the key that
signs every message; the scratch backend's secret is derived from that key, never sent), it
lets this command start COUNT ipyparallel engines that register with that controller. They
run until the cluster stops (it shuts them down), the controller goes silent, or this command
is interrupted; every engine is ended by PID on the way out.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time

from course_lib.i18n import _
from course_lib.processes import ProcessSet


def engine_command(connection_file: str) -> list[str]:
    """One ipyparallel engine registering with the controller named in `connection_file`."""
    return [sys.executable, "-m", "ipyparallel.engine", f"--file={connection_file}",
            "--log-level=ERROR"]


def check_connection_file(path: str) -> dict:
    """The engine connection file's contents; SystemExit naming what is wrong with it."""
    try:
        with open(path, encoding="utf-8") as f:
            info = json.load(f)
    except (OSError, ValueError) as exc:
        raise SystemExit(_("course.py engines: cannot read the connection file {path}: {exc}",
                           path=path, exc=exc))
    missing = [k for k in ("key", "registration", "interface") if k not in info]
    if missing:
        raise SystemExit(_("course.py engines: {path} is not an ipyparallel engine connection "
                           "file (no {missing}); copy ipcontroller-*-engine.json", path=path,
                           missing=", ".join(missing)))
    return info


def run(count: int, connection_file: str, timeout: float | None = None) -> int:
    """Start `count` engines and wait for them to end (or `timeout` seconds); 0 when they all
    ended by themselves."""
    info = check_connection_file(connection_file)
    env = dict(os.environ, OMP_NUM_THREADS="1")  # one intra-op thread per engine
    procs, children = ProcessSet(), []

    def stop(signum: int, _frame) -> None:
        raise KeyboardInterrupt(signal.Signals(signum).name)

    signal.signal(signal.SIGTERM, stop)
    try:
        for _i in range(count):
            child = subprocess.Popen(engine_command(connection_file), env=env,
                                     stdin=subprocess.DEVNULL)
            procs.add(child.pid)
            children.append(child)
        print(_("course.py engines: {count} engine(s) started (pids {pids}), joining {where}",
                count=count, pids=" ".join(str(c.pid) for c in children),
                where=info.get("location") or info["interface"]), flush=True)
        deadline = None if timeout is None else time.monotonic() + timeout
        while any(c.poll() is None for c in children):
            if deadline is not None and time.monotonic() > deadline:
                print(_("course.py engines: time is up; ending the engines"), flush=True)
                return 1
            time.sleep(0.2)
        codes = [c.returncode for c in children]
        print(_("course.py engines: the engines ended (exit codes {codes})", codes=codes),
              flush=True)
        return 0
    except KeyboardInterrupt:
        print(_("course.py engines: interrupted; ending the engines"), flush=True)
        return 130
    finally:
        procs.end(grace=1.0)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="course.py engines",
        description="Start engines here that join a cluster started on another machine with "
                    "start(n, joining=COUNT, controller_ip=...).")
    parser.add_argument("count", type=int, help="how many engines to start on this machine")
    parser.add_argument("--file", required=True,
                        help="the engine connection file copied from the notebook's machine")
    parser.add_argument("--timeout", type=float, default=None,
                        help="end the engines after this many seconds (default: never)")
    args = parser.parse_args(argv)
    if args.count < 1:
        parser.error(_("count must be at least 1"))
    return run(args.count, args.file, args.timeout)


if __name__ == "__main__":
    sys.exit(main())
