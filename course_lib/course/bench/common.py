"""Helpers every benchmark shares: statistics, a clock that waits for the GPU, the run's metadata,
JSON rows, a text table."""

from __future__ import annotations

import json
from dataclasses import dataclass
import os
import platform
import statistics
import time
from typing import Any, Iterable, Sequence

from course_lib.i18n import N_, _


def choose(text: str, known: Iterable[str], what: str = N_("variants")) -> list[str]:
    """The comma-separated names in `text`, each one of `known` (else a one-line exit)."""
    names = [n.strip() for n in text.split(",") if n.strip()]
    known = list(known)
    unknown = [n for n in names if n not in known]
    if unknown:
        raise SystemExit(_("unknown {what} {unknown}; choose from {known}", what=_(what),
                           unknown=unknown, known=", ".join(known)))
    return names


def median(values: Iterable[float]) -> float:
    """Median of the repeats: robust to the odd slow run on a shared 2-core machine."""
    return statistics.median(list(values))


def clock(device: Any = None) -> float:
    """`time.perf_counter()` once the work queued on `device` is done: on a CUDA device,
    `torch.cuda.synchronize(device)` first (kernels and NCCL calls return when they are queued,
    so the clock alone would time the queueing); on the CPU (or None) the clock at once. Time a
    region as `start = clock(device); ...; seconds = clock(device) - start`."""
    if device is not None:
        import torch

        device = torch.device(device)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    return time.perf_counter()


M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # glibc's mallopt parameters


def timing_process() -> None:
    """Set up a process that times training steps: one intra-op thread (the ranks share the
    cores), and memory a step frees kept for the next, as a GPU's caching allocator keeps it.
    glibc's malloc otherwise gives large buffers back to the kernel and faults them in again,
    which charges a variant for allocating per step rather than for its communication."""
    import ctypes

    import torch

    torch.set_num_threads(1)
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:  # not glibc: its allocator as it is
        return
    libc.mallopt(M_MMAP_THRESHOLD, 32 * 2**20)  # glibc's largest: smaller buffers use the heap
    libc.mallopt(M_TRIM_THRESHOLD, 2**30)  # and the heap keeps what they free


KEPT_MEMORY = N_("Timed in processes that keep the memory a step frees for the next (glibc's "
                 "`mallopt`), as a GPU's caching allocator does; every variant runs in the same "
                 "processes, so the setting holds for all of them alike.")


def balanced_order(names: Sequence[str], i: int) -> list[str]:
    """The order to step the variants in at iteration i: row i of a Williams design (a balanced
    Latin square). Over len(names) iterations, or twice as many for an odd count, each variant
    runs at every place and just after every other variant equally often, so none always runs
    first (after the compute-only step that ends an iteration) or after the same neighbour."""
    n = len(names)
    first, low, high = [], 0, n - 1  # 0, 1, n-1, 2, n-2, ...: every difference once
    while len(first) < n:
        first.append(low)
        low += 1
        if len(first) < n:
            first.append(high)
            high -= 1
    row = [names[(j + i) % n] for j in first]
    return row[::-1] if n % 2 and (i // n) % 2 else row  # odd n: the mirrored rows too


def slowest_rank(per_rank_seconds: Sequence[Sequence[float]]) -> list[float]:
    """Per repeat, the slowest rank's time: one operation lasts until its last rank finishes."""
    return [max(times) for times in zip(*per_rank_seconds)]


def cpu_model() -> str:
    """The CPU's model name (Linux's /proc/cpuinfo, else what the platform says)."""
    try:
        for line in open("/proc/cpuinfo", encoding="utf-8"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def mpi_version() -> str | None:
    """The MPI library mpi4py runs on (its first line), or None without mpi4py."""
    try:
        from mpi4py import MPI
    except ImportError:
        return None
    return " ".join(MPI.Get_library_version().strip().splitlines()[0].split())


def metadata() -> dict[str, Any]:
    """What a reader needs to judge the figures: the machine and the versions (no date and no
    host name: the page that shows them carries no history)."""
    import torch

    return {
        "cpus": os.cpu_count(),
        "cpu": cpu_model(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "mpi": mpi_version(),
    }


def write_json(path: str, name: str, rows: list[dict], args: dict[str, Any],
               argv: list[str] | None = None) -> None:
    """Write {"benchmark", "argv", "args", "meta", "rows"}, so a run can be re-plotted, compared
    or reported later (`course_lib.course.bench.report`)."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump({"benchmark": name, "argv": argv, "args": args, "meta": metadata(),
                   "rows": rows}, f, indent=1, default=str)


def format_table(rows: list[dict], columns: Sequence[str] | None = None) -> str:
    """A plain-text table of the rows (floats to 4 significant digits)."""
    if not rows:
        return _("(no rows)")
    columns = list(columns or rows[0].keys())

    def cell(v: Any) -> str:
        return f"{v:.4g}" if isinstance(v, float) else str(v)

    table = [columns] + [[cell(r.get(c, "")) for c in columns] for r in rows]
    widths = [max(len(line[i]) for line in table) for i in range(len(columns))]
    return "\n".join("  ".join(v.rjust(w) for v, w in zip(line, widths)) for line in table)


def finish(fig: Any, path: str | None) -> Any:
    """Lay `fig` out; save it to `path` and close it, or return it (in a notebook)."""
    fig.tight_layout()
    if path is None:
        return fig
    import matplotlib.pyplot as plt

    fig.savefig(path, dpi=120)
    plt.close(fig)
    return None


def speed_and_state(rows: list[dict], speed: str, speed_label: str, state_label: str,
                    title: str, path: str | None) -> Any:
    """Two bar charts per variant side by side: `speed` (one number per row), and the measured
    state per rank (`state_mib`) with the formula's (`formula_mib`) as dots."""
    import matplotlib.pyplot as plt

    names = [r["variant"] for r in rows]
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 0.45 * len(rows) + 1.8), sharey=True)
    a.barh(names, [r[speed] for r in rows], color="tab:blue")
    a.set_xlabel(speed_label)
    b.barh(names, [r["state_mib"] for r in rows], color="tab:orange", label=_("measured"))
    b.scatter([r["formula_mib"] for r in rows], names, color="k", zorder=3,
              label=_("formula"))
    b.set_xlabel(state_label)
    b.legend(loc="lower right")
    a.invert_yaxis()
    fig.suptitle(title)
    return finish(fig, path)


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


def size_text(n: int) -> str:
    return f"{n // MiB} MiB" if n >= MiB else f"{n // KiB} KiB" if n >= KiB else f"{n} B"
