"""The language a learner reads, and gettext catalogues (`.po`, read with polib; no `.mo`).

English is the source of every message: `_("all {n} cases passed", n=3)` returns it in the
current language, which is `language(...)`'s while one is active (the grader sets the
submission's), else `$COURSE_LANG`, else that of the notebook the kernel runs, else English. Catalogues are edited with the ordinary
tools (Poedit, Weblate, `msgmerge`); an entry that is fuzzy or untranslated falls back to
English. The package's own messages live in `course_lib/locale/LANG/` (a lesson's exercise
messages in `lessonNN.po`, everything else in `course_lib.po`), extracted from the code by
`python -m course_lib.course.messages extract`.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import json
import os
import string
import time
from pathlib import Path
from typing import Iterator

LANGUAGES = ("en", "es")
LANG_ENV = "COURSE_LANG"
PACKAGE_DIR = Path(__file__).resolve().parent
_active: contextvars.ContextVar[str | None] = contextvars.ContextVar("course_lang", default=None)
_loaded: dict[Path, tuple[float, dict[str, str]]] = {}
_merged: dict[Path, tuple[float, tuple, dict]] = {}  # a locale folder: (checked, stamps, union)
RECHECK_SECONDS = 1.0


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


def catalogue(path: Path) -> dict[str, str | tuple[str, ...]]:
    """{English: translation} of a .po file's translated, non-fuzzy entries ({} if absent); an
    entry with plural forms maps its singular to the tuple of its forms."""
    import polib

    stamp = _stamp(path)
    if stamp is None:
        return {}
    if path not in _loaded or _loaded[path][0] != stamp:
        entries = polib.pofile(str(path))
        _loaded[path] = (stamp, {e.msgid: _forms(e) for e in entries
                                 if _forms(e) and "fuzzy" not in e.flags and not e.obsolete})
    return _loaded[path][1]


def _forms(entry) -> str | tuple[str, ...]:
    """A catalogue entry's translation: its text, or its plural forms (empty if any is)."""
    if not entry.msgid_plural:
        return entry.msgstr
    forms = tuple(entry.msgstr_plural[i] for i in sorted(entry.msgstr_plural))
    return forms if forms and all(forms) else ""


def package_po(lang: str, name: str = "course_lib") -> Path:
    """One of the package's catalogues: `course_lib` (the machinery's messages) or a lesson's
    exercise messages (`lesson04`)."""
    return PACKAGE_DIR / "locale" / lang / f"{name}.po"


def translations(lang: str) -> dict[str, str | tuple[str, ...]]:
    """{English: translation} over every package catalogue of `lang`, merged again only when
    a catalogue changed, looked for at most once a second (every `_()` call asks)."""
    folder, now = PACKAGE_DIR / "locale" / lang, time.monotonic()
    checked, stamps, found = _merged.get(folder, (-RECHECK_SECONDS, (), {}))
    if now - checked < RECHECK_SECONDS:
        return found
    paths = sorted(folder.glob("*.po"))
    latest = tuple((path, _stamp(path)) for path in paths)
    if latest != stamps:
        found = {}
        for path in paths:
            found.update(catalogue(path))
    _merged[folder] = (now, latest, found)
    return found


def _stamp(path: Path) -> float | None:
    try:
        return path.stat().st_mtime
    except OSError:
        return None


def _(message: str, /, **fields: object) -> str:
    """`message` in the current language, its `{fields}` filled in."""
    lang = current()
    if lang != "en" and message:
        found = translations(lang).get(message, message)
        message = found if isinstance(found, str) else message
    return message.format(**fields) if fields else message


def ngettext(singular: str, plural: str, n: int, /, **fields: object) -> str:
    """`singular` or `plural` as the count `n` decides, in the current language, with `{n}`
    and the other `{fields}` filled in ("1 rank" / "2 ranks"; the catalogue's plural forms)."""
    lang, index = current(), 0 if n == 1 else 1  # English's and Spanish's rule: nplurals=2
    text = singular if index == 0 else plural
    if lang != "en":
        forms = translations(lang).get(singular)
        if isinstance(forms, tuple) and len(forms) > index:
            text = forms[index]
    return text.format(n=n, **fields)


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
