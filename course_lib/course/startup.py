"""What else a lesson's process needs once the learner's components win (`overlay.install`):
the backend's rule for a student release, the engines of later clusters installing the overlay
too, and which clusters a change of `use()` reaches. Registered into the components' runtime,
which never imports the course (CONTRIBUTING.md, Layers)."""

from __future__ import annotations

from course_lib import backend as backends
from course_lib.cluster import client
from course_lib.course import overlay
from course_lib.course.overlay import lesson_of, not_passed, reference_shipped, resolve


class Availability(backends.Availability):
    """The scratch backend in a student release runs on the learner's lesson 01 wire format:
    written once exported, the default once its checks pass (gloo until then)."""

    def scratch_written(self) -> bool:
        return reference_shipped("dist.wire") or resolve("dist.wire").mine

    def default(self) -> str:
        if reference_shipped("dist.wire"):
            return backends.DEFAULT_BACKEND
        failing, unchecked = not_passed(lesson_of("dist.wire"))
        if self.scratch_written() and not (failing or unchecked):
            return backends.DEFAULT_BACKEND
        print("process group: gloo until your lesson 01 passes its checks (the scratch "
              "backend runs on your wire format)", flush=True)
        return "gloo"



def register() -> None:
    """Register the course's answers with the components' runtime (idempotent)."""
    backends.set_availability(Availability())
    if overlay.install not in client.STARTUP:
        client.STARTUP.append(overlay.install)
    overlay.live_clusters = lambda: list(client._LIVE)
