"""Judging what a learner's function did: expected values, comparison, points and reasons.

The other half of `learner`: `learner.collect` calls the learner's function and describes each
call as plain data; `judge` turns that into a `Result`. `course-grade` runs `judge` in its own
process on data read back from the submission's kernel (`validated` first), so nothing the
submission patched there (the comparison, torch, the grading functions) takes part.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any, Sequence

from course_lib.course.grading import plain
from course_lib.course.catalogue import REFERENCES, Case, Exercise, substitute
from course_lib.course.compare import WRONG_VALUE, mismatch, show
from course_lib.course.grading.report import CaseResult, Outcome, Result, Row
from course_lib.i18n import _
from course_lib.course.components import COMPONENTS
from course_lib.course.overlay import packaged_only, reference_shipped

RELEASED_EXPECTED = Path(__file__).with_name("expected.json")  # written by course.py release
MAX_TEXT = 500  # characters of any message that comes back from a kernel
_CALLED = {Outcome.RETURNED, Outcome.NOT_IMPLEMENTED, Outcome.ERROR, Outcome.TIMEOUT,
           Outcome.LOST}  # what one call of the learner's function can report
_released: dict | None = None


class ReferenceMissing(Exception):
    """The expected values need a packaged module that this release ships without answers."""


class Malformed(ValueError):
    """Collected outcomes that are not what `learner.collect` writes (a faked or cut file)."""


def released_expected(ex: Exercise, c: Case, rank: int | None, world: int | None) -> Any:
    """A student release's expected value, computed by the instructor's reference when the
    release was made: used where the release does not ship the reference."""
    global _released
    if _released is None:
        _released = plain.loads(RELEASED_EXPECTED.read_text()) if RELEASED_EXPECTED.is_file() else {}
    entry = _released.get(ex.name)
    index = next(i for i, x in enumerate(ex.cases) if x is c)
    if entry is None or entry["world"] != world or index >= len(entry["cases"]):
        raise ReferenceMissing(_("{name}'s expected values need a reference that this student "
                                 "release does not ship; check it in the instructor's "
                                 "repository", name=ex.name))
    return entry["cases"][index][rank]


_PREPARED: dict[tuple[int, int, int | None, int | None], Any] = {}


def prepare(ex: Exercise) -> None:
    """Compute every expected value of `ex` now and keep it for `judge` (course-grade does
    this before a submission runs, so nothing it does on the machine can change them)."""
    world = ex.world_size if ex.distributed else None
    for i, c in enumerate(ex.cases):
        for rank in (range(world) if world else [None]):
            _PREPARED[(id(ex), i, rank, world)] = expected(ex, c, rank, world)


def expected(ex: Exercise, c: Case, rank: int | None = None, world: int | None = None) -> Any:
    """The expected value, from the packaged reference only (never the learner's overlay)."""
    if c.has_expected:
        return c.expected
    index = next((i for i, x in enumerate(ex.cases) if x is c), None)
    if (id(ex), index, rank, world) in _PREPARED:
        return copy.deepcopy(_PREPARED[(id(ex), index, rank, world)])
    args, kwargs = copy.deepcopy((c.args, c.kwargs))
    if rank is not None:
        args, kwargs = substitute(args, rank, world), substitute(kwargs, rank, world)
    with packaged_only():
        try:
            return ex.judge_side("reference")(*args, **kwargs)
        except ModuleNotFoundError as exc:
            if not (exc.name or "").startswith(REFERENCES):
                raise  # where a submission runs, the judge's side is absent: the table below
        except Exception as exc:
            # In a release a stub's NotImplementedError may surface wrapped (a CheckpointError)
            if not isinstance(exc, NotImplementedError) and all(map(reference_shipped, COMPONENTS)):
                raise
    return released_expected(ex, c, rank, world)


def expected_values(ex: Exercise, cases: Sequence[Case] | None = None) -> dict:
    """Every expected value of an exercise (of `cases`, by default all of them), as
    `released_expected` reads them back."""
    world = ex.world_size if ex.distributed else None
    ranks = range(world) if world else [None]
    return {"world": world, "cases": [{r: expected(ex, c, r, world) for r in ranks}
                                      for c in (ex.cases if cases is None else cases)]}


def _outcome_row(rank: Any, out: dict, want: Any, ex: Exercise, limit: float,
                 c: Case | None = None) -> Row:
    shown = show(want)
    status = Outcome(out["status"])
    if status is Outcome.RETURNED and "unplain" in out:
        return Row(rank, False, shown, out["unplain"], _(
            "not a value the check can compare (numbers, strings, lists, tuples, dicts and "
            "tensors are)"))
    if status is Outcome.RETURNED:
        got = out["value"]
        diff = mismatch(got, want, ex.rtol, ex.atol)
        if diff is None:
            return Row(rank, True, shown, show(got), sat_out=want is None and got is None)
        note = _(WRONG_VALUE) if diff == WRONG_VALUE else diff
        if ex.explain is not None and c is not None:
            note = _explained(ex, c, rank, want, got) or note
        return Row(rank, False, shown, show(got), note or "")
    if status is Outcome.NOT_IMPLEMENTED:
        return Row(rank, False, shown, "NotImplementedError", _("not implemented yet"), status)
    if status is Outcome.TIMEOUT:
        note = _("timed out after {limit}s (endless loop or deadlock?)", limit=f"{limit:g}")
        if out.get("stopped") is False:
            note += _("; it is still running in the background: restart the kernel if slow")
        return Row(rank, False, shown, _("no result"), note, status)
    if status is Outcome.LOST:
        return Row(rank, False, shown, _("no result"), out["note"], status)
    where = f" ({out['where']})" if out.get("where") else ""
    return Row(rank, False, shown, out["error"], _("raised {error}", error=out["error"]) + where,
               status)


def strays(links: list[dict | None]) -> dict[int, str]:
    """{rank: why} for every rank whose messages in a case were not all received (or that
    waited for one nobody sent), from each rank's `case_links()`."""
    sent: dict[tuple[int, int, int], int] = {}
    got: dict[tuple[int, int, int], int] = {}
    for rank, mine in enumerate(links):
        for peer, tag, n in (mine or {}).get("sent", []):
            sent[(rank, peer, tag)] = sent.get((rank, peer, tag), 0) + n
        for peer, tag, n in (mine or {}).get("received", []):
            got[(peer, rank, tag)] = got.get((peer, rank, tag), 0) + n
    found: dict[int, str] = {}
    for (src, dst, tag) in sorted(set(sent) | set(got)):
        extra = sent.get((src, dst, tag), 0) - got.get((src, dst, tag), 0)
        if extra > 0:
            found.setdefault(src, _("rank {rank} sent {n} message(s) to rank {peer} (tag {tag}) "
                                    "that nobody received", rank=src, n=extra, peer=dst, tag=tag))
        elif extra < 0:
            found.setdefault(dst, _("rank {rank} waited for {n} message(s) from rank {peer} "
                                    "(tag {tag}) that nobody sent", rank=dst, n=-extra,
                                    peer=src, tag=tag))
    return found


def _explained(ex: Exercise, c: Case, rank: Any, want: Any, got: Any) -> str | None:
    """The exercise's own reason for a wrong value, or None (its failure is not the learner's:
    the generic difference is shown instead)."""
    try:
        why = ex.judge_side("explain")(c, rank, want, got)
    except Exception:  # noqa: BLE001 - a value too wrong for the explanation to read
        return None
    return str(why)[:MAX_TEXT] if why else None


def _rows(ex: Exercise, c: Case, outs: list[dict], limit: float) -> list[Row]:
    """One row per call (per rank when distributed), and the total's row if the exercise has one."""
    if not ex.distributed:
        return [_outcome_row(None, outs[0], expected(ex, c), ex, limit, c)]
    world = len(outs)
    want = [expected(ex, c, r, world) for r in range(world)]
    rows = [_outcome_row(r, out, want[r], ex, limit, c) for r, out in enumerate(outs)]
    for rank, why in strays([out.get("links") for out in outs]).items():
        if 0 <= rank < len(rows):  # a message left over is this case's failure, on its sender
            row = rows[rank]
            row.note = why if row.passed or not row.note else f"{row.note}; {why}"
            row.passed, row.outcome, row.sat_out = False, Outcome.WRONG, False
    if ex.total is not None:
        if all(o["status"] == Outcome.RETURNED and "unplain" not in o for o in outs):
            rows.append(_outcome_row("all", {"status": Outcome.RETURNED,
                                             "value": ex.total([o["value"] for o in outs])},
                                     ex.total(want), ex, limit))
        else:
            rows.append(Row("all", False, show(ex.total(want)), _("no result"),
                            _("some ranks gave no value"), Outcome.LOST))
    return rows


def _summary(ex: Exercise, cases: list[CaseResult], stopped: str) -> tuple[float, str]:
    failed = [c for c in cases if not c.passed]
    points = round(ex.points * (len(cases) - len(failed)) / len(cases), 2)
    if stopped:
        return points, stopped
    if not failed:
        return points, _("all {n} cases passed", n=len(cases))
    first = failed[0]
    row = next(r for r in first.rows if not r.passed)
    rank = "" if row.rank is None else (_("all ranks: ") if row.rank == "all" else
                                        _("rank {rank}: ", rank=row.rank))
    what = row.note
    if what == _(WRONG_VALUE):
        what = _("expected {expected}, got {got}", expected=row.expected, got=row.got)
    return points, _("{failed} of {n} cases failed; first: {label}: {rank}{what}",
                     failed=len(failed), n=len(cases), label=first.label, rank=rank, what=what)


def zero(ex: Exercise, reason: str, cases: list | None = None, *,
         not_implemented: bool = False) -> Result:
    """No points, and why."""
    return Result(ex.name, 0.0, float(ex.points), reason, cases or [], ex.hints,
                  not_implemented=not_implemented)


def judge(ex: Exercise, collected: list[dict], limit: float) -> Result:
    """Points in proportion to cases passed; a case with no outcome (cut short) counts as failed."""
    cases: list[CaseResult] = []
    stopped = ""
    for i, c in enumerate(ex.cases):
        label = c.describe(ex.function)
        if stopped or i >= len(collected):
            cases.append(CaseResult(label, [Row(None, False, "", "", _("not run"),
                                                Outcome.NOT_RUN)]))
            continue
        try:
            rows = _rows(ex, c, collected[i]["outs"], limit)
        except ReferenceMissing as exc:
            return zero(ex, str(exc), cases)
        halt = collected[i]["halt"]
        cases.append(CaseResult(label, rows))
        outcomes = {r.outcome for r in rows}
        if Outcome.NOT_IMPLEMENTED in outcomes:
            return zero(ex, _("not implemented yet: {function} raises NotImplementedError",
                              function=ex.function), cases, not_implemented=True)
        if Outcome.TIMEOUT in outcomes:
            where = [str(r.rank) for r in rows
                     if r.rank is not None and r.outcome is Outcome.TIMEOUT]
            ranks = _(" on rank(s) {ranks}", ranks=", ".join(where)) if where else ""
            stopped = _("timed out: {label} did not finish within {limit}s{ranks} (an endless "
                        "loop or a deadlock?)", label=label, limit=f"{limit:g}", ranks=ranks)
            stopped += "; " + halt if halt else ""
        elif halt:
            stopped = halt
    points, reason = _summary(ex, cases, stopped)
    return Result(ex.name, points, float(ex.points), reason, cases, ex.hints)


def _text(value: Any, what: str) -> str:
    if not isinstance(value, str):
        raise Malformed(f"{what} is a {type(value).__name__}, not text")
    return value[:MAX_TEXT]


MAX_LINKS = 256  # (peer, tag) pairs one rank may report per case


def _links(value: Any, where: str) -> dict:
    """A rank's record of its messages (`sub_worlds.case_links`), checked: two lists of
    [peer, tag, count] triples of small non-negative integers."""
    if not isinstance(value, dict) or set(value) != {"sent", "received"}:
        raise Malformed(f"{where}: links must hold 'sent' and 'received'")
    for kind, triples in value.items():
        if not isinstance(triples, list) or len(triples) > MAX_LINKS or not all(
                isinstance(t, list) and len(t) == 3 and all(
                    type(x) is int and 0 <= x < 2 ** 31 for x in t) for t in triples):
            raise Malformed(f"{where}: links {kind!r} must be at most {MAX_LINKS} "
                            f"[peer, tag, count] triples")
    return {kind: [list(t) for t in triples] for kind, triples in value.items()}


def validated(ex: Exercise, doc: Any) -> tuple[str, list[dict]]:
    """(why the function was not called or "", its outcomes) from a document a kernel wrote,
    checked field by field against what `learner.collect` writes for `ex`."""
    if not isinstance(doc, dict) or doc.get("exercise") != ex.name:
        raise Malformed(f"not the outcomes of {ex.name}")
    if "refused" in doc:
        return _text(doc["refused"], "the refusal") or "refused", []
    cases = doc.get("cases")
    if not isinstance(cases, list) or len(cases) > len(ex.cases):
        raise Malformed(f"expected at most {len(ex.cases)} cases")
    calls = ex.world_size if ex.distributed else 1
    clean = []
    for i, case in enumerate(cases):
        if not (isinstance(case, dict) and set(case) == {"outs", "halt"}
                and isinstance(case["outs"], list) and len(case["outs"]) == calls):
            raise Malformed(f"case {i}: expected {calls} outcome(s) and a halt note")
        outs = []
        for r, out in enumerate(case["outs"]):
            if not isinstance(out, dict) or out.get("status") not in {o.value for o in _CALLED}:
                raise Malformed(f"case {i}, call {r}: no known status")
            keep = {"status": Outcome(out["status"])}
            if keep["status"] is Outcome.RETURNED:
                if "unplain" in out:
                    keep["unplain"] = _text(out["unplain"], "a value's description")
                elif "value" in out:
                    try:
                        keep["value"] = plain.from_plain(out["value"])
                    except plain.PlainError as exc:
                        raise Malformed(f"case {i}, call {r}: {exc}") from None
                else:
                    raise Malformed(f"case {i}, call {r}: returned, but no value")
            for key in ("where", "error", "note"):
                if key in out:
                    keep[key] = _text(out[key], key)
            if keep["status"] is Outcome.ERROR:
                keep.setdefault("error", "an error")
            if keep["status"] is Outcome.LOST:
                keep.setdefault("note", "no result")
            if isinstance(out.get("stopped"), bool):
                keep["stopped"] = out["stopped"]
            if "links" in out:
                keep["links"] = _links(out["links"], f"case {i}, call {r}")
            outs.append(keep)
        clean.append({"outs": outs, "halt": _text(case["halt"], "the halt note")})
    return "", clean
