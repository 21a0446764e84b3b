"""The package's messages in Spanish: the catalogue matches the code, and a learner meets it."""

from pathlib import Path

import polib
import torch

from course_lib import i18n
from course_lib.course import messages
from course_lib.dist.errors import describe
from course_lib.course.grading import Exercise, case, register
from course_lib.course.grading.learner import grade_function
from course_lib.processes import RankError

ROOT = Path(__file__).resolve().parent.parent

register(Exercise(
    name="lesson98.double", notebook="98_i18n_test", params=("x",),
    cases=[case(torch.arange(3.0)), case(torch.tensor([-1.0, 4.0]))],
    reference=lambda x: 2 * x, points=2, hints=("multiply by two",)))


def double_wrong(x):  # right on the first case, wrong sign handling on the second
    return 2 * x.abs()


def test_the_catalogue_is_the_code_s_messages_all_translated():
    """`python -m course_lib.course.messages extract` is up to date, and every message is translated,
    reviewed (none fuzzy) and keeps exactly the fields it fills in."""
    parts = messages.split(messages.extract())
    files = {p.stem for p in i18n.package_po("es").parent.glob("*.po")}
    assert files == set(parts), "a catalogue without messages, or messages without one"
    for name, found in parts.items():
        entries = {e.msgid: e for e in polib.pofile(str(i18n.package_po("es", name)))
                   if not e.obsolete}
        assert set(entries) == {messages.msgid(m) for m in found}, name
        for msgid, entry in entries.items():
            assert i18n.catalogue(i18n.package_po("es", name)).get(msgid), (name, msgid)
            texts = ([entry.msgstr] if not entry.msgid_plural else
                     list(entry.msgstr_plural.values()))
            for text in texts:
                assert i18n.fields_of(text) == i18n.fields_of(msgid), (name, msgid)


def test_check_feedback_is_written_in_the_edition_s_language(monkeypatch):
    english = grade_function("lesson98.double", double_wrong)
    assert english.reason.startswith("1 of 2 cases failed; first: ")
    assert "Hint 1: multiply by two" in str(english.with_hints(1))
    with i18n.language("es"):
        spanish = grade_function("lesson98.double", double_wrong)
        table = str(spanish.with_hints(1))
    assert spanish.points == english.points == 1.0
    assert spanish.reason.startswith("fallaron 1 de 2 casos; el primero: ")
    assert "los valores difieren: máx. |obtenido - esperado| = 4 en (0,)" in spanish.reason
    assert "lesson98.double: 1 / 2 puntos." in table and "FALLA" in table
    assert "Pista 1: multiply by two" in table  # a hint not in the catalogue stays English
    monkeypatch.setenv(i18n.LANG_ENV, "es")  # what `course.py lab --lang es` sets
    assert grade_function("lesson98.double", double_wrong).reason.startswith("fallaron")


def test_cluster_and_dist_errors_in_spanish():
    with i18n.language("es"):
        assert describe(0, "recv", "recv from", 2, "boom") == \
            "rank 0: recv (desde el rank 2) falló: boom"
        assert str(RankError("run(f)", {3: "x"})) == "run(f): fallaron 1 rank(s)\n  rank 3: x"
    assert describe(0, "recv", "recv from", 2, "boom") == "rank 0: recv from rank 2 failed: boom"


def test_the_edition_is_read_from_the_notebook():
    assert i18n.language_of(ROOT / "notebooks" / "es" / "00_cluster.ipynb") == "es"
    assert i18n.language_of(ROOT / "notebooks" / "00_cluster.ipynb") is None
    assert i18n.language_of({"metadata": {"course_lib": {"lang": "xx"}}}) is None
    assert i18n.language_of({"metadata": {"course_lib": {"lang": ["es"]}}}) is None


def test_a_kernel_running_a_spanish_notebook_speaks_spanish(monkeypatch):
    """JupyterLab names the notebook a kernel runs: errors raised outside any check (the
    cluster's, say) follow that notebook's edition without COURSE_LANG."""
    monkeypatch.delenv(i18n.LANG_ENV, raising=False)
    monkeypatch.setenv("JPY_SESSION_NAME", str(ROOT / "notebooks" / "es" / "00_cluster.ipynb"))
    assert i18n.current() == "es"
    assert str(RankError("run(f)", {0: "x"})).startswith("run(f): fallaron 1 rank(s)")
    monkeypatch.setenv("JPY_SESSION_NAME", str(ROOT / "notebooks" / "00_cluster.ipynb"))
    assert i18n.current() == "en"


def test_the_flight_recorder_explains_a_hang_in_spanish():
    from course_lib.dist.flight import Entry, diagnose

    stuck = Entry(seq=3, op="all_reduce", dtype="float32", shape=[1024], start=0.0)
    records = {1: [dict(vars(Entry(3, "all_reduce", "float32", [1024], 0.0, 1.0, "completed")))],
               2: [dict(vars(Entry(2, "barrier", None, None, 0.0, 1.0, "completed")))], 3: None}
    english = diagnose(stuck, "world", records)
    assert english == ("rank 1 completed it; rank 2 last completed #2 and is not in a collective "
                       "(it has not called #3); rank 3 did not answer (its process may be gone)")
    with i18n.language("es"):
        assert diagnose(stuck, "world", records) == (
            "el rank 1 la completó; el rank 2 completó por última vez la #2 y no está en "
            "ninguna colectiva (no ha llamado a la #3); el rank 3 no respondió (quizá su "
            "proceso ya no existe)")


def test_the_check_table_s_case_labels_in_spanish():
    from course_lib.course.catalogue import get_exercise

    ex = get_exercise("lesson03.shard_indices")
    assert ex.cases[0].describe(ex.function) == "12 samples, 3 ranks, rank 1, in order"
    with i18n.language("es"):
        assert ex.cases[0].describe(ex.function) == "12 muestras, 3 ranks, rank 1, en orden"


def test_a_count_chooses_the_plural_form_in_both_languages(tmp_path, monkeypatch):
    """`ngettext` follows the count and the catalogue's plural forms; a plural entry missing
    a form falls back to English rather than showing an empty line."""
    import polib

    po = polib.POFile()
    po.metadata = {"Plural-Forms": "nplurals=2; plural=(n != 1);"}
    po.append(polib.POEntry(msgid="{n} rank waits", msgid_plural="{n} ranks wait",
                            msgstr_plural={0: "{n} rank espera", 1: "{n} ranks esperan"}))
    po.append(polib.POEntry(msgid="{n} message", msgid_plural="{n} messages",
                            msgstr_plural={0: "{n} mensaje", 1: ""}))
    folder = tmp_path / "locale" / "es"
    folder.mkdir(parents=True)
    po.save(str(folder / "course_lib.po"))
    monkeypatch.setattr(i18n, "PACKAGE_DIR", tmp_path)
    said = {(lang, n): i18n.ngettext("{n} rank waits", "{n} ranks wait", n)
            for lang in i18n.LANGUAGES for n in (0, 1, 2)
            for _ in [monkeypatch.setenv(i18n.LANG_ENV, lang)]}
    assert said == {("en", 0): "0 ranks wait", ("en", 1): "1 rank waits", ("en", 2): "2 ranks wait",
                    ("es", 0): "0 ranks esperan", ("es", 1): "1 rank espera",
                    ("es", 2): "2 ranks esperan"}
    monkeypatch.setenv(i18n.LANG_ENV, "es")
    assert i18n.ngettext("{n} message", "{n} messages", 3) == "3 messages"


def test_the_overlay_says_which_code_runs_in_spanish(tmp_path, monkeypatch):
    from course_lib.course import overlay

    monkeypatch.setenv("COURSE_LIB_HOME", str(tmp_path))
    monkeypatch.setenv(i18n.LANG_ENV, "es")
    line = overlay.resolve("ddp").line
    assert line.startswith("course_lib.ddp: la referencia: tu lección 04b"), line
