"""The markers a solution notebook carries (nbgrader's), and the regions they delimit: what the
build, the release, the nbgrader metadata and the lesson checks all read the same way."""

from __future__ import annotations

from typing import Iterator

BEGIN_SOLUTION, END_SOLUTION = "### BEGIN SOLUTION", "### END SOLUTION"
BEGIN_HIDDEN, END_HIDDEN = "### BEGIN HIDDEN TESTS", "### END HIDDEN TESTS"
CODE_STUB = ("# YOUR CODE HERE", "raise NotImplementedError")
MARKDOWN_STUB = ("YOUR ANSWER HERE",)


class BuildError(ValueError):
    """A solution notebook breaks the export or marker conventions; says which and where."""


def regions(lines: list[str], where: str) -> Iterator[tuple[str | None, str]]:
    """Yield (kind, line) pairs: kind is None outside markers, else 'solution' or 'hidden'."""
    kind = None
    for n, line in enumerate(lines, 1):
        marker = line.strip()
        if marker in (BEGIN_SOLUTION, BEGIN_HIDDEN):
            if kind is not None:
                raise BuildError(f"{where}, line {n}: {marker!r} inside an open {kind} region")
            kind = "solution" if marker == BEGIN_SOLUTION else "hidden"
            yield "begin-" + kind, line
        elif marker in (END_SOLUTION, END_HIDDEN):
            want = "solution" if marker == END_SOLUTION else "hidden"
            if kind != want:
                raise BuildError(f"{where}, line {n}: {marker!r} without a matching BEGIN")
            kind = None
            yield "end-" + want, line
        else:
            yield kind, line
    if kind is not None:
        raise BuildError(f"{where}: {kind} region is never closed")
