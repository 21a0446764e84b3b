"""A lesson in another language: its English source with every markdown cell, code comment and
text a learner reads from the code (printed, plotted, raised, an exercise stub's docstring)
replaced from the lesson's gettext catalogue; the code itself never changes, only the text of
those string literals (an f-string's `{fields}` kept as they are).

Catalogues live beside the source, `solutions/LANG/NN_name.po`, one entry per piece of text:
msgctxt is the cell's id, msgid the English, `#: NN_name.ipynb:CELL` where it is. They are
edited with the ordinary tools (Poedit, Weblate); `python -m course_lib.course.translate update
[LESSON ...]` brings them up to the English as `msgmerge --previous` does (a changed text keeps
its old translation, marked fuzzy, with the old English beside it), and `course.py build
--check` fails while any entry is missing, untranslated or fuzzy, naming the lesson and cell.
"""

from __future__ import annotations

import copy
import difflib
import io
import re
import sys
import tokenize
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from course_lib.course.exports import is_exported
from course_lib.course.shown_text import code_of, shown_literals
from course_lib.course.paths import ROOT

if TYPE_CHECKING:
    import nbformat
    import polib

EDITIONS = ("es",)
# Lessons whose Spanish catalogue is not written yet: `build --check` lists them instead of
# failing, and fails once one of them is complete (so this list cannot go stale). A new lesson
# goes here until its catalogue is translated.
PENDING: dict[str, tuple[str, ...]] = {"es": ()}
# Comments that are markers for tools, not prose: never translated.
_MARKER = re.compile(r"^(\||#|\s*(NBVAL_|noqa|type:|YOUR CODE HERE|pragma))")  # after the #
_SOURCE_MARKERS = re.compile(r"^\s*### (BEGIN|END) (SOLUTION|HIDDEN TESTS)\s*$", re.M)
_FIELD = re.compile(r"\{[^{}]*\}")
KINDS = {"markdown": "markdown cell", "comment": "comment in a code cell",
         "printed": "text a code cell prints", "label": "a plot's title, axis label or legend",
         "error": "an error message a code cell raises",
         "returned": "text a function of a code cell returns (its cell prints it)",
         "docstring": "the docstring of an exercise's stub"}
CODE_TEXT = ("printed", "label", "error", "returned")  # string literals, f-strings among them

@dataclass(frozen=True)
class Piece:
    """One translatable text of a cell: kind is "markdown", "comment" or one of
    `shown_literals`' ("printed", "label", "error", "returned", "docstring"); `where`
    is (first line, last line, start column, end column) in the cell's source."""

    kind: str
    text: str
    where: tuple[int, int, int, int] = (0, 0, 0, 0)


def _comments(source: str) -> list[Piece]:
    """The code cell's comments: a run of whole-line comments at one indentation is one piece
    (a paragraph), a comment after code is one piece."""
    try:
        tokens = [t for t in tokenize.generate_tokens(io.StringIO(source).readline)
                  if t.type == tokenize.COMMENT]
    except (tokenize.TokenError, IndentationError, SyntaxError):
        return []
    lines = source.split("\n")
    pieces: list[Piece] = []
    for tok in tokens:
        (row, col), text = tok.start, tok.string[1:].strip()
        if _MARKER.match(tok.string[1:]) or not re.search(r"[A-Za-z]", text):
            continue
        whole = not lines[row - 1][:col].strip()
        last = pieces[-1] if pieces else None
        if whole and last and last.kind == "comment" and last.where[1] == row - 1 \
                and last.where[2] == col and not lines[row - 2][:col].strip():
            pieces[-1] = Piece("comment", f"{last.text}\n{text}", (last.where[0], row, col, -1))
        else:
            pieces.append(Piece("comment", text, (row, row, col, -1)))
    return pieces


def _column(line: str, byte_offset: int) -> int:
    """ast's byte offset in `line` as a character column (tokenize's)."""
    return len(line.encode("utf-8")[:byte_offset].decode("utf-8", errors="ignore"))


def _literals(source: str, docstrings: bool) -> list[Piece]:
    """The text inside the quotes of each string token of `shown_literals` (an implicit
    concatenation gives one piece a token) that holds a word outside its `{fields}`."""
    lines = source.split("\n")
    spans = []
    for node, kind in shown_literals(source, docstrings, returned=True):
        start = (node.lineno, _column(lines[node.lineno - 1], node.col_offset))
        end = (node.end_lineno, _column(lines[node.end_lineno - 1], node.end_col_offset))
        spans.append((start, end, kind))
    if not spans:
        return []
    try:
        tokens = [t for t in tokenize.generate_tokens(io.StringIO(code_of(source)).readline)
                  if t.type == tokenize.STRING]
    except (tokenize.TokenError, IndentationError, SyntaxError):
        return []
    found = []
    for tok in tokens:
        kind = next((k for start, end, k in spans if start <= tok.start and tok.end <= end), None)
        if kind is None:
            continue
        prefix = re.match(r"[A-Za-z]*", tok.string).group()
        quote = tok.string[len(prefix):len(prefix) + 3]
        quote = quote if quote in ('"""', "'''") else quote[0]
        if "r" in prefix.lower() or "b" in prefix.lower():
            continue  # raw and bytes literals: code, not prose
        body = tok.string[len(prefix) + len(quote):-len(quote)]
        if not re.search(r"[A-Za-z]{2}", _FIELD.sub(" ", body) if "f" in prefix.lower()
                         else body):
            continue
        (row, col), (end_row, end_col) = tok.start, tok.end
        found.append(Piece(kind, body, (row, end_row, col + len(prefix) + len(quote),
                                        end_col - len(quote))))
    return found


def _hidden_lines(source: str) -> set[int]:
    """Lines (1-based) inside solution and hidden-test regions: the student release drops
    them, so a translated edition never shows their comments."""
    hidden, inside = set(), False
    for row, line in enumerate(source.split("\n"), 1):
        marker = _SOURCE_MARKERS.match(line)
        if marker:
            inside = marker.group(1) == "BEGIN"
        if inside or marker:
            hidden.add(row)
    return hidden


def pieces(cell: nbformat.NotebookNode) -> list[Piece]:
    """What of a cell a translator translates, in order."""
    if cell.cell_type == "markdown":
        return [Piece("markdown", cell.source)] if cell.source.strip() else []
    if cell.cell_type == "code":
        hidden = _hidden_lines(cell.source)
        # An exported cell's messages are the package module's: `_()` and its catalogues
        # translate them; a stub's docstring is read here.
        literals = [p for p in _literals(cell.source, bool(hidden))
                    if p.kind == "docstring" or not is_exported(cell.source)]
        found = [p for p in _comments(cell.source) + literals
                 if not hidden.intersection(range(p.where[0], p.where[1] + 1))]
        return sorted(found, key=lambda p: p.where)
    return []


def _apply(source: str, found: list[tuple[Piece, str]]) -> str:
    """`source` with each piece replaced by its translation, from the last piece up."""
    lines = source.split("\n")
    for piece, text in sorted(found, key=lambda x: x[0].where, reverse=True):
        first, last, col, end = piece.where
        if piece.kind not in ("comment", "markdown"):  # a string literal's text
            quote = lines[first - 1][col - 1]
            if lines[first - 1][col - 3:col] != quote * 3:  # one quote: escape the text's own
                text = re.sub(r"(?<!\\)" + re.escape(quote), "\\" + quote, text)
            lines[first - 1:last] = (lines[first - 1][:col] + text + lines[last - 1][end:]
                                     ).split("\n")
        elif first == last and lines[first - 1][:col].strip():  # after code: one line
            lines[first - 1] = lines[first - 1][:col] + "# " + " ".join(text.split("\n"))
        else:
            indent = lines[first - 1][:col]
            lines[first - 1:last] = [(indent + "# " + t).rstrip() for t in text.split("\n")]
    return "\n".join(lines)


def catalogue_path(solutions: Path, lang: str, lesson: str) -> Path:
    return Path(solutions) / lang / f"{lesson}.po"


def _entries(po: polib.POFile) -> dict[tuple[str, str], polib.POEntry]:
    return {(e.msgctxt or "", e.msgid): e for e in po if not e.obsolete}


def _load(path: Path) -> polib.POFile | None:
    import polib

    return polib.pofile(str(path)) if path.is_file() else None


def translated(nb: nbformat.NotebookNode, po_path: Path, lang: str) -> nbformat.NotebookNode:
    """The notebook in `lang`: each piece with a translated, non-fuzzy entry replaced (the
    others stay English; `problems` names them); its metadata says the language."""
    po = _load(po_path)
    table = {k: e.msgstr for k, e in _entries(po).items()
             if e.msgstr and "fuzzy" not in e.flags} if po is not None else {}
    out = copy.deepcopy(nb)
    for cell in out.cells:
        found = [(p, table[(cell.get("id", ""), p.text)]) for p in pieces(cell)
                 if (cell.get("id", ""), p.text) in table]
        if cell.cell_type == "markdown" and found:
            cell.source = found[0][1]
        elif found:
            cell.source = _apply(cell.source, found)
    out.metadata.setdefault("course_lib", {})["lang"] = lang
    return out


def problems(solutions: Path, lang: str) -> list[str]:
    """Why the `lang` edition is not complete, one line per piece: missing, untranslated or
    fuzzy entries, translations that lost a solution marker, pending lessons."""
    found = []
    for src in sorted(Path(solutions).glob("*.ipynb")):
        found += lesson_problems(src, lang)
    return found


def lesson_problems(src: Path, lang: str) -> list[str]:
    import nbformat

    lesson, po_path = src.stem, catalogue_path(src.parent, lang, src.stem)
    pending = lesson in PENDING.get(lang, ())
    po = _load(po_path)
    if po is None:
        return [] if pending else [
            f"{lang}: {src.name} has no catalogue {po_path.name}: run `python -m "
            f"course_lib.course.translate update {lesson}`, then translate it"]
    entries, lines = _entries(po), []
    for i, cell in enumerate(nbformat.read(src, as_version=4).cells):
        for piece in pieces(cell):
            where = f"{lang}: {src.name}, cell {i} (id {cell.get('id', '?')}, {piece.kind})"
            entry = entries.get((cell.get("id", ""), piece.text))
            if entry is None:
                lines.append(f"{where}: the English changed and its entry is missing from "
                             f"{po_path.name}: run `python -m course_lib.course.translate update "
                             f"{lesson}`")
            elif "fuzzy" in entry.flags:
                lines.append(f"{where}: the English changed and its entry is fuzzy: review "
                             f"the translation in {po_path.name} and clear the fuzzy flag")
            elif not entry.msgstr:
                lines.append(f"{where}: not translated yet in {po_path.name}")
            elif (_SOURCE_MARKERS.findall(entry.msgid) != _SOURCE_MARKERS.findall(entry.msgstr)):
                lines.append(f"{where}: the translation must keep the ### BEGIN/END lines")
            elif piece.kind in CODE_TEXT and (  # an f-string's fields are code
                    sorted(_FIELD.findall(entry.msgid)) != sorted(_FIELD.findall(entry.msgstr))):
                lines.append(f"{where}: the translation must keep the text's fields, "
                             f"{' '.join(_FIELD.findall(entry.msgid))} (they are code)")
    if pending and not lines:
        return [f"{lang}: {lesson} is complete: remove it from course_lib.course.translate.PENDING"]
    return [] if pending else lines


def pending(lang: str) -> tuple[str, ...]:
    return PENDING.get(lang, ())


# -- keeping catalogues up to the English (msgmerge) ----------------------------------------


def update(src: Path, lang: str) -> list[str]:
    """Bring `src`'s catalogue up to its English, as `msgmerge --previous` would: new text
    untranslated, changed text fuzzy with its old translation, vanished text obsolete."""
    import nbformat
    import polib

    po_path = catalogue_path(src.parent, lang, src.stem)
    old = _load(po_path) or polib.POFile()
    old.metadata = old.metadata or {"Project-Id-Version": f"course_lib {src.stem}",
                                    "Language": lang, "MIME-Version": "1.0",
                                    "Content-Type": "text/plain; charset=UTF-8",
                                    "Content-Transfer-Encoding": "8bit"}
    known, changes = _entries(old), []
    wanted: dict[tuple[str, str], polib.POEntry] = {}
    nb = nbformat.read(src, as_version=4)
    for i, cell in enumerate(nb.cells):
        for piece in pieces(cell):
            key = (cell.get("id", ""), piece.text)
            if key in wanted:
                wanted[key].occurrences.append((src.name, str(i)))
                continue
            entry = known.get(key) or _fuzzy_match(key, known, i, changes)
            entry.occurrences = [(src.name, str(i))]
            entry.comment = KINDS[piece.kind]
            wanted[key] = entry
    used = {id(e) for e in wanted.values()}
    gone = [e for e in known.values() if id(e) not in used]
    changes += [f"obsolete: cell {e.msgctxt}: {e.msgid[:50]!r}" for e in gone if e.msgstr]
    po = polib.POFile(wrapwidth=0)
    po.metadata = old.metadata
    po.extend(wanted.values())
    for e in gone:
        if e.msgstr:  # kept, as msgmerge keeps them, for a text that comes back
            e.obsolete, e.occurrences = True, []
            po.append(e)
    po_path.parent.mkdir(parents=True, exist_ok=True)
    po.save(str(po_path))
    return changes


def _fuzzy_match(key: tuple[str, str], known: dict, index: int, changes: list) -> polib.POEntry:
    """A new entry for changed English: the closest old text of the same cell lends its
    translation (fuzzy, with the old English as previous msgid)."""
    import polib

    ctx, text = key
    near = [e for (c, m), e in known.items() if c == ctx and m != text and e.msgstr]
    best = max(near, key=lambda e: difflib.SequenceMatcher(None, e.msgid, text).ratio(),
               default=None)
    if best is not None and difflib.SequenceMatcher(None, best.msgid, text).ratio() >= 0.5:
        changes.append(f"fuzzy: cell {index}: {text[:50]!r}")
        return polib.POEntry(msgctxt=ctx, msgid=text, msgstr=best.msgstr, flags=["fuzzy"],
                             previous_msgid=best.msgid)
    changes.append(f"new: cell {index}: {text[:50]!r}")
    return polib.POEntry(msgctxt=ctx, msgid=text, msgstr="")


def main(argv: list[str] | None = None) -> int:
    """`python -m course_lib.course.translate update [LESSON ...] [--lang es]`."""
    import argparse

    parser = argparse.ArgumentParser(prog="python -m course_lib.course.translate",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("command", choices=["update", "status"])
    parser.add_argument("lessons", nargs="*", help="e.g. 03 or 03_data_sharding (default: all)")
    parser.add_argument("--lang", default="es", choices=EDITIONS)
    parser.add_argument("--solutions", type=Path,
                        default=ROOT / "solutions")
    args = parser.parse_args(argv)
    sources = [s for s in sorted(args.solutions.glob("*.ipynb"))
               if not args.lessons or any(s.stem.startswith(x) for x in args.lessons)]
    if not sources:
        print(f"no lesson matches {args.lessons} in {args.solutions}", file=sys.stderr)
        return 2
    for src in sources:
        if args.command == "update":
            for line in update(src, args.lang):
                print(f"{src.stem}: {line}")
        else:
            for line in lesson_problems(src, args.lang):
                print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
