"""What a lesson asks of a learner: its time, and whether any exercise's answer shows too early.

The design's budget counts a lesson as prose words / 150 + given code lines / 12 + learner
lines x 1.5 minutes, at most 90 (`estimate`). The answer of an exercise is its solution region;
its *code expressions* are its normalized lines and its runs of tokens (`Expressions`): text
that shares one with a solution says part of the answer, whether it is a demo cell above the
exercise, a docstring, a markdown code span, a hint or a check's feedback.

`python -m course_lib.course.lesson_shape` prints every lesson's estimate, in both editions.
"""

from __future__ import annotations

import io
import json
import re
import sys
import tokenize
from dataclasses import dataclass
from pathlib import Path
from course_lib.course.paths import ROOT

BEGIN, END = "### BEGIN SOLUTION", "### END SOLUTION"
STUB = ("# YOUR CODE HERE", "raise NotImplementedError")
WORDS_PER_MINUTE, LINES_PER_MINUTE, MINUTES_PER_LEARNER_LINE = 150, 12, 1.5
BUDGET_MINUTES, LONGEST_MARKDOWN = 90, 350
# Shared code: a run of this many tokens, or a whole line of at least the second number.
HINT_RUN, HINT_LINE = 5, 4    # in a hint or a check's feedback (prose: any code is too much)
LEAK_RUN, LEAK_LINE = 8, 6    # in the cells above an exercise (code: idioms aside)
# A token: a string literal, a number, a name, or one operator or bracket.
_TOKEN = re.compile(r"""[rbuRBUfF]{0,2}("[^"\n]*"|'[^'\n]*')|\d+(?:\.\d+)?(?:e-?\d+)?|\w+|"""
                    r"""\*\*=?|//=?|->|[-+*/%@&|^<>=!]=|<<|>>|[^\s\w]""")


def _source(cell: dict) -> str:
    src = cell.get("source", "")
    return "".join(src) if isinstance(src, list) else src


def tokens(text: str) -> list[str]:
    """The tokens of a piece of code or prose, strings kept whole."""
    return [m.group(0) for m in _TOKEN.finditer(text)]


def _is_word(token: str) -> bool:
    return bool(re.fullmatch(r"[A-Za-z_]+", token))


def _is_code(toks: tuple[str, ...]) -> bool:
    """A run of tokens is code when it names something and holds an operator, a bracket or a
    literal: English words alone are prose, numbers and brackets alone are a value."""
    return (any(re.fullmatch(r"[A-Za-z_]\w*", t) for t in toks)
            and not all(map(_is_word, toks)))


def _code_only(line: str) -> str:
    """A line without its comment (a `#` outside strings), whitespace collapsed."""
    try:
        toks = list(tokenize.generate_tokens(io.StringIO(line).readline))
        cut = next((t.start[1] for t in toks if t.type == tokenize.COMMENT), len(line))
    except (tokenize.TokenError, IndentationError, SyntaxError):
        cut = line.find(" #") if " #" in line else len(line)
    return " ".join(line[:cut].split())


def learner_lines(source: str) -> list[str]:
    """The code a learner writes in a cell: non-blank, non-comment lines of its solution
    regions, whitespace collapsed."""
    out, inside = [], False
    for line in source.split("\n"):
        marker = line.strip()
        if marker == BEGIN:
            inside = True
        elif marker == END:
            inside = False
        elif inside and marker and not marker.startswith("#"):
            out.append(_code_only(line))
    return [line for line in out if line]


def regions(source: str) -> list[list[str]]:
    """Each solution region of a cell, as its learner lines."""
    found, current = [], None
    for line in source.split("\n"):
        marker = line.strip()
        if marker == BEGIN:
            current = []
        elif marker == END and current is not None:
            found.append([x for x in (_code_only(l) for l in current) if x and
                          not x.startswith("#")])
            current = None
        elif current is not None:
            current.append(line)
    return found


@dataclass(frozen=True)
class Expressions:
    """A solution's code expressions: its normalized lines that are code rather than a word
    or two (`return out` and `else:` are everyone's), and every run of `run` tokens that holds
    an operator, a bracket, a number or a string (a run of English words says nothing)."""

    lines: frozenset[tuple[str, ...]]
    runs: frozenset[tuple[str, ...]]
    run: int

    @classmethod
    def of(cls, lines: list[str], run: int, min_line: int) -> "Expressions":
        kept, grams = set(), set()
        for line in lines:
            toks = tuple(tokens(line))
            if len(toks) >= min_line and _is_code(toks):
                kept.add(toks)
            for i in range(len(toks) - run + 1):
                gram = toks[i:i + run]
                if _is_code(gram):
                    grams.add(gram)
        return cls(frozenset(kept), frozenset(grams), run)

    def without(self, common: frozenset[tuple[str, ...]]) -> "Expressions":
        """The same, less the runs and lines in `common` (and lines made only of such runs)."""
        runs = self.runs - common
        lines = frozenset(line for line in self.lines if line not in common and (
            len(line) < self.run or any(line[i:i + self.run] in runs
                                        for i in range(len(line) - self.run + 1))))
        return Expressions(lines, runs, self.run)

    def found_in(self, text: str) -> list[str]:
        """The expressions `text` shares with the solution, each once, as text."""
        toks = tokens(text)
        hits = []
        for line in self.lines:
            n = len(line)
            if any(tuple(toks[i:i + n]) == line for i in range(len(toks) - n + 1)):
                hits.append(" ".join(line))
        seen = set()
        for i in range(len(toks) - self.run + 1):
            gram = tuple(toks[i:i + self.run])
            if gram in self.runs and gram not in seen:
                seen.add(gram)
                if not any(" ".join(gram) in h for h in hits):
                    hits.append(" ".join(gram))
        return hits


def notebook(path: Path) -> dict:
    return json.loads(path.read_text(encoding="utf-8"))


def given_code(source: str) -> str:
    """A code cell without its solution regions and stubs: what any reader sees of it."""
    kept, inside = [], False
    for line in source.split("\n"):
        s = line.strip()
        if s in (BEGIN, END):
            inside = s == BEGIN
        elif not inside and s not in STUB:
            kept.append(line)
    return "\n".join(kept)


def idioms(root: Path = ROOT, run: int = LEAK_RUN, lessons: int = 3) -> frozenset:
    """Runs of `run` tokens, and whole lines, that the given code of at least `lessons`
    different lessons shows (`group=group, async_op=True`, `dist = default_dist(dist)`): the
    course's idioms, which say nothing about one exercise's answer."""
    seen: dict[tuple[str, ...], set[str]] = {}
    for sol in sorted((root / "solutions").glob("*.ipynb")):
        for cell in notebook(sol)["cells"]:
            if cell["cell_type"] != "code":
                continue
            code = given_code(_source(cell))
            toks = tokens(code)
            found = {tuple(toks[i:i + run]) for i in range(len(toks) - run + 1)}
            found |= {tuple(tokens(_code_only(line))) for line in code.split("\n")}
            for gram in found:
                seen.setdefault(gram, set()).add(sol.stem)
    return frozenset(g for g, where in seen.items() if len(where) >= lessons)


@dataclass(frozen=True)
class Leak:
    """Code of an exercise's answer that the student notebook shows before the exercise."""

    lesson: str
    cell: int          # the exercise's cell in the solution notebook
    first_line: str    # the solution region's first line, to name it
    shown_in: int      # the student notebook's cell that shows it
    shared: tuple[str, ...]

    def __str__(self) -> str:
        where = "its own cell" if self.shown_in < 0 else f"cell {self.shown_in}"
        return (f"{self.lesson}[{self.cell}] ({self.first_line!r}): {where} of the student "
                f"notebook shows {'; '.join(self.shared[:3])}")


_SIGNATURE = re.compile(r"^\s*(async\s+)?def\s")


def _without_signatures(code: str) -> str:
    """Code without its `def` headers (each up to the line that ends it with a colon)."""
    kept, header = [], False
    for line in code.split("\n"):
        header = header or bool(_SIGNATURE.match(line))
        if not header:
            kept.append(line)
        elif _code_only(line).endswith(":"):
            header = False
    return "\n".join(kept)


def solution_of(notebook_path: Path, function: str) -> list[str]:
    """The learner lines of every solution region in the cell that defines `function`."""
    for cell in notebook(notebook_path)["cells"]:
        src = _source(cell)
        if cell["cell_type"] == "code" and BEGIN in src and re.search(
                rf"^\s*def {re.escape(function)}\(", src, re.M):
            return [line for region in regions(src) for line in region]
    return []


def code_in_feedback(text: str, solution: list[str]) -> list[str]:
    """The solution's code expressions that a hint or a check's feedback shows."""
    return Expressions.of(solution, HINT_RUN, HINT_LINE).found_in(text)


def leaks(solution: Path, student: Path, common: frozenset = frozenset()) -> list[Leak]:
    """Every solution region of `solution` whose code expressions appear in the student
    notebook (`student`, any edition) above its exercise, or around its stub in its own cell
    (its `def` line, the exercise's contract, aside)."""
    sol, st = notebook(solution), notebook(student)
    position = {c.get("id"): j for j, c in enumerate(st["cells"])}
    found = []
    for i, cell in enumerate(sol["cells"]):
        if cell["cell_type"] != "code" or cell.get("id") not in position:
            continue
        j = position[cell["id"]]
        for region in regions(_source(cell)):
            if not region:
                continue
            exprs = Expressions.of(region, LEAK_RUN, LEAK_LINE).without(common)
            for k in range(j + 1):
                text = _source(st["cells"][k])
                if k == j:
                    text = _without_signatures(given_code(text))
                hits = exprs.found_in(text)
                if hits:
                    found.append(Leak(solution.stem, i, region[0][:40], -1 if k == j else k,
                                      tuple(hits)))
    return found


@dataclass(frozen=True)
class Estimate:
    """A lesson's cost to a learner, counted as the design counts it."""

    lesson: str
    words: int
    given: int
    learner: int
    longest_markdown: int

    @property
    def minutes(self) -> float:
        return (self.words / WORDS_PER_MINUTE + self.given / LINES_PER_MINUTE
                + self.learner * MINUTES_PER_LEARNER_LINE)


def estimate(solution: Path, edition: Path | None = None) -> Estimate:
    """The estimate of one lesson: prose words and given code lines as the learner reads them
    (the student notebook of `edition`, else the solution with its answers taken out), learner
    lines from the solution."""
    sol = notebook(solution)
    learner = sum(len(learner_lines(_source(c))) for c in sol["cells"] if c["cell_type"] == "code")
    cells = notebook(edition)["cells"] if edition else sol["cells"]
    words = given = longest = 0
    for cell in cells:
        src = _source(cell)
        if cell["cell_type"] == "markdown":
            n = len(src.split())
            words, longest = words + n, max(longest, n)
        elif cell["cell_type"] == "code":
            inside = False
            for line in src.split("\n"):
                s = line.strip()
                if s in (BEGIN, END):
                    inside = s == BEGIN
                elif s and not inside and s not in STUB and not s.startswith("#|"):
                    given += 1
    return Estimate(solution.stem, words, given, learner, longest)


def editions(root: Path = ROOT) -> dict[str, Path]:
    """{"en": notebooks/, "es": notebooks/es/, ...}: the student releases a learner reads."""
    found = {"en": root / "notebooks"}
    found.update({p.name: p for p in sorted((root / "notebooks").iterdir())
                  if p.is_dir() and not p.name.startswith(".")})
    return found


def table(root: Path = ROOT) -> list[str]:
    """One line per lesson and edition: words, given lines, learner lines, minutes."""
    lines = [f"{'lesson':34} {'ed':3} {'words':>6} {'given':>6} {'learner':>8} {'minutes':>8}"]
    total = 0
    for sol in sorted((root / "solutions").glob("*.ipynb")):
        for lang, folder in editions(root).items():
            student = folder / sol.name
            if not student.is_file():
                continue
            e = estimate(sol, student)
            total += e.learner if lang == "en" else 0
            lines.append(f"{e.lesson:34} {lang:3} {e.words:6} {e.given:6} {e.learner:8} "
                         f"{e.minutes:8.1f}")
    lines.append(f"learner lines in all lessons: {total}")
    return lines


if __name__ == "__main__":
    print("\n".join(table()))
    sys.exit(0)
