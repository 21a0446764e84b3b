"""Extracting the package's messages into its gettext catalogues (`course_lib/locale/LANG/`):
every `_("...")` and `N_("...")` literal, every `ngettext("...", "...", n)` pair (an entry with
plural forms), every exercise's `hints=` and every case's `label=`.
A lesson's exercise messages go to `lessonNN.po` (so each lesson's catalogue is edited on its
own), everything else to `course_lib.po`; merged as msgmerge would.

    python -m course_lib.course.messages extract [lessonNN ...]
"""

from __future__ import annotations

import ast
import re
import sys
from pathlib import Path

from course_lib.i18n import LANGUAGES, PACKAGE_DIR, package_po


Message = str | tuple[str, str]  # a text, or (singular, plural) for an entry with plural forms


def msgid(message: Message) -> str:
    return message if isinstance(message, str) else message[0]


def extract(root: Path = PACKAGE_DIR) -> dict[Message, list[str]]:
    """{message: [where, ...]} of every `_("...")` and `N_("...")` call and every exercise's
    `hints=("...", ...)` and case `label="..."` in the package."""
    found: dict[str, list[str]] = {}
    for path in sorted(root.rglob("*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for node in ast.walk(tree):
            texts = []
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
                    and node.func.id in ("_", "N_") and node.args
                    and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str)):
                texts.append(node.args[0].value)
            if (isinstance(node, ast.Call) and getattr(node.func, "id", None) == "ngettext"
                    and len(node.args) >= 2 and all(isinstance(a, ast.Constant)
                                                    and isinstance(a.value, str)
                                                    for a in node.args[:2])):
                texts.append((node.args[0].value, node.args[1].value))
            if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "case":
                texts += [kw.value.value for kw in node.keywords if kw.arg == "label"
                          and isinstance(kw.value, ast.Constant)
                          and isinstance(kw.value.value, str)]
            if isinstance(node, ast.keyword) and node.arg == "hints" and \
                    isinstance(node.value, (ast.Tuple, ast.List)):
                texts += [e.value for e in node.value.elts
                          if isinstance(e, ast.Constant) and isinstance(e.value, str)]
            for text in texts:
                where = f"{path.relative_to(root.parent).as_posix()}:{node.lineno}" \
                    if hasattr(node, "lineno") else path.relative_to(root.parent).as_posix()
                found.setdefault(text, []).append(where)
    return found


# A lesson's file, or a module of its package (`exercises/lesson08/zero.py`).
_LESSON_FILE = re.compile(
    r"course_lib/course/grading/(?:exercises|references)/(lesson\w+)(?:/\w+)?\.py$")


def catalogue_name(where: list[str]) -> str:
    """Which catalogue holds a message found at `where`: its lesson's, when every place that
    uses it is that lesson's exercise file, else the package's."""
    owners = {m.group(1) if (m := _LESSON_FILE.search(w.rsplit(":", 1)[0])) else "course_lib"
              for w in where}
    return owners.pop() if len(owners) == 1 else "course_lib"


def split(messages: dict[Message, list[str]]) -> dict[str, dict[Message, list[str]]]:
    """{catalogue name: its messages} for `messages` as `extract` found them."""
    found: dict[str, dict[str, list[str]]] = {}
    for text, where in messages.items():
        found.setdefault(catalogue_name(where), {})[text] = where
    return found


def merge(po_path: Path, messages: dict[Message, list[str]]) -> list[str]:
    """Bring a catalogue up to the messages found, as msgmerge would: new ones untranslated,
    vanished ones obsolete. Returns what changed, one line each."""
    import polib

    po = (polib.pofile(str(po_path), wrapwidth=0) if po_path.exists()
          else polib.POFile(wrapwidth=0))
    po.metadata = po.metadata or {"Content-Type": "text/plain; charset=UTF-8",
                                  "Language": po_path.parent.name}
    po.metadata.setdefault("Plural-Forms", "nplurals=2; plural=(n != 1);")
    known = {e.msgid: e for e in po}
    changed = []
    for text, where in messages.items():
        entry = known.get(msgid(text))
        if entry is None:
            entry = (polib.POEntry(msgid=text, msgstr="") if isinstance(text, str) else
                     polib.POEntry(msgid=text[0], msgid_plural=text[1],
                                   msgstr_plural={0: "", 1: ""}))
            po.append(entry)
            changed.append(f"new: {msgid(text)[:60]}")
        entry.obsolete = False
        entry.occurrences = [(w.rsplit(":", 1)[0], w.rsplit(":", 1)[1]) for w in where]
    ids = {msgid(text) for text in messages}
    for entry in list(po):
        if entry.msgid not in ids and not entry.obsolete:
            if not (entry.msgstr or any(entry.msgstr_plural.values())):  # never translated: nothing to keep for its return
                po.remove(entry)
                changed.append(f"removed: {entry.msgid[:60]}")
                continue
            entry.obsolete = True
            changed.append(f"obsolete: {entry.msgid[:60]}")
    po_path.parent.mkdir(parents=True, exist_ok=True)
    po.save(str(po_path))
    return changed


def main(argv: list[str] | None = None) -> int:
    """`python -m course_lib.course.messages extract [NAME ...]`: update the package catalogues
    from the code (only those named, e.g. `lesson04`, when names are given)."""
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] != ["extract"]:
        print(__doc__)
        return 2
    parts = split(extract())
    for lang in LANGUAGES[1:]:
        folder = PACKAGE_DIR / "locale" / lang
        names = set(argv[1:]) or set(parts) | {p.stem for p in folder.glob("*.po")}
        for name in sorted(names):
            for line in merge(package_po(lang, name), parts.get(name, {})):
                print(f"{lang}/{name}: {line}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
