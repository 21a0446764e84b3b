"""The language a learner reads, and gettext catalogues (`.po`, read with polib; no `.mo`).

English is the source of every message: `_("all {n} cases passed", n=3)` returns it in the
current language, which is `language(...)`'s while one is active (the grader sets the
submission's), else `$COURSE_LANG`, else that of the notebook the kernel runs, else English. Catalogues are edited with the ordinary
tools (Poedit, Weblate, `msgmerge`); an entry that is fuzzy or untranslated falls back to
English. The package's own messages live in `course_lib/locale/LANG/`, extracted from the code
by `python -m course_lib.i18n extract` (every `_("...")` and `N_("...")` literal, every
exercise's `hints=` and every case's `label=`): a lesson's exercise messages in `lessonNN.po`
(so each lesson's catalogue is edited on its own), everything else in `course_lib.po`.
"""

from __future__ import annotations

import ast
import contextlib
import contextvars
import functools
import json
import os
import re
import string
import sys
from pathlib import Path
from typing import Iterator

LANGUAGES = ("en", "es")
LANG_ENV = "COURSE_LANG"
PACKAGE_DIR = Path(__file__).resolve().parent
_active: contextvars.ContextVar[str | None] = contextvars.ContextVar("course_lang", default=None)
_loaded: dict[Path, tuple[float, dict[str, str]]] = {}


def current() -> str:
    """The language messages are written in now: `language(...)`'s, else `$COURSE_LANG`, else
    the edition of the notebook this kernel runs (JupyterLab names it), else English."""
    lang = _active.get() or os.environ.get(LANG_ENV) or _session_language(
        os.environ.get("JPY_SESSION_NAME", ""))
    return lang if lang in LANGUAGES else "en"


@functools.lru_cache(maxsize=4)
def _session_language(session: str) -> str | None:
    return language_of(Path(session)) if session.endswith(".ipynb") else None


@contextlib.contextmanager
def language(lang: str | None) -> Iterator[None]:
    """Messages in `lang` inside the block (None: leave the current one)."""
    if lang is not None and lang not in LANGUAGES:
        raise ValueError(f"unknown language {lang!r}; the course ships {', '.join(LANGUAGES)}")
    token = _active.set(lang or _active.get())
    try:
        yield
    finally:
        _active.reset(token)


def language_of(notebook: Path | dict) -> str | None:
    """The edition a notebook belongs to (its metadata's `course_lib.lang`), or None: from a
    notebook file, or from a notebook already read (a submission's metadata is data, checked)."""
    try:
        nb = notebook if isinstance(notebook, dict) else \
            json.loads(Path(notebook).read_text(encoding="utf-8"))
        lang = nb["metadata"].get("course_lib", {}).get("lang")
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None
    return lang if isinstance(lang, str) and lang in LANGUAGES else None


def catalogue(path: Path) -> dict[str, str]:
    """{English: translation} of a .po file's translated, non-fuzzy entries ({} if absent)."""
    import polib

    try:
        stamp = path.stat().st_mtime
    except OSError:
        return {}
    if path not in _loaded or _loaded[path][0] != stamp:
        entries = polib.pofile(str(path))
        _loaded[path] = (stamp, {e.msgid: e.msgstr for e in entries
                                 if e.msgstr and "fuzzy" not in e.flags and not e.obsolete})
    return _loaded[path][1]


def package_po(lang: str, name: str = "course_lib") -> Path:
    """One of the package's catalogues: `course_lib` (the machinery's messages) or a lesson's
    exercise messages (`lesson04`)."""
    return PACKAGE_DIR / "locale" / lang / f"{name}.po"


def translations(lang: str) -> dict[str, str]:
    """{English: translation} over every package catalogue of `lang`."""
    found: dict[str, str] = {}
    for path in sorted((PACKAGE_DIR / "locale" / lang).glob("*.po")):
        found.update(catalogue(path))
    return found


def _(message: str, /, **fields: object) -> str:
    """`message` in the current language, its `{fields}` filled in."""
    lang = current()
    if lang != "en" and message:
        message = translations(lang).get(message, message)
    return message.format(**fields) if fields else message


def N_(message: str) -> str:
    """Marks a message for the catalogue where it is defined, translated later with `_`
    (gettext's deferred-translation marker)."""
    return message


def fields_of(text: str) -> set[str]:
    """The `{names}` a message fills in: a translation must keep exactly these."""
    try:
        return {name for _, name, _, _ in string.Formatter().parse(text) if name is not None}
    except ValueError:
        return set()


# -- extracting the package's messages ------------------------------------------------------


def extract(root: Path = PACKAGE_DIR) -> dict[str, list[str]]:
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


_LESSON_FILE = re.compile(r"course_lib/grading/(?:exercises|references)/(lesson\w+)\.py$")


def catalogue_name(where: list[str]) -> str:
    """Which catalogue holds a message found at `where`: its lesson's, when every place that
    uses it is that lesson's exercise file, else the package's."""
    owners = {m.group(1) if (m := _LESSON_FILE.search(w.rsplit(":", 1)[0])) else "course_lib"
              for w in where}
    return owners.pop() if len(owners) == 1 else "course_lib"


def split(messages: dict[str, list[str]]) -> dict[str, dict[str, list[str]]]:
    """{catalogue name: its messages} for `messages` as `extract` found them."""
    found: dict[str, dict[str, list[str]]] = {}
    for text, where in messages.items():
        found.setdefault(catalogue_name(where), {})[text] = where
    return found


def merge(po_path: Path, messages: dict[str, list[str]]) -> list[str]:
    """Bring a catalogue up to the messages found, as msgmerge would: new ones untranslated,
    vanished ones obsolete. Returns what changed, one line each."""
    import polib

    po = (polib.pofile(str(po_path), wrapwidth=0) if po_path.exists()
          else polib.POFile(wrapwidth=0))
    po.metadata = po.metadata or {"Content-Type": "text/plain; charset=UTF-8",
                                  "Language": po_path.parent.name}
    known = {e.msgid: e for e in po}
    changed = []
    for text, where in messages.items():
        entry = known.get(text)
        if entry is None:
            entry = polib.POEntry(msgid=text, msgstr="")
            po.append(entry)
            changed.append(f"new: {text[:60]}")
        entry.obsolete = False
        entry.occurrences = [(w.rsplit(":", 1)[0], w.rsplit(":", 1)[1]) for w in where]
    for entry in list(po):
        if entry.msgid not in messages and not entry.obsolete:
            if not entry.msgstr:  # never translated: nothing to keep for its return
                po.remove(entry)
                changed.append(f"removed: {entry.msgid[:60]}")
                continue
            entry.obsolete = True
            changed.append(f"obsolete: {entry.msgid[:60]}")
    po_path.parent.mkdir(parents=True, exist_ok=True)
    po.save(str(po_path))
    return changed


def main(argv: list[str] | None = None) -> int:
    """`python -m course_lib.i18n extract [NAME ...]`: update the package catalogues from the
    code (only those named, e.g. `lesson04`, when names are given)."""
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
