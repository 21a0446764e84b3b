"""What `course-grade` runs inside a submission's kernel, after the submission's own cells.

The grader injects cells calling `grade_to_file`; results travel back as a JSON file (plain
data, never pickles), so nothing the notebook printed or displayed is read.
"""

from __future__ import annotations

import json
import os
from typing import Any

from course_lib.grading.catalogue import get_exercise
from course_lib.grading.learner import grade_function

_CLUSTERS: dict[tuple[int, str], Any] = {}  # the grader's own clusters, never the notebook's


def _cluster(world_size: int, backend: str, timeout: float) -> Any:
    from course_lib import cluster

    key = (world_size, backend)
    if key not in _CLUSTERS:
        _CLUSTERS[key] = cluster.start(world_size, backend=backend, timeout=timeout)
    else:
        try:  # an earlier exercise may have killed an engine
            _CLUSTERS[key].run(int, timeout=timeout)
        except cluster.ClusterError:
            _CLUSTERS[key].restart()
    return _CLUSTERS[key]


def grade_to_file(name: str, fn: Any, path: str, time_limit: float | None = None,
                  cluster_timeout: float = 60.0) -> None:
    """Grade `fn` for exercise `name` and write the Result as JSON to `path`."""
    ex = get_exercise(name)
    cluster = _cluster(ex.world_size, ex.backend, cluster_timeout) if ex.distributed else None
    result = grade_function(ex, fn, cluster, time_limit=time_limit)
    tmp = f"{path}.tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(result.to_dict(), f)
    os.replace(tmp, path)


def stop_clusters() -> None:
    """Stop every cluster `grade_to_file` started."""
    while _CLUSTERS:
        _CLUSTERS.popitem()[1].stop()
