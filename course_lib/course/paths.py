"""Where the course's files are: the package, and the repository that holds it."""

from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1]  # course_lib/
ROOT = PACKAGE.parent                           # the repository (solutions/, notebooks/, docs/)
