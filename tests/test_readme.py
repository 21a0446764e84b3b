"""The READMEs are a front door: short, the same sections in both languages, every link to a
file that exists, and no dates or run logs in any document a user reads."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
READMES = {"en": ROOT / "README.md", "es": ROOT / "README.es.md"}
MAX_LINES = 200
DATED = re.compile(r"20\d\d-[01]\d-[0-3]\d")
RUN_LOG = re.compile(r"\b(on clean clones|this machine'?s?|my runs?|I ran|we ran|slow spells)\b",
                     re.IGNORECASE)
LINK = re.compile(r"\]\(([^)#\s]+)(?:#[^)]*)?\)")


def documents() -> list[Path]:
    """What a user reads outside the lessons: the READMEs, the docs, how to contribute."""
    return [*READMES.values(), ROOT / "CONTRIBUTING.md", ROOT / "tests" / "README.md",
            *sorted((ROOT / "docs").glob("*.md"))]


def headings(path: Path) -> list[int]:
    """The level of each heading, in order, outside code blocks."""
    levels, fenced = [], False
    for line in path.read_text(encoding="utf-8").splitlines():
        if line.startswith("```"):
            fenced = not fenced
        elif not fenced and (m := re.match(r"(#+) ", line)):
            levels.append(len(m.group(1)))
    return levels


@pytest.mark.parametrize("lang", READMES)
def test_the_readme_is_short(lang: str) -> None:
    lines = READMES[lang].read_text(encoding="utf-8").count("\n")
    assert 40 < lines <= MAX_LINES, f"{READMES[lang].name}: {lines} lines (at most {MAX_LINES})"


def test_both_readmes_have_the_same_sections() -> None:
    en, es = headings(READMES["en"]), headings(READMES["es"])
    assert en.count(2) >= 6, en  # what, commands, lessons, own package, cluster, next, license
    assert en == es, f"heading levels differ: English {en}, Spanish {es}"


def test_the_heading_check_sees_a_missing_section(tmp_path: Path) -> None:
    one = tmp_path / "a.md"
    one.write_text("# T\n## A\n```\n## not a heading\n```\n## B\n")
    other = tmp_path / "b.md"
    other.write_text("# T\n## A\n")
    assert headings(one) == [1, 2, 2] and headings(other) != headings(one)


@pytest.mark.parametrize("path", documents(), ids=lambda p: p.relative_to(ROOT).as_posix())
def test_no_dates_or_run_logs_in_what_a_user_reads(path: Path) -> None:
    text = path.read_text(encoding="utf-8")
    found = sorted(set(DATED.findall(text)) | set(RUN_LOG.findall(text)))
    assert not found, f"{path.relative_to(ROOT)} carries history: {found}"


@pytest.mark.parametrize("path", documents(), ids=lambda p: p.relative_to(ROOT).as_posix())
def test_every_link_leads_to_a_file(path: Path) -> None:
    text = path.read_text(encoding="utf-8")
    missing = [target for target in LINK.findall(text)
               if "://" not in target and not (path.parent / target).exists()]
    assert not missing, f"{path.relative_to(ROOT)} links to missing files: {missing}"


@pytest.mark.parametrize("name", ["LICENSE", "LICENSE-CONTENT", "CITATION.cff"])
def test_terms_of_use_are_stated(name: str) -> None:
    text = (ROOT / name).read_text(encoding="utf-8")
    expected = {"LICENSE": "MIT License", "LICENSE-CONTENT": "Attribution-ShareAlike 4.0",
                "CITATION.cff": "cff-version: 1.2.0"}[name]
    assert expected in text
    for lang, readme in READMES.items():
        assert f"]({name})" in readme.read_text(encoding="utf-8"), (lang, name)
