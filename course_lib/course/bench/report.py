"""The benchmark page: `python -m course_lib.course.bench report` writes docs/benchmarks.md (and its
Spanish edition) from the runs kept in docs/bench/ (each benchmark's `--json`, and its `--plot`).

Per run: the command, the machine it ran on, one table of the figures as ratios measured in
the same run (never against another run's numbers), the target beside each, met or missed, and
the plot. The page holds no date and no anecdote: what was measured, where, and against what.
`course.py build --check` fails while the page differs from what its runs give.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable

from course_lib.i18n import N_, _, language
from course_lib.course.paths import ROOT

RESULTS = ROOT / "docs" / "bench"
PAGES = {"en": ROOT / "docs" / "benchmarks.md", "es": ROOT / "docs" / "benchmarks.es.md"}
KiB, MiB = 2 ** 10, 2 ** 20


@dataclass(frozen=True)
class Figure:
    """One line of a run's table: a same-run ratio (or a count), and its target if it has one."""

    what: str
    value: float | None
    limit: float | None = None   # met when value <= limit
    unit: str = "x"

    @property
    def met(self) -> bool | None:
        if self.limit is None or self.value is None:
            return None
        return self.value <= self.limit


def _size(n: int) -> str:
    return f"{n // MiB} MiB" if n >= MiB else f"{n // KiB} KiB" if n >= KiB else f"{n} B"


def _allreduce(rows: list[dict]) -> Iterable[Figure]:
    """Ours (auto, else our fastest algorithm) against MPI and gloo, size by size."""
    for n in sorted({r["bytes"] for r in rows}):
        at = [r for r in rows if r["bytes"] == n]
        scratch = [r for r in at if r["backend"] == "scratch"]
        ours = next((r for r in scratch if r["algorithm"] == "auto"), None) or (
            min(scratch, key=lambda r: r["seconds"]) if scratch else None)
        if ours is None:
            continue
        for backend, limit in (("mpi", 3.0 if n <= 4 * KiB else 1.2), ("gloo", 0.5)):
            other = next((r for r in at if r["backend"] == backend), None)
            if other:
                yield Figure(_("ours / {backend} at {size}", backend=backend, size=_size(n)),
                             ours["seconds"] / other["seconds"], limit)


def _ddp(rows: list[dict]) -> Iterable[Figure]:
    for r in rows:
        if r.get("vs_torch_ddp") is not None and not r["variant"].startswith("torch"):
            limit = 0.9 if r["variant"].startswith("ddp") else None
            yield Figure(_("{variant} / torch DDP", variant=r["variant"]), r["vs_torch_ddp"],
                         limit)


ZERO_LIMITS = {"zero1": 1.10, "zero2": 1.10, "zero3": 1.4}


def _zero(rows: list[dict]) -> Iterable[Figure]:
    for r in rows:
        v = r["variant"]
        if r.get("vs_our_ddp") is not None and v != "ddp" and not v.startswith("torch"):
            yield Figure(_("{variant} / our DDP", variant=v), r["vs_our_ddp"],
                         ZERO_LIMITS.get(v))
        if r.get("vs_torch") is not None and not v.startswith("torch"):
            yield Figure(_("{variant} / torch's counterpart", variant=v), r["vs_torch"], 0.9)
        if r.get("formula_mib"):
            yield Figure(_("{variant}: state bytes / formula", variant=v),
                         r["state_mib"] / r["formula_mib"], None)


def _train(rows: list[dict]) -> Iterable[Figure]:
    for r in rows:
        if r.get("stack") == "ours" and r.get("vs_torch") is not None:
            yield Figure(_("{layout} {variant} / torch's stack", layout=r["layout"],
                           variant=r["variant"]), r["vs_torch"], 1.0)
    for r in rows:
        if r.get("vs_formula") is not None:
            yield Figure(_("{variant}: memory / formula", variant=r["variant"]),
                         r["vs_formula"], None)


def _checkpoint(rows: list[dict]) -> Iterable[Figure]:
    for r in rows:
        if r["variant"] == "ours" and "save_vs_dcp" in r:
            yield Figure(_("world {world}: save / DCP's", world=r["world"]), r["save_vs_dcp"], 1.0)
            yield Figure(_("world {world}: load / DCP's", world=r["world"]), r["load_vs_dcp"], 1.0)


def _pipeline(rows: list[dict]) -> Iterable[Figure]:
    for r in rows:
        yield Figure(_("{stages} stages, {schedule}, m={m}: bubble - model", stages=r["stages"],
                       schedule=r["schedule"], m=r["m"]), r["bubble"] - r["ideal_bubble"],
                     0.1 if r["stages"] == 2 else None, unit="")


def _tp(rows: list[dict]) -> Iterable[Figure]:
    one = next((r for r in rows if r["world"] == 1), None)
    for r in rows:
        if one and r["world"] > 1:
            yield Figure(_("tp={world}: step time / one rank's", world=r["world"]),
                         r["step_s"] / one["step_s"], None)
            yield Figure(_("tp={world}: parameter bytes per rank / one rank's", world=r["world"]),
                         r["param_MiB_per_rank"] / one["param_MiB_per_rank"], None)


FIGURES: dict[str, Callable[[list[dict]], Iterable[Figure]]] = {
    "allreduce": _allreduce, "ddp": _ddp, "zero": _zero, "train": _train,
    "checkpoint": _checkpoint, "pipeline": _pipeline, "tp": _tp}
TITLES = {"allreduce": N_("all_reduce against gloo and MPI"),
          "ddp": N_("DDP against torch's DDP"),
          "zero": N_("ZeRO and FSDP against our DDP and torch's"),
          "train": N_("The capstone's layouts against torch's stack"),
          "checkpoint": N_("Checkpoints against torch.distributed.checkpoint"),
          "pipeline": N_("Pipeline schedules: bubble against the model"),
          "tp": N_("Tensor parallelism: time and memory per rank")}


def command(run: dict) -> str:
    """The command that produced a run (as it was typed, or rebuilt from its arguments)."""
    argv = run.get("argv")
    if not argv:
        skip = {"name", "json", "plot"}
        argv = [run["benchmark"]] + [
            f"--{k.replace('_', '-')}={v}" for k, v in sorted(run.get("args", {}).items())
            if k not in skip and v not in (None, False)]
    return "python -m course_lib.course.bench " + " ".join(shlex.quote(str(a)) for a in argv)


def machine(meta: dict) -> str:
    """Cores, CPU, and the versions the figures depend on."""
    parts = [_("{cpus} cores", cpus=meta.get("cpus", "?"))]
    if meta.get("cpu"):
        parts.append(str(meta["cpu"]))
    parts.append(f"Python {meta.get('python', '?')}, torch {meta.get('torch', '?')}")
    if meta.get("mpi"):
        parts.append(str(meta["mpi"]))
    return ", ".join(parts)


def _number(value: float | None, unit: str) -> str:
    if value is None:
        return "-"
    return f"{value:.2f}{unit}" if unit else f"{value:+.3f}"


def section(stem: str, run: dict) -> list[str]:
    """The page's part for one run: title, command, machine, figures against targets, plot."""
    name = run["benchmark"]
    lines = [f"## {_(TITLES.get(name, name))} (`{stem}`)", "",
             "```bash", command(run), "```", "",
             _("Machine: {machine}.", machine=machine(run.get("meta", {}))), ""]
    figures = list(FIGURES.get(name, lambda rows: [])(run["rows"]))
    if figures:
        lines += [f"| {_('figure')} | {_('measured')} | {_('target')} | |",
                  "| --- | ---: | ---: | --- |"]
        for f in figures:
            target = "-" if f.limit is None else (f"<= {f.limit:g}{f.unit}" if f.unit
                                                  else f"<= {f.limit:g}")
            verdict = "" if f.met is None else (_("met") if f.met else _("**missed**"))
            lines.append(f"| {f.what} | {_number(f.value, f.unit)} | {target} | {verdict} |")
        lines.append("")
    missed = [f for f in figures if f.met is False]
    if missed:
        lines += [_("Missed in this run: {n} of {total} targets.", n=len(missed),
                    total=sum(f.met is not None for f in figures)), ""]
    if run.get("plot"):
        lines += [f"![{stem}](bench/{run['plot']})", ""]
    return lines


def runs(folder: Path = RESULTS) -> dict[str, dict]:
    """{file stem: run} of every run kept in `folder`, its plot's file name added if present."""
    found = {}
    for path in sorted(Path(folder).glob("*.json")):
        run = json.loads(path.read_text(encoding="utf-8"))
        plot = path.with_suffix(".png")
        if plot.is_file():
            run["plot"] = plot.name
        found[path.stem] = run
    return found


def page(found: dict[str, dict], lang: str = "en") -> str:
    """The whole page, in `lang`."""
    with language(lang):
        lines = [f"# {_('Benchmarks')}", "",
                 _("Generated by `python -m course_lib.course.bench report` from the runs in "
                   "`docs/bench/`: do not edit. Every ratio compares figures measured in the "
                   "same run, on the machine named beside it; a ratio below 1 means ours is "
                   "faster (or smaller). Rerun a benchmark with the command shown and "
                   "`--json docs/bench/NAME.json --plot docs/bench/NAME.png`, then regenerate "
                   "this page."), ""]
        if not found:
            lines += [_("No runs are kept yet."), ""]
        for stem, run in found.items():
            lines += section(stem, run)
    return "\n".join(lines).rstrip() + "\n"


def pages(folder: Path = RESULTS) -> dict[Path, str]:
    """{path: text} of the page in every language, from the runs in `folder`."""
    found = runs(folder)
    return {path: page(found, lang) for lang, path in PAGES.items()}


def main(argv: list[str] | None = None) -> int:
    """`python -m course_lib.course.bench report [--results DIR]`: regenerate the benchmark page."""
    parser = argparse.ArgumentParser(prog="python -m course_lib.course.bench report",
                                     description=main.__doc__)
    parser.add_argument("--results", type=Path, default=RESULTS, help="the kept runs' folder")
    args = parser.parse_args(argv)
    for path, text in pages(args.results).items():
        path.write_text(text, encoding="utf-8")
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
