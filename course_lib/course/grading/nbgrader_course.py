"""An nbgrader course folder made from our source, so an instructor can run nbgrader 0.9 itself.

`python3 course.py nbgrader DIR [LESSON ...]` writes `DIR/nbgrader_config.py` (our stub text,
so that nbgrader's release matches ours) and `DIR/source/LESSON/LESSON.ipynb`, the solution
notebooks as the build keeps them, with nbgrader's cell metadata. Then, in DIR, nbgrader's own
commands: `nbgrader db assignment add 00_cluster`, `nbgrader generate_assignment 00_cluster`,
and after collecting submissions into `submitted/STUDENT/00_cluster/`,
`nbgrader autograde 00_cluster`. Check cells raise under nbgrader when they do not pass.
"""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path

from course_lib.course.build import NOTEBOOKS, SOLUTIONS
from course_lib.course.markers import CODE_STUB, MARKDOWN_STUB
from course_lib.course.paths import ROOT

CONFIG = """c = get_config()  # noqa: F821 - defined by nbgrader's config loader
c.CourseDirectory.root = {root!r}
c.CourseDirectory.course_id = "course_lib"
c.ClearSolutions.code_stub = {{"python": {code!r}}}
c.ClearSolutions.text_stub = {text!r}
c.Execute.timeout = 600  # one cell may start a cluster or train a model
"""


def write_course(dest: Path, lessons: list[str] | None = None, root: Path = ROOT) -> list[str]:
    """Lay out an nbgrader course in `dest` for `lessons` (default: all); returns the lessons."""
    found = sorted(p.stem for p in (root / SOLUTIONS).glob("*.ipynb"))
    wanted = lessons or found
    unknown = [name for name in wanted if name not in found]
    if unknown:
        raise ValueError(f"no such lesson(s): {', '.join(unknown)}; lessons: {', '.join(found)}")
    dest.mkdir(parents=True, exist_ok=True)
    (dest / "nbgrader_config.py").write_text(CONFIG.format(
        root=str(dest.resolve()), code="\n".join(CODE_STUB), text="\n".join(MARKDOWN_STUB)))
    for name in wanted:
        (dest / "source" / name).mkdir(parents=True, exist_ok=True)
        shutil.copyfile(root / SOLUTIONS / f"{name}.ipynb", dest / "source" / name / f"{name}.ipynb")
    return wanted


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="course.py nbgrader", description=__doc__.split("\n")[0])
    parser.add_argument("dest", type=Path, help="the nbgrader course folder to write")
    parser.add_argument("lessons", nargs="*", help="lesson names, e.g. 00_cluster (default: all)")
    args = parser.parse_args(argv)
    try:
        done = write_course(args.dest, args.lessons)
    except ValueError as exc:
        parser.error(str(exc))
    print(f"wrote an nbgrader course with {len(done)} lesson(s) in {args.dest}; there: "
          f"nbgrader db assignment add {done[0]} && nbgrader generate_assignment {done[0]} "
          f"(the student release it writes matches {NOTEBOOKS}/{done[0]}.ipynb)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
