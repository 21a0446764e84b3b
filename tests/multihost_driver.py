"""The notebook's side of tests/test_multihost.py, run inside the first network namespace.

It starts a cluster of `N` ranks of which `K` join from the other namespace, and answers the
test's commands (one per line on stdin) with one JSON line each on stdout, so the test can act
between steps (start the far engines, send a stranger, kill an engine).
"""

from __future__ import annotations

import json
import socket
import sys
import time

import torch

from course_lib.cluster import ClusterError, EngineDied, RankError, start


def say(**what) -> None:
    print("DRIVER " + json.dumps(what), flush=True)


def sums(sizes: list[int]) -> list[list[float]]:
    """all_reduce of (rank + 1) * arange(size) for each size; the first and last values."""
    from course_lib import dist

    out = []
    for size in sizes:
        t = (dist.get_rank() + 1) * torch.arange(size, dtype=torch.float64)
        dist.all_reduce(t)
        out.append([t[1].item(), t[-1].item()])
    return out


def main(n: int, joining: int, ip: str, run_timeout: float, ports: str) -> None:
    with start(n, joining=joining, controller_ip=ip, timeout=90, run_timeout=run_timeout,
               controller_args=[f"--IPController.ports={ports}"]) as c:
        hosts = c.run(socket.gethostname)
        say(step="started", hosts=hosts, pids=c.pids,
            addresses=[list(a) for a in c._rendezvous["addresses"]])
        for line in sys.stdin:
            command = line.strip()
            if command == "sums":
                say(step="sums", per_rank=c.run(sums, [1000, 300_000]))
            elif command == "records":
                say(step="records", records=c.flight_records(timeout=10))
            elif command == "after-kill":
                begun = time.monotonic()
                try:
                    c.run(sums, [1000, 300_000])
                    say(step="after-kill", error=None)
                except (EngineDied, RankError, ClusterError) as exc:
                    say(step="after-kill", error=type(exc).__name__, message=str(exc),
                        failures=getattr(exc, "failures", {}),
                        seconds=time.monotonic() - begun)
            elif command == "stop":
                break
    say(step="stopped")


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], float(sys.argv[4]), sys.argv[5])
