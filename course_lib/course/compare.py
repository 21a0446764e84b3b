"""Comparing a learner's value with the expected one, and showing both briefly."""

from __future__ import annotations

import math
import reprlib
from typing import Any

from course_lib.i18n import N_, _

_short = reprlib.Repr()
WRONG_VALUE = N_("wrong value")
_short.maxstring, _short.maxother, _short.maxlist, _short.maxtuple = 60, 60, 8, 8


def _is_tensor(x: Any) -> bool:
    return type(x).__module__.startswith("torch") and hasattr(x, "shape")


def _is_array(x: Any) -> bool:
    return type(x).__module__.startswith("numpy") and hasattr(x, "shape")


def mismatch(got: Any, expected: Any, rtol: float, atol: float, where: str = "") -> str | None:
    """None when `got` matches `expected` (numbers within rtol/atol), else what differs."""
    at = _(" at {where}", where=where) if where else ""
    if _is_tensor(expected) or _is_array(expected):
        if type(got) is not type(expected):
            return _("expected a {expected}{at}, got {got}", expected=type(expected).__name__,
                     at=at, got=type(got).__name__)
        if tuple(got.shape) != tuple(expected.shape):
            return _("shape {got}{at}, expected {expected}", got=tuple(got.shape), at=at,
                     expected=tuple(expected.shape))
        if got.dtype != expected.dtype:
            return _("dtype {got}{at}, expected {expected}", got=got.dtype, at=at,
                     expected=expected.dtype)
        import numpy as np

        if _is_tensor(expected):
            got, expected = got.detach().cpu().numpy(), expected.detach().cpu().numpy()
        close = np.isclose(got, expected, rtol=rtol, atol=atol, equal_nan=True)
        if close.all():
            return None
        err = np.where(close, 0, np.abs(got.astype(np.float64) - expected.astype(np.float64)))
        worst = np.unravel_index(np.argmax(err), err.shape)
        return _("values differ{at}: max |got - expected| = {error} at {index}", at=at,
                 error=f"{err[worst]:.3g}", index=tuple(int(i) for i in worst))
    if isinstance(expected, bool) or isinstance(got, bool):
        return None if got is expected else _wrong(got, expected, where)
    if isinstance(expected, float) and isinstance(got, (int, float)):
        ok = math.isclose(got, expected, rel_tol=rtol, abs_tol=atol) or (
            math.isnan(got) and math.isnan(expected))
        return None if ok else _wrong(got, expected, where)
    if isinstance(expected, (list, tuple)):
        if not isinstance(got, (list, tuple)):
            return _("expected a {expected}{at}, got {got}", expected=type(expected).__name__,
                     at=at, got=type(got).__name__)
        if len(got) != len(expected):
            return _("length {got}{at}, expected {expected}", got=len(got), at=at,
                     expected=len(expected))
        for i, (g, e) in enumerate(zip(got, expected)):
            diff = mismatch(g, e, rtol, atol, f"{where}[{i}]")
            if diff:
                return diff
        return None
    if isinstance(expected, dict):
        if not isinstance(got, dict) or set(got) != set(expected):
            return _("{got}{at}, expected keys {keys}", got=show(got), at=at,
                     keys=sorted(map(str, expected)))
        for k in expected:
            diff = mismatch(got[k], expected[k], rtol, atol, f"{where}[{k!r}]")
            if diff:
                return diff
        return None
    try:
        equal = bool(got == expected)
    except Exception:  # noqa: BLE001 - an odd __eq__ is a mismatch, not a crash
        equal = False
    return None if equal else _wrong(got, expected, where)


def _wrong(got: Any, expected: Any, where: str) -> str:
    # At the top level the table's expected/got columns already show both values.
    if not where:
        return _(WRONG_VALUE)
    return _("{got} at {where}, expected {expected}", got=show(got), where=where,
             expected=show(expected))


def _keys_translated(value: Any) -> Any:
    """`value` with its dicts' string keys in the learner's language: a check's data names its
    parts in its keys, the package's messages (marked N_() where the data is made)."""
    if isinstance(value, dict):
        return {_(k) if isinstance(k, str) else k: _keys_translated(v) for k, v in value.items()}
    if type(value) in (list, tuple):
        return type(value)(_keys_translated(v) for v in value)
    return value


def show(value: Any) -> str:
    """A short one-line repr of any value (tensors by shape, dtype and a few values; a dict's
    keys translated)."""
    value = _keys_translated(value)
    if _is_tensor(value):
        flat = value.detach().reshape(-1)[:6].tolist()
        more = ", ..." if value.numel() > 6 else ""
        return (f"tensor({', '.join(f'{v:g}' if isinstance(v, float) else str(v) for v in flat)}"
                f"{more}) shape={tuple(value.shape)} {str(value.dtype).replace('torch.', '')}")
    try:
        return _short.repr(value)
    except Exception:  # noqa: BLE001 - a broken __repr__ must not break the report
        return f"<{type(value).__name__}>"
