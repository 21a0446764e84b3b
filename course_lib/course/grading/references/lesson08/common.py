"""What both parts of lesson 08's judge side use: tensors compared at the checks' tolerance,
ranks listed, and the reason a check's collectives are wrong."""

from __future__ import annotations

from typing import Any

import torch

from course_lib.i18n import _


def _t(x: Any) -> torch.Tensor | None:
    return x if isinstance(x, torch.Tensor) else None


def _close(a: Any, b: Any) -> bool:
    a, b = _t(a), _t(b)
    return (a is not None and b is not None and a.shape == b.shape
            and bool(torch.allclose(a.double(), b.double(), rtol=1e-9, atol=1e-12)))


def _ranks(ranks) -> str:
    return ", ".join(str(r) for r in ranks)


def _calls_reason(got: dict, want: dict, name: str) -> str | None:
    if got == want:
        return None
    if "all_reduce" in got:
        return _("an all_reduce where one {name} does: the right numbers, but the whole buffer "
                 "travels to every rank, twice the bytes", name=name)
    return _("collectives {got}, expected {want}", got=got, want=want)
