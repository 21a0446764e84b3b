"""What `course_lib.cluster` raises: each error names the failing ranks and what they did."""

from __future__ import annotations

from course_lib.processes import RankError


class ClusterError(RuntimeError):
    """The cluster could not do what was asked (start, a stopped cluster, a dead engine...)."""


class RankTimeout(RankError):
    """Some ranks did not finish within the timeout; they were interrupted or restarted."""


class EngineDied(RankError, ClusterError):
    """A rank's engine process died; call `Cluster.restart()` to bring the world back."""


__all__ = ["ClusterError", "EngineDied", "RankError", "RankTimeout"]
