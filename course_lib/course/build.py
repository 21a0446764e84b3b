"""Build the course from `solutions/`: exported `course_lib` modules and the student release.

It also keeps nbgrader's cell metadata in `solutions/` current (`nbgrader_cells`), the one
change it makes to the source.

`python -m course_lib.course.build` regenerates both; `--check` changes nothing and exits 1 listing
every generated file that is stale, missing, or left over from a notebook that is gone, and
every piece of a translated edition whose entry is missing or fuzzy (course_lib.course.translate).
Output is byte-stable (sorted JSON keys, fixed indentation), so the check is exact.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from course_lib.course import translate
from course_lib.course.exports import (HEADER_PREFIX, PACKAGE, SOLUTIONS, components,
                                      components_text, exported_modules)
from course_lib.course.markers import BuildError
from course_lib.course.notebooks import _dump, _read, student_notebook
from course_lib.course.nbgrader_cells import with_nbgrader
from course_lib.course.paths import ROOT
from course_lib.course.bench import report


NOTEBOOKS = "notebooks"


def expected_files(root: Path) -> dict[str, bytes]:
    """Every generated file (path relative to `root`) with the bytes it should hold."""
    files: dict[str, bytes] = {}
    owners: dict[str, str] = {}
    found: dict[str, str] = {}
    for src in sorted((root / SOLUTIONS).glob("*.ipynb")):
        nb = with_nbgrader(_read(src), src.name)  # the source carries nbgrader's cell marks
        for cell in nb.cells:  # when a cell last ran is history, not part of the lesson
            cell.metadata.pop("execution", None)
        files[f"{SOLUTIONS}/{src.name}"] = _dump(nb)
        files[f"{NOTEBOOKS}/{src.name}"] = _dump(student_notebook(nb, src.name))
        for lang in translate.EDITIONS:  # a lesson's edition exists once it is translated
            po = translate.catalogue_path(root / SOLUTIONS, lang, src.stem)
            if po.is_file() and src.stem not in translate.pending(lang):
                files[f"{NOTEBOOKS}/{lang}/{src.name}"] = _dump(student_notebook(
                    translate.translated(nb, po, lang), src.name))
        for path, text in exported_modules(nb, src.name).items():
            if path in owners:
                raise BuildError(f"{path} is exported by both {owners[path]} and {src.name}")
            owners[path] = src.name
            files[path] = text.encode()
        found.update(dict.fromkeys(components(nb, src.name), src.stem))
    if found:
        files[f"{PACKAGE}/course/components.py"] = components_text(found).encode()

    for path, text in report.pages(root / "docs" / "bench").items():
        files[path.relative_to(report.ROOT).as_posix()] = text.encode()
    return files


def _is_generated_module(path: Path) -> bool:
    try:
        with path.open(encoding="utf-8") as f:
            return f.readline().startswith(HEADER_PREFIX)
    except (OSError, UnicodeDecodeError):
        return False


def generated_on_disk(root: Path) -> set[str]:
    """Files that only the build may write: student notebooks and modules with our header."""
    found = {p.relative_to(root).as_posix() for p in (root / NOTEBOOKS).glob("*.ipynb")}
    found |= {p.relative_to(root).as_posix() for lang in translate.EDITIONS
              for p in (root / NOTEBOOKS / lang).glob("*.ipynb")}
    found |= {p.relative_to(root).as_posix() for p in (root / PACKAGE).rglob("*.py")
              if _is_generated_module(p)}
    return found


def _out_of_date(root: Path, want: dict[str, bytes]) -> list[tuple[str, str]]:
    """(path, "missing" or "stale") for every generated file that differs from `want`."""
    found = []
    for rel, data in sorted(want.items()):
        path = root / rel
        if not path.exists():
            found.append((rel, "missing"))
        elif path.read_bytes() != data:
            found.append((rel, "stale"))
    return found


def stale(root: Path) -> list[str]:
    """Problems `--check` reports, one line each; empty when everything is up to date."""
    want = expected_files(root)
    problems = [f"{why}: {rel}" for rel, why in _out_of_date(root, want)]
    problems += [f"orphan (its notebook is gone): {rel}"
                 for rel in sorted(generated_on_disk(root) - set(want))]
    for lang in translate.EDITIONS:
        problems += translate.problems(root / SOLUTIONS, lang)
    return problems


def _of_lessons(want: dict[str, bytes], root: Path, only: list[str]) -> dict[str, bytes]:
    """The generated files that the lessons in `only` (stems or prefixes: "04", "04b") write:
    their notebooks, their modules, and the components table."""
    stems = {src.stem for src in (root / SOLUTIONS).glob("*.ipynb")
             if any(src.stem == o or src.stem.startswith(o if "_" in o else o + "_")
                    or src.stem.split("_")[0].rstrip("abcdefgh") == o for o in only)}
    mine = {f"{PACKAGE}/course/components.py"}
    for rel, data in want.items():
        name = Path(rel).stem
        if rel.endswith(".ipynb") and name in stems:
            mine.add(rel)
        elif rel.endswith(".py") and any(f"from {SOLUTIONS}/{s}.ipynb" in data[:200].decode(
                "utf-8", "replace") for s in stems):
            mine.add(rel)
    return {rel: data for rel, data in want.items() if rel in mine}


def build(root: Path, only: list[str] | None = None) -> list[str]:
    """Write every stale or missing generated file and delete orphans; return what changed.
    With `only` (lesson stems or numbers), write just those lessons' files, delete nothing."""
    want = expected_files(root)
    if only:
        want = _of_lessons(want, root, only)
    changed = []
    for rel, _ in _out_of_date(root, want):
        path = root / rel
        if path.exists() and rel.endswith(".py") and not _is_generated_module(path):
            raise BuildError(f"refusing to overwrite hand-written {rel}: delete it if the "
                             f"notebook is now its source, else rename the '#| default_exp'")
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(want[rel])
        changed.append(f"wrote {rel}")
    for rel in sorted(generated_on_disk(root) - set(want)) if not only else []:
        (root / rel).unlink()
        changed.append(f"removed {rel}")
    return changed


def main(argv: list[str] | None = None) -> int:
    """`course-build [--check] [--root DIR]`."""
    parser = argparse.ArgumentParser(prog="course-build", description=__doc__.split("\n")[0])
    parser.add_argument("--check", action="store_true",
                        help="change nothing; exit 1 listing stale, missing or orphan files")
    parser.add_argument("--root", type=Path, default=ROOT,
                        help="repository root (default: the one holding this package)")
    parser.add_argument("--only", nargs="+", metavar="LESSON",
                        help="write only these lessons' files (stems or numbers: 04 04b); "
                             "for work on some lessons while others change")
    args = parser.parse_args(argv)
    try:
        lines = stale(args.root) if args.check else build(args.root, args.only)
    except BuildError as exc:
        print(f"course-build: {exc}", file=sys.stderr)
        return 2
    for line in lines:
        print(line)
    if not args.check:
        for lang in translate.EDITIONS:
            for line in translate.problems(args.root / SOLUTIONS, lang):
                print(f"warning: {line}", file=sys.stderr)
    for lang in translate.EDITIONS:
        if translate.pending(lang):
            print(f"{lang}: not translated yet (course_lib.course.translate.PENDING): "
                  f"{', '.join(translate.pending(lang))}", file=sys.stderr)
    if args.check and lines:
        print("course-build --check: generated files are out of date; "
              "run `python -m course_lib.course.build`", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
