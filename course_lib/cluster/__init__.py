"""A cluster of ipyparallel engines with ranks, a process group, and bounded waits.

`start(4)` launches 4 engines on this machine, gives them ranks 0..3 and initializes the
process group on each; `Cluster.run(fn)` runs `fn` on every rank and returns the results in
rank order. Nothing waits forever: a rank that hangs is interrupted (or its engines restarted)
and the error names it. Every process started here is ended by PID when the cluster stops, on
errors, on KeyboardInterrupt and at interpreter exit.

Parts: `client` (`start`, `Cluster`: what a notebook calls), `ranks` (`Cluster`'s base: its
engines made ranks, their process group), `engine` (what each engine runs to become a rank,
and where the `%%px` globals come from), `join` (engines that join from another machine:
`course.py engines`), `zygote` and `zygote_server` (local engines forked, torch already
imported), `errors`.
"""

from course_lib.backend import BACKENDS, DEFAULT_BACKEND
from course_lib.cluster.client import Cluster, start
from course_lib.cluster.engine import get_rank, get_world_size
from course_lib.cluster.errors import ClusterError, EngineDied, RankError, RankTimeout

__all__ = ["BACKENDS", "DEFAULT_BACKEND", "Cluster", "ClusterError", "EngineDied", "RankError",
           "RankTimeout", "get_rank", "get_world_size", "start"]
