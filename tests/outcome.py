"""What a rank saw of a call that should fail: run it, and write its error (or none) and how
long it took to `outdir/rank{rank}.json` for the test to read after the ranks are gone."""

from __future__ import annotations

import json
import os
import time
from typing import Callable


def record_outcome(call: Callable[[], object], outdir: str, rank: int) -> None:
    """Run `call`; note the DistError it raised (message and type, or None) and its duration."""
    from course_lib import dist

    t0 = time.monotonic()
    try:
        call()
        result = {"error": None}
    except dist.DistError as exc:
        result = {"error": str(exc), "type": type(exc).__name__}
    result["elapsed"] = time.monotonic() - t0
    with open(os.path.join(outdir, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)
