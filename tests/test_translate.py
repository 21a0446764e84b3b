"""The Spanish edition: catalogues replace text and never code, and stale entries are named."""

import io
import re
import shutil
import tokenize
from pathlib import Path

import nbformat
import polib
import pytest

from course_lib.course import build, shown_text, translate

ROOT = Path(__file__).resolve().parent.parent
FIXTURE = Path(__file__).parent / "fixtures" / "lesson_src" / "solutions" / "90_fixture.ipynb"


@pytest.fixture
def repo(tmp_path: Path) -> Path:
    """A throwaway repository holding the fixture lesson and its Spanish catalogue."""
    for sub in ("notebooks", "course_lib"):
        (tmp_path / sub).mkdir()
    shutil.copytree(FIXTURE.parent, tmp_path / "solutions")
    build.build(tmp_path)
    return tmp_path


def code_tokens(source: str, texts: frozenset[int] = frozenset()) -> list[tuple[int, str]]:
    """The cell's code as tokens, comments left out, and the string tokens at the indices
    `texts` (the English's learner-facing literals) reduced to their prefix and fields:
    what a translation may change is the rest of its text."""
    out: list[tuple[int, str]] = []
    for tok in tokenize.generate_tokens(io.StringIO(shown_text.code_of(source)).readline):
        if tok.type in (tokenize.COMMENT, tokenize.NL):
            continue
        text = tok.string
        if tok.type == tokenize.STRING and len(out) in texts:
            text = re.match(r"[A-Za-z]*", text).group() + "".join(re.findall(r"\{[^{}]*\}", text))
        out.append((tok.type, text))
    return out


def _literal_tokens(source: str) -> frozenset[int]:
    """The indices, among the code tokens, of the string tokens that are learner-facing."""
    # docstrings too: a student notebook's stub has lost the markers that tell a stub
    starts = {(p.where[0], p.where[2]) for p in translate._literals(source, docstrings=True)}
    found, index = set(), 0
    for tok in tokenize.generate_tokens(io.StringIO(shown_text.code_of(source)).readline):
        if tok.type in (tokenize.COMMENT, tokenize.NL):
            continue
        if tok.type == tokenize.STRING and any(
                r == tok.start[0] and tok.start[1] < c <= tok.start[1] + 5 for r, c in starts):
            found.add(index)
        index += 1
    return frozenset(found)


def assert_same_code(english: nbformat.NotebookNode, other: nbformat.NotebookNode) -> None:
    assert [(c.cell_type, c.get("id")) for c in other.cells] == \
           [(c.cell_type, c.get("id")) for c in english.cells]
    for en, es in zip(english.cells, other.cells):
        if en.cell_type == "code":
            texts = _literal_tokens(en.source)
            assert code_tokens(es.source, texts) == code_tokens(en.source, texts), en.get("id")


def _translated(cell, folder: Path, pairs: list[tuple[str, str]]):
    """A notebook of `cell` and its translation by a catalogue of (English, Spanish) pairs."""
    po = polib.POFile()
    for english, spanish in pairs:
        po.append(polib.POEntry(msgctxt=cell.id, msgid=english, msgstr=spanish))
    po.save(str(folder / "x.po"))
    nb = nbformat.v4.new_notebook(cells=[cell])
    return nb, translate.translated(nb, folder / "x.po", "es")


def test_comments_and_printed_headings_change_but_not_code(tmp_path: Path):
    source = ('# Two lines of\n# one paragraph\nx = 1  # after code\n'
              'def f():\n    # inside\n    return "# not a comment"\nprint("Results")\n'
              '#| export\n# NBVAL_IGNORE_OUTPUT\n')
    cell = nbformat.v4.new_code_cell(source, id="c1")
    found = {p.text: p.kind for p in translate.pieces(cell)}
    assert found == {"Two lines of\none paragraph": "comment", "after code": "comment",
                     "inside": "comment", "# not a comment": "returned", "Results": "printed"}
    nb, out = _translated(cell, tmp_path, [
        ("Two lines of\none paragraph", "Dos líneas de\nun párrafo"),
        ("after code", "tras el código"), ("inside", "dentro"),
        ("Results", 'Resultados "finales"')])
    assert out.cells[0].source == (
        '# Dos líneas de\n# un párrafo\nx = 1  # tras el código\n'
        'def f():\n    # dentro\n    return "# not a comment"\nprint("Resultados \\"finales\\"")\n'
        '#| export\n# NBVAL_IGNORE_OUTPUT\n')
    assert out.metadata["course_lib"]["lang"] == "es"
    assert_same_code(nb, out)


def test_fstrings_labels_errors_returns_and_stub_docstrings_keep_their_fields(tmp_path: Path):
    source = ('def f(x):\n    """Sum the shard."""\n    ### BEGIN SOLUTION\n    return x\n'
              '    ### END SOLUTION\nprint(f"rank {r}: {t:.2f} ms", "done")\n'
              'ax.set(xlabel="bytes", title=f"{n} ranks")\nraise ValueError(f"bad {x!r}")\n'
              'print(f"{a} {b}", rb"raw bytes")\ndef g(n):\n    return f"{n} ranks left"\n')
    cell = nbformat.v4.new_code_cell(source, id="c2")
    found = [(p.kind, p.text) for p in translate.pieces(cell)]
    assert found == [("docstring", "Sum the shard."), ("printed", "rank {r}: {t:.2f} ms"),
                     ("printed", "done"), ("label", "bytes"), ("label", "{n} ranks"),
                     ("error", "bad {x!r}"), ("returned", "{n} ranks left")]
    nb, out = _translated(cell, tmp_path, [
        ("Sum the shard.", "Suma el fragmento."),
        ("rank {r}: {t:.2f} ms", 'rank {r}: {t:.2f} ms "medidos"'), ("done", "hecho"),
        ("bytes", "bytes enviados"), ("{n} ranks", "{n} ranks en total"),
        ("bad {x!r}", "{x!r} no vale"), ("{n} ranks left", "quedan {n} ranks")])
    assert out.cells[0].source == (
        'def f(x):\n    """Suma el fragmento."""\n    ### BEGIN SOLUTION\n    return x\n'
        '    ### END SOLUTION\nprint(f"rank {r}: {t:.2f} ms \\"medidos\\"", "hecho")\n'
        'ax.set(xlabel="bytes enviados", title=f"{n} ranks en total")\n'
        'raise ValueError(f"{x!r} no vale")\nprint(f"{a} {b}", rb"raw bytes")\n'
        'def g(n):\n    return f"quedan {n} ranks"\n')
    assert_same_code(nb, out)
    compile(out.cells[0].source, "cell", "exec")


def test_a_translation_that_loses_a_field_is_named(repo: Path):
    src = repo / "solutions" / "90_fixture.ipynb"
    nb = nbformat.read(src, as_version=4)
    nb.cells[3].source += '\nprint(f"{n} ranks agree")'
    nbformat.write(nb, src)
    translate.update(src, "es")
    po = polib.pofile(str(repo / "solutions" / "es" / "90_fixture.po"))
    entry = next(e for e in po if e.msgid == "{n} ranks agree")
    entry.msgstr = "los ranks coinciden"
    po.save()
    assert any("must keep the text's fields, {n}" in line for line in build.stale(repo))


def test_solution_regions_are_not_translated():
    cell = nbformat.v4.new_code_cell(
        "def f(x):\n    # given\n    ### BEGIN SOLUTION\n    # the answer's comment\n"
        "    return x\n    ### END SOLUTION", id="c")
    assert [p.text for p in translate.pieces(cell)] == ["given"]


def test_the_fixture_edition_is_spanish_with_the_same_code(repo: Path):
    es = nbformat.read(repo / "notebooks" / "es" / "90_fixture.ipynb", as_version=4)
    en = nbformat.read(repo / "notebooks" / "90_fixture.ipynb", as_version=4)
    assert es.cells[0].source.startswith("# Lección de prueba")
    assert "print('bien')" in es.cells[3].source
    assert es.metadata["course_lib"]["lang"] == "es"
    assert_same_code(en, es)
    assert build.stale(repo) == []


def test_changed_english_fails_the_check_until_the_entry_is_reviewed(repo: Path):
    src = repo / "solutions" / "90_fixture.ipynb"
    nb = nbformat.read(src, as_version=4)
    nb.cells[0].source = "# Fixture lesson\nUsed by the build tests only."
    nbformat.write(nb, src)
    build.build(repo)
    assert any("90_fixture.ipynb, cell 0 (id cell-0, markdown): the English changed and its "
               "entry is missing" in line for line in build.stale(repo))

    changes = translate.update(src, "es")  # msgmerge: the old translation comes back fuzzy
    assert changes == ["fuzzy: cell 0: '# Fixture lesson\\nUsed by the build tests only.'",
                       "obsolete: cell cell-0: '# Fixture lesson\\nUsed by tests/test_build.py only.'"]
    po = polib.pofile(str(repo / "solutions" / "es" / "90_fixture.po"))
    entry = next(e for e in po if e.msgctxt == "cell-0" and not e.obsolete)
    assert "fuzzy" in entry.flags and entry.msgstr.startswith("# Lección de prueba")
    assert entry.previous_msgid == "# Fixture lesson\nUsed by tests/test_build.py only."
    assert any("cell 0 (id cell-0, markdown): the English changed and its entry is fuzzy"
               in line for line in build.stale(repo))

    entry.msgstr, entry.flags = "# Lección de prueba\nSolo la usan las pruebas del build.", []
    po.save()
    build.build(repo)
    assert build.stale(repo) == []


def test_a_translation_that_drops_a_solution_marker_is_named(repo: Path):
    path = repo / "solutions" / "es" / "90_fixture.po"
    po = polib.pofile(str(path))
    entry = next(e for e in po if "### BEGIN SOLUTION" in e.msgid)
    entry.msgstr = "¿Por qué?"
    po.save()
    assert any("must keep the ### BEGIN/END lines" in line for line in build.stale(repo))


def test_a_lesson_without_a_catalogue_is_named(repo: Path):
    (repo / "solutions" / "es" / "90_fixture.po").unlink()
    assert any("90_fixture.ipynb has no catalogue" in line for line in build.stale(repo))


def test_every_spanish_notebook_has_the_english_code():
    for es_path in sorted((ROOT / "notebooks" / "es").glob("*.ipynb")):
        en = nbformat.read(ROOT / "notebooks" / es_path.name, as_version=4)
        es = nbformat.read(es_path, as_version=4)
        assert es.metadata["course_lib"]["lang"] == "es"
        assert_same_code(en, es)


def test_every_lesson_is_translated_in_full():
    """100% of every lesson's entries are translated and reviewed (none fuzzy), and no markdown
    cell of the Spanish edition is left in English."""
    lessons = sorted(p.name for p in (ROOT / "solutions").glob("*.ipynb"))
    assert translate.pending("es") == ()
    assert translate.problems(ROOT / "solutions", "es") == []
    assert sorted(p.name for p in (ROOT / "notebooks" / "es").glob("*.ipynb")) == lessons
    for name in lessons:
        en = nbformat.read(ROOT / "notebooks" / name, as_version=4)
        es = nbformat.read(ROOT / "notebooks" / "es" / name, as_version=4)
        for a, b in zip(en.cells, es.cells):
            if a.cell_type == "markdown" and a.source.strip():
                assert b.source != a.source, f"{name}, cell {a.get('id')}: still English"


FENCE = re.compile(r"```.*?```", re.S)
CODE_SPAN = re.compile(r"`([^`]+)`")
THOUSANDS = re.compile(r"(?<=\d)[,\u202f\u00a0 ](?=\d{3}(?!\d))")
NUMBER = re.compile(r"(?<![\w.])\d+(?:[.,]\d+)*")


def _code_like(span: str) -> bool:
    """`dist.all_reduce(t, op)` is code; `(input, what backward starts from)` is prose set in
    code font, which a translation translates."""
    return not re.search(r"[A-Za-z] [A-Za-z]", span)


def test_translations_keep_every_number_and_piece_of_code():
    """A mechanical check of meaning beside the human review: every number (in the English
    format) and every code span of an entry's English stands in its Spanish too."""
    for po_path in sorted((ROOT / "solutions" / "es").glob("*.po")):
        for entry in polib.pofile(str(po_path)):
            if entry.obsolete:
                continue
            en, es = (" ".join(FENCE.sub("", t).split()) for t in (entry.msgid, entry.msgstr))
            # Thousands grouped as each language writes them (16,384 in English; 16 384 in
            # Spanish, where a comma would read as a decimal point) are the same number.
            en, es = (THOUSANDS.sub("", t) for t in (en, es))
            where = f"{po_path.name}, cell {entry.msgctxt}"
            assert set(NUMBER.findall(en)) <= set(NUMBER.findall(es)), where
            spans = {s for s in CODE_SPAN.findall(en) if _code_like(s)}
            assert spans <= set(CODE_SPAN.findall(es)), (where, spans - set(CODE_SPAN.findall(es)))
