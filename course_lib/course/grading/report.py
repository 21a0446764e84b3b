"""The outcome of checking one exercise, shown as a table in JupyterLab or as plain text."""

from __future__ import annotations

import enum
import html
from dataclasses import asdict, dataclass, field

from course_lib.i18n import _

_WIDTH = 60  # longest cell in the plain-text table


class Outcome(str, enum.Enum):
    """What happened to one call of the learner's function (RETURNED: it gave a value) and so
    to its row. A str, so results stay plain JSON."""

    RETURNED = "returned"
    PASSED = "passed"
    WRONG = "wrong"
    NOT_IMPLEMENTED = "not implemented"
    ERROR = "error"
    TIMEOUT = "timeout"
    LOST = "lost"  # no result came back: another rank failed, the engine died...
    NOT_RUN = "not run"


@dataclass
class Row:
    """One call's verdict: a case on one rank (rank None: run locally; "all": the total)."""

    rank: int | str | None
    passed: bool
    expected: str
    got: str
    note: str = ""
    outcome: Outcome | None = None  # None: PASSED or WRONG, from `passed`
    sat_out: bool = False  # a rank outside this case's world, as expected: not shown

    def __post_init__(self) -> None:
        if self.outcome is None:
            self.outcome = Outcome.PASSED if self.passed else Outcome.WRONG
        self.outcome = Outcome(self.outcome)


@dataclass
class CaseResult:
    """All rows of one test case; it passes only if every row does."""

    label: str
    rows: list[Row] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        return bool(self.rows) and all(r.passed for r in self.rows)


@dataclass
class Result:
    """Points for one exercise, why, and the per-case (per-rank) table behind them."""

    exercise: str
    points: float
    max_points: float
    reason: str
    cases: list[CaseResult] = field(default_factory=list)
    hints: tuple[str, ...] = ()  # the exercise's hint levels, shown up to `hint_level`
    hint_level: int = 0          # how many levels the learner asked for (check(..., hint=k))
    not_implemented: bool = False  # the stub still raises: one line, no table

    @property
    def passed(self) -> bool:
        return self.points >= self.max_points

    def with_hints(self, level: int) -> "Result":
        """The same result, showing the first `level` hint levels (0: none)."""
        from dataclasses import replace

        return replace(self, hint_level=max(0, int(level)))

    def to_dict(self) -> dict:
        """Plain JSON-ready data (what the batch grader reads back from a kernel)."""
        data = asdict(self)
        data["hints"] = list(self.hints)
        return data

    @classmethod
    def from_dict(cls, data: dict) -> "Result":
        cases = [CaseResult(c["label"], [Row(**r) for r in c["rows"]]) for c in data["cases"]]
        return cls(data["exercise"], data["points"], data["max_points"], data["reason"],
                   cases, tuple(data.get("hints", ())), int(data.get("hint_level", 0)),
                   bool(data.get("not_implemented", False)))

    def _table(self) -> tuple[list[str], list[list[str]], list[bool]]:
        if self.not_implemented:
            return [], [], []
        shown = [[r for r in c.rows if not r.sat_out] for c in self.cases]
        rows = [r for found in shown for r in found]
        ranked = any(r.rank is not None for r in rows)
        noted = any(r.note for r in rows)
        head = ([_("case")] + ([_("rank")] if ranked else [])
                + [_("result"), _("expected"), _("got")] + ([_("note")] if noted else []))
        body, ok = [], []
        for c, found in zip(self.cases, shown):
            for i, r in enumerate(found):
                rank = [] if not ranked else ["" if r.rank is None else str(r.rank)]
                note = [r.note] if noted else []
                body.append([c.label if i == 0 else ""] + rank +
                            [_("pass") if r.passed else _("FAIL"), r.expected, r.got] + note)
                ok.append(r.passed)
        return head, body, ok

    def _title(self) -> str:
        return _("{exercise}: {points} / {max_points} points. {reason}", exercise=self.exercise,
                 points=_num(self.points), max_points=_num(self.max_points), reason=self.reason)

    def _hint_lines(self) -> list[str]:
        """The hint levels asked for; else, on a failure that has hints, how to ask."""
        if self.passed or not self.hints or self.not_implemented and not self.hint_level:
            return []
        if not self.hint_level:
            return [_("Stuck? check(..., hint=1) gives a first hint ({levels} levels).",
                      levels=len(self.hints))]
        shown = [_("Hint {level}: {hint}", level=k + 1, hint=_(h))
                 for k, h in enumerate(self.hints[:self.hint_level])]
        if self.hint_level < len(self.hints):
            shown.append(_("check(..., hint={next}) gives the next level.",
                           next=self.hint_level + 1))
        return shown

    def __str__(self) -> str:
        head, body, _ok = self._table()
        lines = [self._title()]
        if body:
            cells = [[_clip(x) for x in row] for row in [head] + body]
            widths = [max(len(row[i]) for row in cells) for i in range(len(head))]
            fmt = lambda row: "  ".join(x.ljust(w) for x, w in zip(row, widths)).rstrip()  # noqa: E731
            lines += [fmt(cells[0]), fmt(["-" * w for w in widths])] + [fmt(r) for r in cells[1:]]
        return "\n".join(lines + self._hint_lines())

    def _repr_pretty_(self, p, cycle: bool) -> None:
        p.text(str(self))

    def _repr_html_(self) -> str:
        head, body, ok = self._table()
        colour = "#1a7f37" if self.passed else "#cf222e"
        td = 'style="text-align:left;padding:2px 8px;font-family:monospace"'
        out = [f'<div><p style="color:{colour};font-weight:bold">{html.escape(self._title())}</p>']
        if body:
            out.append("<table><tr>" + "".join(f"<th {td}>{html.escape(h)}</th>" for h in head)
                       + "</tr>")
            for row, passed in zip(body, ok):
                mark = {_("pass"): "&#10004; " + _("pass"), _("FAIL"): "&#10008; " + _("fail")}
                cells = [mark.get(x, html.escape(x)) if i == head.index(_("result")) else
                         html.escape(x) for i, x in enumerate(row)]
                bg = "" if passed else ' style="background:rgba(207,34,46,0.08)"'
                out.append(f"<tr{bg}>" + "".join(f"<td {td}>{c}</td>" for c in cells) + "</tr>")
            out.append("</table>")
        out += [f"<p>{html.escape(line)}</p>" for line in self._hint_lines()]
        return "\n".join(out) + "</div>"


def _num(x: float) -> str:
    return f"{x:g}"


def _clip(text: str) -> str:
    text = " ".join(str(text).split())
    return text if len(text) <= _WIDTH else text[: _WIDTH - 3] + "..."
