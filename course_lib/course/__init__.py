"""The course that builds `course_lib`: what a lesson needs and what runs the course.

- `check(name, fn, cluster=None, hint=0)`: a lesson's check cell.
- `use("mine" | "reference", ddp=...)`: which components run, the learner's or the reference.
- `overlay`: the learner's own package; `build`, `translate`, `messages`, `release`: the
  instructor's; `grading`: checks and `course-grade`; `bench`: the benchmarks; `demos`: the
  lessons' experiments; `kernels`: the lab's kernels; `lesson_shape`: a lesson's hour.

Importing this package is what starts a lesson: from then on the learner's components win
over the reference, in this process and in every process a cluster starts later. A script that
imports only the components (`import course_lib.ddp`) never imports it.
"""

from course_lib.course import overlay

overlay.install()  # first: every component imported after this resolves through the overlay

# After the overlay: these import components.
from course_lib.course import startup  # noqa: E402
from course_lib.course.grading.learner import check, grade_function  # noqa: E402
from course_lib.course.overlay import install, use  # noqa: E402

startup.register()

__all__ = ["check", "grade_function", "install", "use"]
