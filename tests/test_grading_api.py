"""course_lib.course.grading: declaring exercises and checking a learner's function locally."""

import math
import threading
import time

import pytest
import torch

from course_lib.course.grading import RANK, Exercise, Result, case, get_exercise, register
from course_lib.course.grading.learner import check, grade_function
from course_lib.course.compare import mismatch

SCALE = register(Exercise(
    name="lesson99.scale", notebook="99_api_test", params=("x", "factor"),
    cases=[case(torch.arange(4.0), 2.0), case(torch.ones(2, 3), -0.5),
           case(torch.tensor([1.0, 2.0]), 3.0, expected=torch.tensor([3.0, 6.0]))],
    reference=lambda x, factor: x * factor, points=3, hints=("multiply", "times the factor"),
    time_limit=1.0))


def _sign_explained(c, rank, expected, got):
    """The lesson's reason for a wrong value: here, a sign lost."""
    if torch.equal(got, expected.abs()) and not torch.equal(got, expected):
        return "the sign of a negative factor is lost"
    return None


register(Exercise(
    name="lesson99.signed", notebook="99_api_test", params=("x", "factor"),
    cases=[case(torch.arange(4.0), 2.0), case(torch.ones(2), -0.5), case(torch.ones(2), 0.0)],
    reference=lambda x, factor: x * factor, explain=_sign_explained))


def scale(x, factor):
    return x * factor


def scale_close(x, factor):  # within float32 rounding of the reference
    return (x * factor * 3.0) / 3.0


def scale_wrong_once(x, factor):  # a realistic slip: ignores negative factors
    return x * abs(factor)


def scale_todo(x, factor):
    # YOUR CODE HERE
    raise NotImplementedError


def scale_one_arg(x):
    return x


def scale_raises(x, factor):
    table = {}
    return table[factor]


def scale_hangs(x, factor):
    while True:
        pass


def test_correct_function_gets_full_points():
    for fn in (scale, scale_close):
        result = grade_function("lesson99.scale", fn)
        assert (result.points, result.max_points) == (3.0, 3.0), str(result)
        assert result.passed and result.reason == "all 3 cases passed"
        assert [c.passed for c in result.cases] == [True, True, True]


def test_wrong_function_is_graded_by_case():
    result = grade_function("lesson99.scale", scale_wrong_once)
    assert result.points == 2.0 and not result.passed
    assert result.reason.startswith("1 of 3 cases failed; first: scale(tensor(1, 1, 1, 1, 1, 1)")
    assert "values differ" in result.reason
    # Hints only on request, a level at a time; by default only how to ask.
    assert "multiply" not in str(result)
    assert "check(..., hint=1) gives a first hint (2 levels)" in str(result)
    first, both = str(result.with_hints(1)), str(result.with_hints(2))
    assert "Hint 1: multiply" in first and "times the factor" not in first
    assert "check(..., hint=2) gives the next level" in first
    assert "Hint 1: multiply" in both and "Hint 2: times the factor" in both
    assert "next level" not in both


def test_check_takes_a_hint_level(capsys):
    check("lesson99.scale", scale_wrong_once, hint=1)
    assert "Hint 1: multiply" in capsys.readouterr().out
    with pytest.raises(ValueError, match="takes a level"):
        check("lesson99.scale", scale_wrong_once, hint=-1)


def test_a_wrong_value_is_explained_in_the_lesson_s_terms():
    result = grade_function("lesson99.signed", scale_wrong_once)
    assert result.reason.endswith("the sign of a negative factor is lost"), result.reason
    assert "the sign of a negative factor is lost" in str(result)

    def zero_for_all(x, factor):  # the explanation does not fit: the generic difference
        return x * 0
    assert "values differ" in grade_function("lesson99.signed", zero_for_all).reason


def test_ranks_that_sit_out_a_case_are_not_listed():
    from course_lib.course.grading import CaseResult, Row
    rows = [Row(0, False, "1", "2", "wrong"), Row(1, True, "1", "1"),
            Row(2, True, "None", "None", sat_out=True), Row(3, True, "None", "None", sat_out=True)]
    result = Result("lesson99.scale", 0.0, 1.0, "why", [CaseResult("2 ranks", rows)])
    ranks = [line.split()[2] for line in str(result).splitlines()[3:]]
    assert ranks == ["0", "1"], str(result)
    assert result._repr_html_().count("<tr") == 3
    assert Result.from_dict(result.to_dict()) == result


def test_not_implemented_is_zero_with_a_clear_reason():
    result = grade_function("lesson99.scale", scale_todo)
    assert result.points == 0.0
    assert result.reason == "not implemented yet: scale raises NotImplementedError"
    # One line: no table and no hint (nor the offer of one) for a stub.
    assert str(result) == ("lesson99.scale: 0 / 3 points. not implemented yet: scale raises "
                           "NotImplementedError")
    assert "<table>" not in result._repr_html_()


def test_wrong_signature_is_reported_before_any_call():
    result = grade_function("lesson99.scale", scale_one_arg)
    assert result.points == 0.0 and result.cases == []
    assert result.reason == "wrong signature: expected scale(x, factor), got scale_one_arg(x)"


def test_exception_names_type_message_and_learner_line():
    result = grade_function("lesson99.scale", scale_raises)
    assert result.points == 0.0
    assert "raised KeyError: 2.0 (in scale_raises, line " in result.reason
    assert "return table[factor]" in result.reason


def test_missing_or_non_callable():
    assert grade_function("lesson99.scale", None).reason.startswith("scale is not defined")
    assert "should be a function, got int" in grade_function("lesson99.scale", 3).reason


def test_hang_is_cut_off_and_stopped():
    threads = threading.active_count()
    start = time.monotonic()
    result = grade_function("lesson99.scale", scale_hangs)
    elapsed = time.monotonic() - start
    assert elapsed < 1.0 + 2.0, elapsed  # one case's limit, then the other cases are not run
    assert result.points == 0.0
    assert result.reason.startswith("timed out: scale(") and "within 1s" in result.reason
    assert [r.note for c in result.cases for r in c.rows][1:] == ["not run", "not run"]
    time.sleep(0.2)
    assert threading.active_count() == threads  # the endless loop was stopped


def test_plain_text_and_html_rendering():
    result = grade_function("lesson99.scale", scale_wrong_once)
    text = str(result).splitlines()
    assert text[0].startswith("lesson99.scale: 2 / 3 points. 1 of 3 cases failed")
    assert text[1].split() == ["case", "result", "expected", "got", "note"]
    assert [" FAIL " in line for line in text[3:6]] == [False, True, False]
    assert "max |got - expected| = 1 at (0, 0)" in text[4]
    page = result._repr_html_()
    assert page.count("<tr") == 4 and "&#10008; fail" in page and "hint=1" in page
    assert "Hint 1: multiply" in result.with_hints(1)._repr_html_()

    class Printer:
        def text(self, s):
            self.out = s
    p = Printer()
    result._repr_pretty_(p, False)
    assert p.out == str(result)


def test_check_prints_the_table_or_skips_while_grading(capsys, monkeypatch):
    check("lesson99.scale", scale)
    out = capsys.readouterr().out
    assert out.startswith("lesson99.scale: 3 / 3 points. all 3 cases passed")
    monkeypatch.setenv("COURSE_LIB_GRADING", "1")
    check("lesson99.scale", scale_todo)
    assert "skipped" in capsys.readouterr().out


def test_result_round_trips_through_json_data():
    result = grade_function("lesson99.scale", scale_wrong_once)
    again = Result.from_dict(result.to_dict())
    assert str(again) == str(result)


@pytest.mark.parametrize("got, expected, verdict", [
    (1.0 + 1e-7, 1.0, None), (1.1, 1.0, "wrong value"), (3, 3, None), (True, 1, "wrong value"),
    ([1, 2.0], [1, 2.0 + 1e-9], None), ([1, 2], [1, 3], "2 at [1], expected 3"),
    ({"a": 1}, {"a": 1}, None), (torch.zeros(2), torch.zeros(3), "shape (2,), expected (3,)"),
    (torch.zeros(2, dtype=torch.int64), torch.zeros(2), "dtype torch.int64, expected torch.float32"),
    ([1.0], (1.0,), None), (math.nan, math.nan, None), ("a", 1, "wrong value"),
])
def test_mismatch(got, expected, verdict):
    assert mismatch(got, expected, 1e-5, 1e-8) == verdict


def test_bad_declarations_are_rejected():
    with pytest.raises(ValueError, match="must look like 'lesson00.function'"):
        Exercise(name="scale", notebook="x", cases=[case(1, expected=1)])
    with pytest.raises(ValueError, match="reference or an expected value"):
        Exercise(name="lesson99.f", notebook="x", cases=[case(1)])
    with pytest.raises(ValueError, match="only make sense when distributed"):
        Exercise(name="lesson99.f", notebook="x", cases=[case(RANK, expected=1)])
    with pytest.raises(ValueError, match="registered by both 99_api_test and 98_other"):
        register(Exercise(name="lesson99.scale", notebook="98_other",
                          cases=[case(1, expected=1)]))
    with pytest.raises(KeyError, match="no exercise named 'lesson99.nope'.*lesson99.scale"):
        get_exercise("lesson99.nope")
    with pytest.raises(ValueError, match="runs on the cluster"):
        grade_function(Exercise(name="lesson99.d", notebook="x", distributed=True,
                                cases=[case(RANK, expected=1)]), lambda r: r)
