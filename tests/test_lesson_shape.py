"""Every lesson in both editions: about an hour, no answer shown before its exercise, hints and
feedback without code, no development history. Counted as `course_lib.course.lesson_shape` says;
`python -m course_lib.course.lesson_shape` prints the table these tests hold each lesson to."""

from __future__ import annotations

import re
from pathlib import Path

import polib
import pytest

from course_lib import i18n
from course_lib.course import lesson_shape as shape
from course_lib.course.catalogue import exercises_for, lessons

ROOT = Path(__file__).resolve().parent.parent
SOLUTIONS = sorted((ROOT / "solutions").glob("*.ipynb"))
EDITIONS = shape.editions(ROOT)
PAIRS = [(sol, lang) for sol in SOLUTIONS for lang in EDITIONS
         if (EDITIONS[lang] / sol.name).is_file()]
IDS = [f"{sol.stem}-{lang}" for sol, lang in PAIRS]
# The learner's lines in all lessons before lessons were fitted to their hour: the budget is
# never met by cutting what the learner writes.
LEARNER_LINES_BEFORE = 529
# Code an exercise's solution shares with a cell above it that is not its answer, with why:
# {(lesson, first line of the region): reason}. Each is a judgement, not a licence.
NOT_LEAKS: dict[tuple[str, str], str] = {}
DATED = re.compile(r"20\d\d-[01]\d-[0-3]\d")  # in prose, outputs or metadata


@pytest.mark.parametrize("sol, lang", PAIRS, ids=IDS)
def test_a_lesson_fits_its_hour(sol: Path, lang: str) -> None:
    e = shape.estimate(sol, EDITIONS[lang] / sol.name)
    assert e.minutes <= shape.BUDGET_MINUTES, (
        f"{sol.stem} ({lang}) takes {e.minutes:.0f} min: {e.words} words, {e.given} given "
        f"lines, {e.learner} learner lines; split it or move given code into the package")
    assert e.longest_markdown <= shape.LONGEST_MARKDOWN, (
        f"{sol.stem} ({lang}) has a markdown cell of {e.longest_markdown} words")


def test_the_learner_writes_no_less_than_before() -> None:
    total = sum(shape.estimate(sol).learner for sol in SOLUTIONS)
    assert total >= LEARNER_LINES_BEFORE, total
    print("\n".join(shape.table(ROOT)))


@pytest.fixture(scope="module")
def idioms() -> frozenset:
    return shape.idioms(ROOT)


@pytest.mark.parametrize("sol, lang", PAIRS, ids=IDS)
def test_no_answer_is_shown_before_its_exercise(sol: Path, lang: str, idioms) -> None:
    found = [leak for leak in shape.leaks(sol, EDITIONS[lang] / sol.name, idioms)
             if (leak.lesson, leak.first_line) not in NOT_LEAKS]
    assert not found, "\n".join(map(str, found))


def test_the_leak_finder_finds_an_answer_shown_above(tmp_path: Path, idioms) -> None:
    """The test above can fail: a demo cell that computes the ring's chunk indices, and a
    markdown code span that states them, are both found above the exercise."""
    import json

    def nb(cells):
        return {"cells": cells, "metadata": {}, "nbformat": 4, "nbformat_minor": 5}
    demo = {"cell_type": "code", "id": "a", "source": "have[r][(r - s - 2) % p] += 1"}
    span = {"cell_type": "markdown", "id": "b", "source": "send `chunks[(r - s - 1) % p]`"}
    answer = ("def ring(tensor):\n    ### BEGIN SOLUTION\n    for s in range(p - 1):\n"
              "        theirs = chunks[(r - s - 2) % p]\n        mine = chunks[(r - s - 1) % p]\n"
              "    ### END SOLUTION\n")
    exercise = {"cell_type": "code", "id": "c", "source": answer}
    stub = dict(exercise, source="def ring(tensor):\n    # YOUR CODE HERE\n"
                                 "    raise NotImplementedError\n")
    (tmp_path / "sol.ipynb").write_text(json.dumps(nb([demo, span, exercise])))
    (tmp_path / "st.ipynb").write_text(json.dumps(nb([demo, span, stub])))
    found = shape.leaks(tmp_path / "sol.ipynb", tmp_path / "st.ipynb", idioms)
    assert {leak.shown_in for leak in found} == {0, 1}, found
    (tmp_path / "st.ipynb").write_text(json.dumps(nb([stub, demo, span])))  # after: fine
    (tmp_path / "sol.ipynb").write_text(json.dumps(nb([exercise, demo, span])))
    assert not shape.leaks(tmp_path / "sol.ipynb", tmp_path / "st.ipynb", idioms)


def _exercises():
    return [ex for lesson in lessons() for ex in exercises_for(lesson)
            if (ROOT / "solutions" / f"{ex.notebook}.ipynb").is_file()]


@pytest.mark.parametrize("ex", _exercises(), ids=lambda ex: ex.name)
def test_hints_share_no_code_with_the_answer(ex) -> None:
    """Every hint level, in both languages, is an idea or a step, never code of the answer."""
    solution = shape.solution_of(ROOT / "solutions" / f"{ex.notebook}.ipynb", ex.function)
    assert solution, f"{ex.name}: no solution region defines {ex.function}"
    spanish = i18n.translations("es")
    for level, hint in enumerate(ex.hints, 1):
        for text in (hint, spanish.get(hint, hint)):
            shared = shape.code_in_feedback(text, solution)
            assert not shared, f"{ex.name} hint {level} shows the answer's code: {shared}"


def test_the_hint_check_finds_code_in_a_hint() -> None:
    solution = ["right, left = (r + 1) % p, (r - 1) % p", "send = dist.isend(chunks[(r - s) % p], right)"]
    assert shape.code_in_feedback("at step s send chunks[(r - s) % p] to the right", solution)
    assert shape.code_in_feedback("post dist.isend(chunks[k], right) first", solution)
    assert not shape.code_in_feedback("each rank sends to its right neighbour, in p - 1 steps",
                                      solution)


def _user_texts() -> list[Path]:
    return ([*SOLUTIONS, *(p for folder in EDITIONS.values() for p in folder.glob("*.ipynb"))]
            + sorted((ROOT / "solutions").glob("*/*.po"))
            + sorted((ROOT / "course_lib" / "locale").glob("*/*.po")))


@pytest.mark.parametrize("path", _user_texts(), ids=lambda p: p.relative_to(ROOT).as_posix())
def test_no_dated_text_where_a_learner_reads(path: Path) -> None:
    """Dates belong to git's history, not to what a learner reads (prose, outputs, messages)."""
    text = path.read_text(encoding="utf-8")
    if path.suffix == ".po":
        text = "\n".join(e.msgid + "\n" + e.msgstr for e in polib.pofile(str(path)))
    found = sorted(set(DATED.findall(text)))
    assert not found, f"{path.name} carries dates: {found}"
