"""`course-grade`'s results: one row per exercise of each submission, in grades.csv and
grades.json, rewritten whole and atomically after each submission, and read back to resume an
interrupted run."""

from __future__ import annotations

import hashlib
import json
import os
import secrets
from pathlib import Path

FIELDS = ("student", "exercise", "points", "max_points", "reason", "notebook")


def _row(student: str, path: Path, exercise: str, points: float, max_points: float,
         reason: str) -> dict:
    return {"student": student, "exercise": exercise, "points": points,
            "max_points": max_points, "reason": reason, "notebook": str(path)}


def _digest(path: Path) -> str | None:
    try:
        return hashlib.sha256(path.read_bytes()).hexdigest()
    except OSError:
        return None


class Results:
    """grades.csv and grades.json, rewritten whole and atomically from the rows held here after
    each submission (a reader never sees half a file); a change made by anyone else between two
    writes is noticed and undone."""

    NAMES = ("grades.csv", "grades.json")

    def __init__(self, out_dir: Path, rows: list[dict]):
        self.dir, self.rows = Path(out_dir), list(rows)
        self.dir.mkdir(parents=True, exist_ok=True)
        self._written: dict[str, str | None] = {}

    def tampered(self) -> bool:
        """True when a results file differs from what this grader last wrote."""
        return bool(self._written) and any(_digest(self.dir / n) != d
                                           for n, d in self._written.items())

    def write(self) -> None:
        import csv
        import io

        buf = io.StringIO()
        writer = csv.DictWriter(buf, fieldnames=FIELDS, lineterminator="\n")
        writer.writeheader()
        writer.writerows(self.rows)
        for name, text in zip(self.NAMES, (buf.getvalue(), json.dumps(self.rows, indent=1) + "\n")):
            tmp = self.dir / f".{name}.{secrets.token_hex(8)}.tmp"
            # a new file of ours (never one planted there, nor a link out of the folder)
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0),
                         0o644)
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                f.write(text)
            os.replace(tmp, self.dir / name)
            self._written[name] = hashlib.sha256(text.encode("utf-8")).hexdigest()


def write_results(rows: list[dict], out_dir: Path) -> None:
    """Rewrite grades.csv and grades.json atomically from `rows`."""
    Results(out_dir, rows).write()


def _previous(out: Path) -> list[dict]:
    """The rows an interrupted run left, checked field by field (a row per exercise)."""
    try:
        rows = json.loads((out / "grades.json").read_text())
    except FileNotFoundError:
        return []
    except ValueError as exc:
        raise ValueError(f"cannot resume: {out / 'grades.json'} is not valid JSON ({exc})")
    if not (isinstance(rows, list) and all(isinstance(r, dict) and set(r) == set(FIELDS)
                                           for r in rows)):
        raise ValueError(f"cannot resume: {out / 'grades.json'} does not hold course-grade rows")
    return rows
