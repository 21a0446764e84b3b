"""What both parts of lesson 08's checks use: the parts' notebooks, the lesson's defaults for an
exercise run on sub-worlds of the grader's 4-rank cluster, a rank's flat gradient, and an
exception as a check reports it."""

from __future__ import annotations

import torch

from course_lib.course.grading.sub_worlds import register_on_sub_worlds as register_on

A, B = "08a_zero", "08b_fsdp"  # the two parts' notebooks


def register_on_sub_worlds(name: str, notebook: str, **fields) -> None:
    """A lesson 08 exercise run on sub-worlds of the grader's 4-rank scratch cluster."""
    function = name.split(".")[1]
    fields.setdefault("rtol", 1e-12)
    fields.setdefault("reference", f"lesson08:{function}")
    fields.setdefault("explain", f"lesson08:explain_{function}")
    register_on(name, notebook, **fields)


def _values(rank: int, n: int) -> torch.Tensor:
    """Rank `rank`'s padded flat gradient: different per rank and per element."""
    return torch.arange(n, dtype=torch.float64) * (rank + 1) + 0.5 * rank


def _error(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"[:300]
