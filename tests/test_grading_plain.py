"""course_lib.course.grading.plain: values as JSON data, round-tripped exactly, and anything else (or a
malformed document) refused with a clear error instead of being run or half-read."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from course_lib.course.grading import plain


def same(a, b) -> bool:
    """Equal in type, structure and every bit (NaN equal to NaN)."""
    if type(a) is not type(b):
        return False
    if isinstance(a, torch.Tensor):
        raw = [t.contiguous().reshape(-1).view(torch.uint8) for t in (a, b)]
        return a.dtype == b.dtype and a.shape == b.shape and torch.equal(*raw)
    if isinstance(a, np.ndarray):
        return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(map(same, a, b))
    if isinstance(a, dict):
        return list(a) == list(b) and all(same(a[k], b[k]) for k in a)
    if isinstance(a, float) and math.isnan(a):
        return math.isnan(b)
    return a == b


def test_every_kind_of_value_a_check_compares_round_trips_bit_for_bit():
    g = torch.Generator().manual_seed(0)
    value = {
        "floats": [1.5, -0.0, float("nan"), float("inf"), 10**30],
        "tensors": (torch.randn(3, 4, generator=g), torch.randn(5, generator=g).double(),
                    torch.randn(2, 3, generator=g).to(torch.bfloat16),
                    torch.randn(4, generator=g).half(), torch.arange(6).reshape(2, 3),
                    torch.tensor([True, False]), torch.tensor(3.25), torch.empty(0, 3),
                    torch.randn(4, 6, generator=g).t(),  # not contiguous
                    torch.complex(torch.ones(2), torch.zeros(2))),
        "array": np.arange(12, dtype=np.int32).reshape(3, 4),
        3: None, (1, "a"): b"\x00\xff header", None: torch.float16,
        "nested": [[(), {}], {"k": [1, (2, 3)]}],
    }
    back = plain.loads(plain.dumps(value))
    assert same(back, value)
    assert plain.loads(plain.dumps(torch.Size([2, 3]))) == (2, 3)


@pytest.mark.parametrize("value", [object(), {1, 2}, lambda: 0, torch.nn.Linear(2, 2),
                                   [1, {"x": print}]])
def test_a_value_that_is_not_plain_data_is_refused_naming_its_type_and_place(value):
    with pytest.raises(plain.PlainError, match="is not plain data"):
        plain.dumps(value)
    with pytest.raises(plain.PlainError, match=r"value\[1\]\['x'\]"):
        plain.dumps([1, {"x": print}])


@pytest.mark.parametrize("text", [
    '{"__tensor__": {"dtype": "float32", "shape": [2], "data": "AAAA"}}',  # 3 bytes, not 8
    '{"__tensor__": {"dtype": "Tensor", "shape": [1], "data": "AAAAAA=="}}',
    '{"__tensor__": {"dtype": "float32", "shape": [-1], "data": ""}}',
    '{"__ndarray__": {"dtype": "|O", "shape": [1], "data": "AAAAAAAAAAA="}}',  # objects
    '{"__pickle__": "gASVAAAAAAAAAAA="}', '{"a": 1}', '{"__dtype__": "load"}',
    '{"__bytes__": "not base64!"}', "[1, 2", '{"__dict__": [[1]]}',
])
def test_a_malformed_document_is_refused_not_half_read(text):
    with pytest.raises(plain.PlainError):
        plain.loads(text)


def test_a_value_over_the_size_limit_is_refused_both_ways(monkeypatch: pytest.MonkeyPatch):
    text = plain.dumps(torch.zeros(1000))
    monkeypatch.setattr(plain, "MAX_BYTES", len(text) - 1)
    with pytest.raises(plain.PlainError, match="over the limit"):
        plain.dumps(torch.zeros(1000))
    with pytest.raises(plain.PlainError, match="over the limit"):
        plain.loads(text)
