"""The picture of a (dp, tp, pp) layout: which rank holds which layers, shards and optimizer
state, and what crosses between ranks in one training step (lesson 11a draws it; 11b measures
the traffic it predicts).

`describe_rank(cfg)` runs on every rank: it builds the rank's part of the run
(`course_lib.run.RunBase`, the layout object and the stage cut from it) and says what it holds.
`traffic(description)` is the model of one step's communication per group, from the layout and
the model's shape; `draw(descriptions)` draws the ranks from what they said, and the groups'
traffic between them. `measure_step(cfg, run_class)` runs one step with a `dist` that counts
each collective and each tensor sent by the group it used, next to the model's figures.
"""

from __future__ import annotations

from typing import Any

import torch

from course_lib.backend import default_dist
from course_lib.counting import CountingDist
from course_lib.i18n import _
from course_lib.run import RunBase

KINDS = ("tp", "pp", "dp", "tied", "world")
COLOURS = {"tp": "tab:red", "pp": "tab:green", "dp": "tab:blue", "tied": "tab:purple",
           "world": "tab:gray"}


def describe_rank(cfg: Any) -> dict[str, Any]:
    """On every rank of a cluster: what this rank holds for run `cfg` (`RunBase.describe`)."""
    return RunBase(cfg).describe()


class GroupCounter(CountingDist):
    """A `dist` that also counts, while `on`, each collective and each floating-point tensor
    sent, with its payload bytes, by the group it ran on: `labels` maps a group object's id to
    its name ("world" for the default group)."""

    def __init__(self, dist: Any):
        super().__init__(dist)
        self.labels: dict[int, str] = {}
        self.by_group: dict[str, dict[str, int]] = {}
        self.on = False

    def _call(self, name: str, payload: int, args: Any, kwargs: dict) -> Any:
        sent = name in ("send", "isend") and args[0].is_floating_point()
        if self.on and (sent or name in ("all_reduce", "reduce_scatter", "all_gather",
                                         "broadcast", "reduce")):
            group = kwargs.get("group")
            label = "world" if group is None else self.labels.get(id(group), "other")
            entry = self.by_group.setdefault(label, {"collectives": 0, "bytes": 0})
            entry["collectives"] += 1
            entry["bytes"] += payload
        return super()._call(name, payload, args, kwargs)


def measure_step(cfg: Any, run_class: type) -> dict[str, Any]:
    """On every rank: one step of `run_class(cfg)` (a `RunBase` with a `step`), its traffic
    counted by group, and the model's (`traffic`) for the same rank."""
    counter = GroupCounter(default_dist())
    run = run_class(cfg, dist=counter)
    for axis, group in run.layout.groups.items():  # "dp_cp" is the dp group itself when cp = 1
        counter.labels.setdefault(id(group), axis)
    if run.tied_group is not None:
        counter.labels[id(run.tied_group)] = "tied"
    x, y = next(run.data)
    counter.on = True
    run.step(x, y)
    counter.on = False
    return {"rank": run.layout.rank, "measured": dict(sorted(
        counter.by_group.items(), key=lambda kv: KINDS.index(kv[0]) if kv[0] in KINDS else 9)),
            "model": traffic(run.describe())}


def traffic(d: dict[str, Any]) -> dict[str, dict[str, float]]:
    """One step's communication of the rank described by `d`, per group kind: the number of
    collectives (or messages sent) and their payload bytes (fp32), by the lessons' models.

    tp: per block of the stage and per micro-batch, 2 all-reduces forward (attention's and the
    MLP's `g`) and 2 backward (their `f`), each of a micro-batch's activations (b x T x C);
    pp: per micro-batch, an activation sent forward (all but the last stage) and its gradient
    sent back (all but the first); dp: the stage's gradients once (DDP's all-reduce; ZeRO-1 a
    reduce-scatter and an all-gather; ZeRO-3 two all-gathers and a reduce-scatter per unit);
    tied (pp > 1): the embedding's gradient, V x C; world: the step's loss, one float."""
    c, coords = d["config"], d["coords"]
    k = c["micro_batches"]
    activation = c["batch_size"] // (c["dp"] * k) * c["block_size"] * c["n_embd"] * 4
    blocks = c["n_layer"] // c["pp"]
    params = (d["sharded"] + d["whole"]) * 4
    out: dict[str, dict[str, float]] = {}
    if c["tp"] > 1:
        out["tp"] = {"collectives": 4 * blocks * k, "bytes": 4 * blocks * k * activation}
    if c["pp"] > 1:
        sends = (coords["pp"] < c["pp"] - 1) + (coords["pp"] > 0)
        out["pp"] = {"collectives": sends * k, "bytes": sends * k * activation}
    if c["dp"] > 1:
        times = {0: 1, 1: 2, 3: 3}[c["zero"]]
        out["dp"] = {"collectives": times, "bytes": times * params}
    if d["tied"]:
        out["tied"] = {"collectives": 1, "bytes": d["vocab_size"] * c["n_embd"] * 4}
    out["world"] = {"collectives": 1, "bytes": 4}
    return out


def _kib(n: float) -> str:
    return f"{n / 1024:,.0f} KiB" if n >= 1024 else f"{n:,.0f} B"


def _layers(names: list[str]) -> str:
    """'embedding, blocks 0-1, head (tied)' from the layers' names."""
    blocks = [int(n.split()[1]) for n in names if n.startswith("block")]
    out = [n for n in names if not n.startswith("block")]
    if blocks:
        run = (_("block {n}", n=blocks[0]) if len(blocks) == 1 else
               _("blocks {first}-{last}", first=blocks[0], last=blocks[-1]))
        out.insert(1 if names[0] == "embedding" else 0, run)
    return ", ".join(out)


W, H, GX, GY, LINE = 3.4, 1.0, 1.5, 0.3, 0.32  # box width and height, gaps, a legend line


def size(descriptions: list[dict[str, Any]]) -> tuple[float, float]:
    """(width, height) that `draw` takes for one layout, in its units."""
    c = descriptions[0]["config"]
    return (c["pp"] * (W + GX) - GX + 0.6 + 0.2 * c["tp"],
            c["dp"] * c["tp"] * (H + GY) + 0.4 + LINE * 5)


def picture(layouts: list[list[dict[str, Any]]]) -> Any:
    """One figure of several layouts side by side, on one scale (each from its ranks'
    `describe_rank`): one step's traffic of each group, on its busiest rank."""
    import matplotlib.pyplot as plt

    sizes = [size(d) for d in layouts]
    width, height = sum(s[0] for s in sizes) + 0.8 * (len(sizes) - 1), max(s[1] for s in sizes)
    fig, ax = plt.subplots(figsize=(0.95 * width, 0.95 * (height + 0.6)))
    x = 0.0
    for d, (w, _height) in zip(layouts, sizes):
        draw(d, ax, x0=x, top=height)
        x += w + 0.8
    ax.set_xlim(-0.3, width)
    ax.set_ylim(0, height + 0.6)
    ax.set_aspect("equal")
    ax.set_axis_off()
    return fig


def draw(descriptions: list[dict[str, Any]], ax: Any, x0: float = 0.0, top: float = 0.0) -> None:
    """The ranks of one layout as boxes (columns: pipeline stages; rows: dp x tp), each with
    its layers, parameters and optimizer state; its tp groups shaded, its dp groups joined on
    the right, pipeline messages as arrows, the tied embedding's copies joined by a dashed
    line, and a legend of one step's traffic (`traffic`), below the boxes; the boxes' top at
    `top`, their left at `x0`."""
    from matplotlib.patches import FancyArrowPatch, FancyBboxPatch

    c = descriptions[0]["config"]
    dp, tp, pp = c["dp"], c["tp"], c["pp"]
    rows = dp * tp
    w, h, gx, gy = W, H, GX, GY
    base = top - rows * (h + gy) + gy  # the lowest box's bottom
    where = {}
    for d in descriptions:
        p, row = d["coords"]["pp"], d["coords"]["dp"] * tp + d["coords"]["tp"]
        where[d["rank"]] = (x0 + p * (w + gx), base + (rows - 1 - row) * (h + gy))
    for d in descriptions:  # tp groups: one shaded band behind their boxes
        group = d["groups"]["tp"]
        if len(group) > 1 and d["rank"] == group[0]:
            x, ys = where[d["rank"]][0], [where[r][1] for r in group]
            ax.add_patch(FancyBboxPatch((x - 0.12, min(ys) - 0.1), w + 0.24,
                                        max(ys) - min(ys) + h + 0.2, boxstyle="round,pad=0.02",
                                        fc=COLOURS["tp"], alpha=0.12, ec=COLOURS["tp"], lw=1.5))
    for d in descriptions:
        x, y = where[d["rank"]]
        ax.add_patch(FancyBboxPatch((x, y), w, h, boxstyle="round,pad=0.02", fc="white",
                                    ec="black", lw=0.8))
        co = d["coords"]
        zero = f", ZeRO-{c['zero']}: 1/{dp}" if c["zero"] else ""
        text = (f"rank {d['rank']}  (pp {co['pp']}, dp {co['dp']}, tp {co['tp']})\n"
                f"{_layers(d['layers'])}\n"
                + _("params: {sharded:,} split, {whole:,} whole", sharded=d["sharded"],
                    whole=d["whole"]) + "\n"
                + _("Adam state {size}{zero}", size=_kib(d["adam state"]), zero=zero))
        ax.text(x + 0.08, y + h / 2, text, va="center", ha="left", fontsize=7, family="monospace")
    for d in descriptions:
        x, y = where[d["rank"]]
        group = d["groups"]["dp"]
        if len(group) > 1 and d["rank"] == group[0]:  # dp groups: joined on the right
            xr = x + w + 0.25 + 0.2 * d["coords"]["tp"]
            ys = [where[r][1] + h / 2 for r in group]
            ax.plot([xr, xr], [min(ys), max(ys)], color=COLOURS["dp"], lw=1.5)
            for yy in ys:
                ax.plot([x + w + 0.02, xr], [yy, yy], color=COLOURS["dp"], lw=0.8)
        group = d["groups"]["pp"]
        i = group.index(d["rank"])
        if i + 1 < len(group):
            nx, ny = where[group[i + 1]]
            for dy, style in ((0.7, "-|>"), (0.45, "<|-")):
                ax.add_patch(FancyArrowPatch((x + w + 0.05, y + h * dy), (nx - 0.05, ny + h * dy),
                                             arrowstyle=style, mutation_scale=9,
                                             color=COLOURS["pp"], lw=1))
        if d["tied"] and i == 0:
            nx, ny = where[group[-1]]
            ax.add_patch(FancyArrowPatch((x + w + 0.05, y + h * 0.18), (nx - 0.05, ny + h * 0.18),
                                         arrowstyle="<|-|>", mutation_scale=8, ls="--",
                                         connectionstyle=f"arc3,rad={0.1 if pp > 2 else 0}",
                                         color=COLOURS["tied"], lw=1))
    load = {d["rank"]: traffic(d) for d in descriptions}
    legend = []
    for kind, what in (("tp", _("tp (shaded): 2 all-reduces forward + 2 backward per block "
                                 "and micro-batch")),
                       ("pp", _("pp (arrows): activations forward, their gradients back")),
                       ("dp", _("dp (right): the gradients, once{zero}", zero=(
                           f" (ZeRO-{c['zero']})" if c["zero"] else ""))),
                       ("tied", _("tied (dashed): the embedding's gradient, summed by its two "
                                  "copies")),
                       ("world", _("world: the step's loss"))):
        per_rank = [load[r][kind] for r in load if kind in load[r]]
        if per_rank:
            most = max(per_rank, key=lambda t: t["bytes"])
            legend.append((kind, _("{what}: {count:g} per step, {size}", what=what,
                                   count=most["collectives"], size=_kib(most["bytes"]))))
    for i, (kind, text) in enumerate(legend):
        ax.text(x0, base - 0.3 - LINE * i, text, color=COLOURS[kind], fontsize=7.5, va="top")
    ax.text(x0, top + 0.2, f"(dp, tp, pp) = ({dp}, {tp}, {pp})", fontsize=10)
