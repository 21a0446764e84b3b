"""Lessons run in Spanish: the Spanish edition of a solution notebook (its catalogue applied, as
the build does), executed top to bottom in a fresh kernel with COURSE_LANG=es, shows no English
sentence in its outputs (printed text, results, errors) outside code and identifiers.

The suite runs three lessons in Spanish (IN_SUITE): 00 (the cluster, the checks' reports),
04b (DDP's hooks and buckets) and 09b (failures, restarts and their errors); every lesson, by
one command:

    COURSE_SPANISH_LESSONS=all python3 course.py test tests/test_spanish_outputs.py

(or any list of lessons or parts: COURSE_SPANISH_LESSONS=03,10a). English lines already known
(the lessons' f-strings and the modules' errors not yet translated) are listed, digits
normalized, in tests/fixtures/spanish_outputs.txt: a line not listed fails, and so does a
listed line that no longer appears in a lesson that ran (the list only shrinks). Rewrite it after mending some:
`COURSE_SPANISH_UPDATE=1` with the same command (only the lessons run are rewritten).
"""

from __future__ import annotations

import os
import re
import tempfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SOLUTIONS = ROOT / "solutions"
KNOWN = ROOT / "tests" / "fixtures" / "spanish_outputs.txt"
IN_SUITE = ("00_cluster", "04b_ddp_overlap", "09b_recovery")
# English words that are not also Spanish words or course terms kept in English: two distinct
# ones in a line make it an English sentence.
ENGLISH = set("""the of and is are was were has have had with from to for this that which
not by into after before every each than when what does did your yours its it be been being
equal sums hello would could should there their they them then only still also same other
ran runs run waits waited wrong right first last next over under between while about""".split())
_CODE = re.compile(r"\{[^{}]*\}|`[^`]*`|'[^']*'|\"[^\"]*\"|\S*[_./\\()\[\]=<>%:]\S*")


def lessons() -> list[str]:
    chosen = os.environ.get("COURSE_SPANISH_LESSONS", "")
    stems = [p.stem for p in sorted(SOLUTIONS.glob("*.ipynb"))]
    if not chosen:
        return list(IN_SUITE)
    if chosen == "all":
        return stems
    return [s for s in stems if any(s == c or s.split("_")[0] == c
                                    or s.split("_")[0].rstrip("abcdefgh") == c
                                    for c in chosen.split(","))]


def english_sentence(line: str) -> bool:
    words = {w.lower() for w in re.findall(r"[A-Za-z]+", _CODE.sub(" ", line))}
    return len(words & ENGLISH) >= 2


def normalized(line: str) -> str:
    return re.sub(r"\d+(\.\d+)?(e[-+]?\d+)?", "#", line.strip())


def outputs(nb) -> list[str]:
    """Every line a learner reads in the executed notebook's outputs (no images)."""
    lines = []
    for cell in nb.cells:
        for out in cell.get("outputs", []):
            if out.output_type == "stream":
                lines += out.text.splitlines()
            elif out.output_type in ("execute_result", "display_data"):
                lines += out.get("data", {}).get("text/plain", "").splitlines() \
                    if "image/png" not in out.get("data", {}) else []
            elif out.output_type == "error":
                lines.append(f"{out.ename}: {out.evalue}")
    return lines


def run_in_spanish(stem: str) -> list[str]:
    import nbformat
    from nbclient import NotebookClient

    from course_lib.course import translate

    src = SOLUTIONS / f"{stem}.ipynb"
    nb = translate.translated(nbformat.read(src, as_version=4),
                              translate.catalogue_path(SOLUTIONS, "es", stem), "es")
    with tempfile.TemporaryDirectory(prefix="course_lib_home-") as home:
        env = {"COURSE_LIB_HOME": home, "IPP_NONINTERACTIVE": "1", "COURSE_LANG": "es"}
        saved = {k: os.environ.get(k) for k in env}
        os.environ.update(env)  # the kernel, and the engines it starts, inherit them
        try:
            NotebookClient(nb, timeout=600, kernel_name="python3",
                           resources={"metadata": {"path": str(SOLUTIONS)}}).execute()
        finally:
            for k, v in saved.items():
                os.environ.pop(k) if v is None else os.environ.__setitem__(k, v)
    return [normalized(x) for x in outputs(nb) if english_sentence(x)]


def _known() -> dict[str, set[str]]:
    found: dict[str, set[str]] = {}
    if KNOWN.is_file():
        for line in KNOWN.read_text(encoding="utf-8").splitlines():
            stem, _, text = line.partition("\t")
            found.setdefault(stem, set()).add(text)
    return found


def _write(stem: str, lines: set[str]) -> None:
    known = _known()
    known[stem] = lines
    KNOWN.write_text("".join(f"{s}\t{t}\n" for s in sorted(known) for t in sorted(known[s])),
                     encoding="utf-8")


@pytest.mark.slow
@pytest.mark.cluster
@pytest.mark.timeout(900)
@pytest.mark.parametrize("stem", lessons())
def test_a_lesson_run_in_spanish_shows_no_english(stem):
    found = set(run_in_spanish(stem))
    if os.environ.get("COURSE_SPANISH_UPDATE"):
        _write(stem, found)
        return
    listed = _known().get(stem, set())
    new, gone = sorted(found - listed), sorted(listed - found)
    assert not new, (f"{stem} run in Spanish shows English: translate it (its catalogue, or "
                     "`_()` in the module that prints or raises it):\n" + "\n".join(new))
    assert not gone, (f"{stem}: listed English lines no longer appear: shrink "
                      f"{KNOWN.relative_to(ROOT)} (COURSE_SPANISH_UPDATE=1):\n" + "\n".join(gone))


def test_what_counts_as_an_english_sentence():
    assert english_sentence("hello from rank 0 of 4")
    assert english_sentence("restart: parameters bitwise equal to the uninterrupted run: True")
    assert not english_sentence("hola desde el rank 0 de 4")
    assert not english_sentence("all_reduce(x, op=SUM) -> tensor([6., 6.])")
    assert not english_sentence("el rank 3 completó hasta la #2 y no ha llamado a la #3")
