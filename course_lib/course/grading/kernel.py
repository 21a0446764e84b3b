"""What `course-grade` runs inside a submission's kernel, after the submission's own cells.

The grader injects cells calling `collect_to_file`: it calls the learner's function on the
exercise's cases (on the grader's own cluster for distributed ones) and writes what each call
did as JSON, values as `plain` data (never pickles). Expected values, comparison and points are the
grader's (`judge`), in its own process: nothing here decides a grade.
"""

from __future__ import annotations

import json
import os
from typing import Any

from course_lib.course.grading import plain
from course_lib.course.catalogue import get_exercise
from course_lib.course.compare import show
from course_lib.course.grading.learner import collect, refusal
from course_lib.course.grading.report import Outcome
from course_lib import cluster

_CLUSTERS: dict[tuple[int, str], Any] = {}  # the grader's own clusters, never the notebook's


def _cluster(world_size: int, backend: str, timeout: float) -> Any:
    key = (world_size, backend)
    if key not in _CLUSTERS:
        _CLUSTERS[key] = cluster.start(world_size, backend=backend, timeout=timeout)
    else:
        try:  # an earlier exercise may have killed an engine
            _CLUSTERS[key].run(int, timeout=timeout)
        except cluster.ClusterError:
            _CLUSTERS[key].restart()
    return _CLUSTERS[key]


def _plain_out(out: dict) -> dict:
    """One call's outcome with its value as plain data, or described if it cannot be."""
    out = dict(out, status=str(Outcome(out["status"]).value))
    if "value" in out:
        try:
            out["value"] = plain.to_plain(out["value"])
        except plain.PlainError:
            value = out.pop("value")
            out["unplain"] = f"{show(value)} (a {type(value).__name__})"
    return out


def collect_to_file(name: str, fn: Any, path: str, time_limit: float | None = None,
                    cluster_timeout: float = 60.0) -> None:
    """Call `fn` on exercise `name`'s cases and write the outcomes as plain JSON to `path`."""
    ex = get_exercise(name)
    problem = refusal(ex, fn)
    doc: dict = {"exercise": name}
    if problem:
        doc["refused"] = problem
    else:
        cluster = _cluster(ex.world_size, ex.backend, cluster_timeout) if ex.distributed else None
        found = collect(ex, fn, cluster, float(time_limit or ex.time_limit))
        doc["cases"] = [{"outs": [_plain_out(o) for o in c["outs"]], "halt": c["halt"]}
                        for c in found]
    text = json.dumps(doc)  # values are plain data already; the rest is JSON
    if len(text) > plain.MAX_BYTES:
        text = json.dumps({"exercise": name, "refused": f"its results are over "
                                                        f"{plain.MAX_BYTES} bytes"})
    tmp = f"{path}.tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
    os.replace(tmp, path)


def stop_clusters() -> None:
    """Stop every cluster `collect_to_file` started."""
    while _CLUSTERS:
        _CLUSTERS.popitem()[1].stop()
