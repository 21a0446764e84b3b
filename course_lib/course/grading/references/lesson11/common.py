"""What the parts of lesson 11's judge side share: values compared at a tolerance (tensors,
numbers and lists of them), and the compute dtype of each precision."""

from __future__ import annotations

import math
from typing import Any

import torch


def _close(a: Any, b: Any, rtol: float = 1e-6) -> bool:
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        return a.shape == b.shape and torch.allclose(a.double(), b.double(), rtol=rtol,
                                                     atol=1e-9)
    if isinstance(a, (int, float)) and isinstance(b, (int, float)):
        return math.isclose(a, b, rel_tol=rtol, abs_tol=1e-12)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_close(x, y, rtol) for x, y in zip(a, b))
    return a == b


DTYPES = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}
