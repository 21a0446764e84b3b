"""The bundle an instructor hands out: `python3 course.py release DIR`.

It holds the student notebooks, the package with the exercise regions of its components
removed (the learner's own versions fill them, through `course_lib.course.overlay`), the machinery
(cluster, process group, grading, benchmarks) and the README: no `solutions/`, no tests, and
no line of any solution region (`leaks` proves it; a test runs it on every bundle).
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import sys
from pathlib import Path

from course_lib.course import build, exports, notebooks
from course_lib.course.markers import regions
from course_lib.course.components import COMPONENTS
from course_lib.course.grading import judge, plain
from course_lib.course.catalogue import exercises_for, lessons
from course_lib.course.paths import ROOT

TOP_LEVEL = ("README.md", "README.es.md", "LICENSE", "LICENSE-CONTENT", "CITATION.cff",
             "pyproject.toml", "constraints.txt", "course.py", ".gitignore")
DOCS = "docs"  # every page the READMEs link (*.md), in both languages
SKIP = ("__pycache__", ".egg-info", ".ipynb_checkpoints",
        "course_lib/course/grading/references/")  # the judge's side: the bundle has expected.json
# Regions whose code the bundle still ships, with why: each is a defect to mend, not a licence.
# The release prints them; tests/test_release.py fails when this list and the bundle disagree.
KNOWN_GAPS: dict[str, str] = {}


def write_release(root: Path, dest: Path) -> list[str]:
    """Write the bundle into `dest` (new or empty); return its files, relative to it."""
    if dest.exists() and any(dest.iterdir()):
        raise FileExistsError(f"{dest} is not empty: give a new folder for the release")
    if (dest.resolve() / "x").is_relative_to(root.resolve()):
        raise ValueError(f"{dest} is inside the repository: give a folder outside it")
    files = {rel: data for rel, data in build.expected_files(root).items()
             if rel.startswith(f"{build.NOTEBOOKS}/")}
    english = {rel: data for rel, data in files.items() if rel.count("/") == 1}  # not es/
    files.update({rel: text.encode() for rel, text in exports.stub_modules(english).items()})
    for path in sorted((root / build.PACKAGE).rglob("*")):
        rel = path.relative_to(root).as_posix()
        if path.is_file() and rel not in files and not any(s in rel for s in SKIP):
            files[rel] = path.read_bytes()
    files.update({name: (root / name).read_bytes() for name in TOP_LEVEL
                  if (root / name).is_file()})
    files.update({p.relative_to(root).as_posix(): p.read_bytes()
                  for p in sorted((root / DOCS).glob("*.md"))})
    try:
        for rel, data in files.items():
            (dest / rel).parent.mkdir(parents=True, exist_ok=True)
            (dest / rel).write_bytes(data)
        table = dest / build.PACKAGE / "course" / "grading" / judge.RELEASED_EXPECTED.name
        table.write_text(plain.dumps({ex.name: judge.expected_values(ex)
                                      for lesson in lessons() for ex in exercises_for(lesson)}))
    except BaseException:
        shutil.rmtree(dest, ignore_errors=True)  # it was new or empty: half a bundle is worse
        raise
    return sorted([*files, table.relative_to(dest).as_posix()])


# -- the proof that no answer ships ---------------------------------------------------------


def _significant(lines: list[str]) -> list[str]:
    """Code lines with whitespace normalised, blank lines, comments and trailing comments gone."""
    out = []
    for line in lines:
        text = re.sub(r"\s+", " ", line.split(" #")[0]).strip()
        if text and not text.startswith("#"):
            out.append(text)
    return out


def solution_windows(root: Path, width: int = 3) -> dict[tuple[str, ...], str]:
    """Every run of `width` consecutive significant lines of every solution region (a shorter
    region: all of it), to where it comes from; runs of under 30 characters are too common to
    mean anything (`else:`, `return out`) and are left out."""
    found: dict[tuple[str, ...], str] = {}
    for src in sorted((root / build.SOLUTIONS).glob("*.ipynb")):
        for i, cell in enumerate(notebooks._read(src).cells):
            region: list[str] | None = None
            for kind, line in regions(cell.source.split("\n"), f"{src.name}, cell {i}"):
                if kind == "begin-solution":
                    region = []
                elif kind == "end-solution":
                    lines = _significant(region)
                    k = min(width, len(lines))
                    for j in range(len(lines) - k + 1):
                        window = tuple(lines[j:j + k])
                        if sum(map(len, window)) >= 30:
                            found.setdefault(window, f"{src.name}, cell {i}")
                    region = None
                elif kind == "solution":
                    region.append(line)
    return found


def _texts(path: Path) -> list[str]:
    """The code a file holds: a notebook's cell sources, else the file's text."""
    text = path.read_text(encoding="utf-8", errors="replace")
    if path.suffix == ".ipynb":
        return ["".join(c["source"]) if isinstance(c["source"], list) else c["source"]
                for c in json.loads(text)["cells"]]
    return [text]


def leaks(bundle: Path, windows: dict[tuple[str, ...], str]) -> dict[str, list[str]]:
    """{region: ["file ('first line')", ...]} for every solution region found in the bundle."""
    sizes = sorted({len(w) for w in windows})
    found: dict[str, set[str]] = {}
    for path in sorted(p for p in bundle.rglob("*") if p.is_file()):
        for text in _texts(path):
            lines = _significant(text.split("\n"))
            for k in sizes:
                for j in range(len(lines) - k + 1):
                    where = windows.get(tuple(lines[j:j + k]))
                    if where:
                        found.setdefault(where, set()).add(
                            f"{path.relative_to(bundle)} ({lines[j]!r})")
    return {where: sorted(files) for where, files in sorted(found.items())}


def main(argv: list[str] | None = None) -> int:
    """`python3 course.py release DIR`."""
    parser = argparse.ArgumentParser(prog="course.py release", description=__doc__.split("\n")[0])
    parser.add_argument("dest", type=Path, help="a new (or empty) folder outside the repository")
    parser.add_argument("--root", type=Path, default=ROOT)
    args = parser.parse_args(argv)
    if not (args.root / build.SOLUTIONS).is_dir():
        print("course.py release: needs the instructor's repository (it has solutions/)",
              file=sys.stderr)
        return 2
    try:
        files = write_release(args.root, args.dest)
    except (FileExistsError, ValueError, build.BuildError) as exc:
        print(f"course.py release: {exc}", file=sys.stderr)
        return 2
    found = leaks(args.dest, solution_windows(args.root))
    new = {where: files for where, files in found.items() if where not in KNOWN_GAPS}
    if new:
        shutil.rmtree(args.dest)
        print("course.py release: solution code would ship, so nothing was written:\n  "
              + "\n  ".join(f"{w}: {', '.join(f)}" for w, f in new.items()), file=sys.stderr)
        return 1
    print(f"wrote {len(files)} files to {args.dest}: {len(COMPONENTS)} components without "
          "their answers")
    for where in found:
        print(f"known gap: {where}'s code still ships: {KNOWN_GAPS[where]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
