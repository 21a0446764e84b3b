"""A learner, played by tests: fill a student notebook's exercises with the instructor's
solutions (optionally planting code), as someone who completed the lesson would."""

from __future__ import annotations

from pathlib import Path

import nbformat

from course_lib.course import build, exports, markers, notebooks

ROOT = Path(__file__).resolve().parent.parent

# Planted after a learner's cell: records, per process, that the learner's copy ran.
MARK_ENV = "COURSE_LIB_TEST_MARKS"
MARK = ("import os as _os\n"
        "def _mark(what):\n"
        "    folder = _os.environ.get('" + MARK_ENV + "')\n"
        "    if folder:\n"
        "        open(_os.path.join(folder, f'{what}-{_os.getpid()}'), 'w').close()\n")
MARK_DDP = MARK + ("_init = DistributedDataParallel.__init__\n"
                   "def _marked_init(self, *args, **kwargs):\n"
                   "    _mark('ddp')\n"
                   "    _init(self, *args, **kwargs)\n"
                   "DistributedDataParallel.__init__ = _marked_init\n")
MARK_SAMPLER = MARK + ("_iter = DistributedSampler.__iter__\n"
                       "def _marked_iter(self):\n"
                       "    _mark('sampler')\n"
                       "    return _iter(self)\n"
                       "DistributedSampler.__iter__ = _marked_iter\n")
# A wrong DDP: gradients come out twice the average (a realistic missing or doubled divide).
DOUBLING_DDP = ("DistributedDataParallel.finish = lambda self: (finish_backward(self), [\n"
                "    p.grad.mul_(2) for p in self.module.parameters() if p.grad is not None])\n")


def fill(student: Path, plant: dict[str, str] | None = None, lesson_root: Path = ROOT) -> Path:
    """Write each solution region of the lesson into `student` (a copy of its student
    notebook), in place; `plant[name]` is appended to the cell that defines `name`."""
    solution = nbformat.read(lesson_root / "solutions" / student.name, as_version=4)
    answers = {c.id: c.source for c in solution.cells
               if c.cell_type == "code" and markers.BEGIN_SOLUTION in c.source}
    nb = nbformat.read(student, as_version=4)
    for i, cell in enumerate(nb.cells):
        if cell.id in answers:
            where = f"{student.name}, cell {i}"
            cell.source = notebooks._without_directives(exports.export_source(answers[cell.id], where))
        for name, code in (plant or {}).items():
            if cell.cell_type == "code" and (f"class {name}(" in cell.source
                                             or f"def {name}(" in cell.source):
                cell.source += "\n\n" + code
    nbformat.write(nb, student)
    return student
