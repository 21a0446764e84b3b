"""Values as plain JSON data, never pickles: what graders store and pass between processes.

Numbers, strings, bytes, None, torch dtypes, lists, tuples, dicts (any plain keys), tensors (dtype, shape and raw
bytes) and numpy arrays round-trip exactly; anything else is refused with its type named, so
loading a file runs no code whoever wrote it.
"""

from __future__ import annotations

import base64
import json
import sys
from typing import Any

import numpy as np

MAX_BYTES = 64 * 2**20  # of one encoded value: a larger one is refused, not half-read


class PlainError(ValueError):
    """A value that plain data cannot hold, or a document that is not plain data."""


def _array(kind: str, dtype: str, shape: list[int], data: bytes) -> dict:
    return {f"__{kind}__": {"dtype": dtype, "shape": shape,
                            "data": base64.b64encode(data).decode("ascii")}}


def to_plain(value: Any, where: str = "value") -> Any:
    """`value` as JSON-able data (tagged dicts for tuples, dicts, tensors and arrays)."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    # No value is a tensor where torch was never imported: a pure-Python lesson's kernel
    # need not pay torch's import (seconds of CPU) to be graded.
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(value, torch.dtype):
        return {"__dtype__": str(value).removeprefix("torch.")}
    if isinstance(value, (bytes, bytearray)):
        return {"__bytes__": base64.b64encode(value).decode("ascii")}
    if torch is not None and isinstance(value, torch.Tensor):
        t = value.detach().cpu().contiguous()
        data = t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""
        return _array("tensor", str(t.dtype).removeprefix("torch."), list(t.shape), data)
    if isinstance(value, np.ndarray) and value.dtype.kind in "biufc":
        return _array("ndarray", value.dtype.str, list(value.shape),
                      np.ascontiguousarray(value).tobytes())
    if isinstance(value, (np.generic,)) and value.dtype.kind in "biuf":
        return value.item()
    if isinstance(value, list):
        return [to_plain(v, f"{where}[{i}]") for i, v in enumerate(value)]
    if isinstance(value, tuple):  # torch.Size is one
        return {"__tuple__": [to_plain(v, f"{where}[{i}]") for i, v in enumerate(value)]}
    if isinstance(value, dict):
        return {"__dict__": [[to_plain(k, f"{where} key"), to_plain(v, f"{where}[{k!r}]")]
                             for k, v in value.items()]}
    raise PlainError(f"{where}: a {type(value).__module__}.{type(value).__qualname__} is not "
                     "plain data (numbers, strings, bytes, lists, tuples, dicts, tensors)")


def _load_array(spec: Any, kind: str) -> Any:
    if not (isinstance(spec, dict) and set(spec) == {"dtype", "shape", "data"}
            and isinstance(spec["shape"], list) and all(isinstance(n, int) and n >= 0
                                                         for n in spec["shape"])):
        raise PlainError(f"a malformed {kind}: {str(spec)[:80]}")
    data = base64.b64decode(spec["data"], validate=True)
    shape = tuple(spec["shape"])
    if kind == "tensor":
        import torch

        dtype = getattr(torch, str(spec["dtype"]), None)
        if not isinstance(dtype, torch.dtype):
            raise PlainError(f"unknown tensor dtype {spec['dtype']!r}")
        size = torch.empty((), dtype=dtype).element_size() * int(np.prod(shape, dtype=np.int64))
        if size != len(data):
            raise PlainError(f"a {dtype} tensor of shape {shape} needs {size} bytes, got {len(data)}")
        flat = torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else torch.empty(0)
        return flat.view(dtype).reshape(shape) if data else torch.empty(shape, dtype=dtype)
    dtype = np.dtype(spec["dtype"])
    if dtype.kind not in "biufc" or dtype.itemsize * int(np.prod(shape)) != len(data):
        raise PlainError(f"a malformed array of {dtype} and shape {shape}")
    return np.frombuffer(data, dtype=dtype).reshape(shape).copy()


def from_plain(data: Any) -> Any:
    """The value `to_plain` encoded; PlainError on anything else."""
    if data is None or isinstance(data, (bool, int, float, str)):
        return data
    if isinstance(data, list):
        return [from_plain(v) for v in data]
    if isinstance(data, dict) and len(data) == 1:
        (tag, body), = data.items()
        if tag == "__dtype__":
            import torch

            if isinstance(getattr(torch, str(body), None), torch.dtype):
                return getattr(torch, body)
        if tag == "__bytes__" and isinstance(body, str):
            return base64.b64decode(body, validate=True)
        if tag == "__tuple__" and isinstance(body, list):
            return tuple(from_plain(v) for v in body)
        if tag == "__dict__" and isinstance(body, list) and all(
                isinstance(kv, list) and len(kv) == 2 for kv in body):
            return {from_plain(k): from_plain(v) for k, v in body}
        if tag in ("__tensor__", "__ndarray__"):
            return _load_array(body, tag.strip("_"))
    raise PlainError(f"not plain data: {str(data)[:80]}")


def dumps(value: Any) -> str:
    """`value` as a JSON document; PlainError if it is not plain or is over MAX_BYTES."""
    text = json.dumps(to_plain(value), separators=(",", ":"))
    if len(text) > MAX_BYTES:
        raise PlainError(f"{len(text)} bytes of plain data, over the limit of {MAX_BYTES}")
    return text


def loads(text: str | bytes) -> Any:
    """The value in a JSON document written by `dumps`, checked on the way."""
    if len(text) > MAX_BYTES:
        raise PlainError(f"{len(text)} bytes of plain data, over the limit of {MAX_BYTES}")
    try:
        return from_plain(json.loads(text))
    except (ValueError, TypeError, RecursionError) as exc:
        if isinstance(exc, PlainError):
            raise
        raise PlainError(f"not plain data: {exc}") from None
