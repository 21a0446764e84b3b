"""Learner-facing English that no catalogue covers, found statically (no kernel, no engine).

What a learner reads while a lesson runs: every printed string (plain, f-string, or the literal
parts of `print("...", x)`), plot titles, axis labels and legends, the docstrings of exercise
stubs, and every error raised with a message. In a solution notebook's code cell (outside the
answer and hidden-test regions) such a text is covered when `solutions/es/NN_name.po` has a
translated entry for it in that cell; in the package (the components and the course modules the
lessons call) when it goes through `_()` / `N_()` / `ngettext()` (so `course_lib/locale/es/`
holds it: tests/test_i18n.py checks that).

Known gaps are listed in tests/fixtures/untranslated.txt, one `path<TAB>text` a line. The test
fails on any gap not listed (new English a learner would read untranslated) and on a listed gap
that is gone (so the list only shrinks). After mending some, or deliberately accepting a new one,
rewrite the list: `.venv/bin/python tests/test_untranslated.py --update`.
"""

from __future__ import annotations

import ast
import re
import sys
from pathlib import Path

import nbformat
import polib

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from course_lib.course import shown_text, translate  # noqa: E402

KNOWN = ROOT / "tests" / "fixtures" / "untranslated.txt"
PACKAGE = ["course_lib/*.py", "course_lib/dist/*.py", "course_lib/mpi/*.py", "course_lib/cluster/*.py",
           "course_lib/course/overlay.py", "course_lib/course/demos/*.py",
           "course_lib/course/bench/*.py"]
# Words a Spanish text keeps as they are: units, the course's English terms, names.
KEPT = {"rank", "ranks", "engine", "engines", "bucket", "buckets", "kib", "mib", "gib", "kb",
        "mb", "gb", "ms", "us", "ns", "true", "false", "none", "torch", "mpi", "gloo", "nccl",
        "ddp", "zero", "fsdp", "gpipe", "cpu", "gpu", "fp", "bf", "ok", "id", "max", "min",
        "all", "reduce", "gather", "scatter", "broadcast", "shm", "tcp", "vs", "x", "adam", "sgd",
        "mse", "gelu", "llama", "gpt", "nan", "inf", "sha", "json", "posix", "pickle", "tp",
        "pp", "dp", "cp", "ep", "moe", "rs", "ag", "ar", "hook", "hooks", "checkpoint", "step"}
_WORD = re.compile(r"[A-Za-zÀ-ÿ]{2,}")


def english(text: str) -> bool:
    """Whether `text` holds a word a Spanish reader would read as English prose: fields, code
    spans, identifiers, paths and the course's kept terms do not count."""
    text = re.sub(r"\{[^{}]*\}|`[^`]*`|\S*[_./\\()\[\]=<>%]\S*", " ", text)
    words = [w.lower() for w in _WORD.findall(text)]
    return any(w not in KEPT for w in words) and any(len(w) >= 3 for w in words
                                                      if w not in KEPT)


def _text(node: ast.expr) -> str:
    """The string a literal or f-string shows (an f-string's fields as `{...}`)."""
    if isinstance(node, ast.Constant):
        return node.value
    return "".join(v.value if isinstance(v, ast.Constant) else "{" + ast.unparse(v.value) + "}"
                   for v in node.values)


def shown(source: str) -> list[tuple[str, str]]:
    """(kind, text) of every learner-facing literal of a package module in English."""
    return [(kind, _text(node)) for node, kind in shown_text.shown_literals(source)
            if english(_text(node))]


def notebook_gaps(src: Path, po_path: Path) -> set[tuple[str, str]]:
    """{(where, text)} a solution notebook shows in English that its catalogue does not cover."""
    po = polib.pofile(str(po_path)) if po_path.is_file() else []
    covered = {(e.msgctxt or "", e.msgid) for e in po
               if e.msgstr and "fuzzy" not in e.flags and not e.obsolete}
    gaps = set()
    for cell in nbformat.read(src, as_version=4).cells:
        for piece in translate.pieces(cell):
            if (piece.kind not in ("markdown", "comment") and english(piece.text)
                    and (cell.get("id", ""), piece.text) not in covered):
                gaps.add((f"solutions/{src.name}", f"{piece.kind}: {piece.text}"))
    return gaps


def package_gaps() -> set[tuple[str, str]]:
    """{(module, text)} the package raises, prints or plots in English outside `_()`."""
    gaps = set()
    for pattern in PACKAGE:
        for path in sorted(ROOT.glob(pattern)):
            where = path.relative_to(ROOT).as_posix()
            for kind, text in shown(path.read_text(encoding="utf-8")):
                gaps.add((where, f"{kind}: {text}"))
    return gaps


def gaps() -> set[tuple[str, str]]:
    found = package_gaps()
    for src in sorted((ROOT / "solutions").glob("*.ipynb")):
        found |= notebook_gaps(src, translate.catalogue_path(src.parent, "es", src.stem))
    return found


def _line(where: str, text: str) -> str:
    return f"{where}\t{text!r}"


def known() -> set[str]:
    return set(KNOWN.read_text(encoding="utf-8").splitlines()) if KNOWN.is_file() else set()


def test_no_new_learner_facing_english():
    found = {_line(*g) for g in gaps()}
    listed = known()
    new, gone = sorted(found - listed), sorted(listed - found)
    assert not new, (
        f"{len(new)} learner-facing text(s) no catalogue covers: translate them (a notebook's "
        "printed heading through solutions/es/NN.po, a package message through `_()` and "
        "`python -m course_lib.course.messages extract`), or list them deliberately "
        "(`python tests/test_untranslated.py --update`):\n" + "\n".join(new[:40]))
    assert not gone, (
        f"{len(gone)} listed gap(s) are mended or gone: shrink the list "
        "(`python tests/test_untranslated.py --update`):\n" + "\n".join(gone[:40]))


def test_a_planted_print_is_found(tmp_path):
    """An untranslated f-string print added to a lesson is a gap; its catalogue entry covers
    a plain printed heading."""
    src = ROOT / "solutions" / "00_cluster.ipynb"
    nb = nbformat.read(src, as_version=4)
    planted = nbformat.v4.new_code_cell('n = 3\nprint(f"the cluster has {n} idle engines")\n'
                                        'print("every rank said hello")')
    planted.id = "planted0"
    nb.cells.append(planted)
    copy = tmp_path / src.name
    nbformat.write(nb, copy)
    po = polib.pofile(str(translate.catalogue_path(src.parent, "es", src.stem)))
    po.append(polib.POEntry(msgctxt="planted0", msgid="every rank said hello",
                            msgstr="cada rank saludó"))
    po.save(str(tmp_path / f"{src.stem}.po"))
    found = notebook_gaps(copy, tmp_path / f"{src.stem}.po") - notebook_gaps(
        src, translate.catalogue_path(src.parent, "es", src.stem))
    assert found == {("solutions/00_cluster.ipynb", "printed: the cluster has {n} idle engines")}


def test_what_counts_as_english():
    assert english("without feedback the loss never moves:")
    assert english("MSE loss") and english("ms since forward started (rank 0)")
    assert not english("rank {rank}: {x}") and not english("4 KiB, 1 MiB")
    assert not english("`ddp.grad_divisor` =") and not english("all_reduce x4")


if __name__ == "__main__":
    if sys.argv[1:] == ["--update"]:
        lines = sorted({_line(*g) for g in gaps()})
        KNOWN.write_text("\n".join(lines) + "\n", encoding="utf-8")
        print(f"wrote {len(lines)} known gaps to {KNOWN.relative_to(ROOT)}")
    else:
        print(__doc__)
