"""Reading and writing notebooks byte-stably, and the student release of a solution notebook:
solutions stubbed, hidden tests and build directives gone, outputs dropped."""

from __future__ import annotations

import copy
import hashlib
from pathlib import Path
from typing import TYPE_CHECKING

from course_lib.course.exports import _DIRECTIVE, SOLUTIONS, exported_cells
from course_lib.course.markers import CODE_STUB, MARKDOWN_STUB, regions

if TYPE_CHECKING:  # nbformat takes a second to import: only what reads notebooks needs it
    import nbformat


def release_source(source: str, where: str, markdown: bool = False) -> str:
    """The student version of one cell: solutions stubbed (indentation kept), hidden tests gone."""
    out: list[str] = []
    stub = MARKDOWN_STUB if markdown else CODE_STUB
    for kind, line in regions(source.split("\n"), where):
        if kind == "begin-solution":
            indent = line[: len(line) - len(line.lstrip())]
            out += [indent + s for s in stub]
        elif kind is None:
            out.append(line)
    return "\n".join(out)


def _read(path: Path) -> nbformat.NotebookNode:
    import nbformat

    nb = nbformat.read(path, as_version=4)
    # Cells without ids would get random ones on write; derive stable ids from the position.
    if nb.nbformat_minor >= 5:
        for i, cell in enumerate(nb.cells):
            if not cell.get("id"):
                cell["id"] = hashlib.sha1(f"{path.name}:{i}".encode()).hexdigest()[:8]
    return nb


def _dump(nb: nbformat.NotebookNode) -> bytes:
    import nbformat

    return (nbformat.writes(nb, version=4) + "\n").encode()


def _without_directives(source: str) -> str:
    """A code cell without its `#| ...` build directive lines (the instructor's business)."""
    return "\n".join(line for line in source.split("\n") if not _DIRECTIVE.match(line))


def student_notebook(nb: nbformat.NotebookNode, name: str) -> nbformat.NotebookNode:
    """The student release of a solution notebook: stubs, no hidden tests, no outputs, no
    build directives (a cell that held only directives is left out); an export cell keeps its
    module in its metadata, so the learner's completed cells can be exported the same way."""
    out = copy.deepcopy(nb)
    exports = {i: module for module, found in exported_cells(nb, name).items()
               for i, _, _ in found}
    kept = []
    for i, cell in enumerate(out.cells):
        where = f"{SOLUTIONS}/{name}, cell {i}"
        if i in exports:  # the learner's overlay exports this cell (course_lib.course.overlay)
            cell.metadata.setdefault("course_lib", {})["export"] = exports[i]
        if cell.cell_type == "code":
            cell.source = _without_directives(release_source(cell.source, where))
            if not cell.source.strip():
                continue
            cell.outputs = []
            cell.execution_count = None
        elif cell.cell_type == "markdown":
            cell.source = release_source(cell.source, where, markdown=True)
        kept.append(cell)
    out.cells = kept
    out.metadata.setdefault("course_lib", {}).update(lesson=Path(name).stem, release="student")
    return out
