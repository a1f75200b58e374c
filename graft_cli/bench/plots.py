"""PNG figures of a ``graft bench`` run (matplotlib figures drawn on their own Agg canvas: no display needed, and
no pyplot, whose global backend and figure registry would change the process of whoever imports this).

- ``speedup_by_category.png``: grouped bars, one group per category (and overall), one bar per method.
- ``pareto.png``: speedup and τ against the verification budget (nodes per step), one line per engine method run
  at several budgets (``--budgets 4,8,16,32``); ``auto`` budgets sit at the mean budget they chose, marked ★;
  the peers and ``ar`` are horizontal reference lines.
"""

from __future__ import annotations

from pathlib import Path
from typing import NamedTuple

import matplotlib
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.colors import Colormap
from matplotlib.figure import Figure


class ParetoPoint(NamedTuple):
    """An engine method at one budget: its overall speedup and τ; ``auto`` marks a --budget auto run, placed at
    the mean budget it chose."""

    budget: float
    speedup: float
    tau: float
    auto: bool


class Pareto(NamedTuple):
    lines: dict[str, list[ParetoPoint]]  # engine method -> its points, by budget
    refs: dict[str, dict]  # the other columns' overall figures: the reference lines


def _figure(figsize: tuple[float, float]) -> Figure:
    """A figure on its own Agg canvas, which ``savefig`` writes PNGs with."""
    fig = Figure(figsize=figsize)
    FigureCanvasAgg(fig)
    return fig


def _cmap(name: str) -> Colormap:
    return matplotlib.colormaps[name]


def _title(results: dict) -> str:
    """What the run was: model, dataset, answer length, device."""
    c = results["config"]
    model = Path(str(c["model"]["spec"])).name
    return f"{model}, {c['dataset']['spec']}, {c['max_new_tokens']} new tokens, {c['device']['device']}"


def speedup_by_category(results: dict, path: Path) -> Path:
    """Grouped bars: a group per category (and overall), a bar per method, the line at 1.0 being ar."""
    summary = results["summary"]
    groups = list(summary)
    methods = [m["name"] for m in results["config"]["methods"] if m["name"] != "ar"]
    fig = _figure((max(6.0, 0.35 * len(groups) * max(1, len(methods)) + 2), 4.5))
    ax = fig.subplots()
    width = 0.8 / max(1, len(methods))
    cmap = _cmap("tab20" if len(methods) > 10 else "tab10")
    for j, name in enumerate(methods):
        xs = [i + (j - (len(methods) - 1) / 2) * width for i in range(len(groups))]
        ys = [summary[g][name]["speedup"] or 0.0 for g in groups]
        ax.bar(xs, ys, width, label=name, color=cmap(j % cmap.N))
    ax.axhline(1.0, color="black", linewidth=0.8, linestyle="--")
    ax.set_xticks(range(len(groups)))
    ax.set_xticklabels(groups, rotation=30, ha="right")
    ax.set_ylabel("speedup over ar (mean tok/s ratio)")
    ax.set_title(_title(results), fontsize=9)
    ax.legend(fontsize=7, ncol=min(5, max(1, len(methods))), loc="upper left")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return path


def pareto_points(results: dict) -> Pareto:
    """Engine methods as ``{method: [ParetoPoint, ...]}`` sorted by budget, and the other methods' overall
    figures (the reference lines)."""
    overall = results["summary"]["overall"]
    default = results["config"].get("default_budget")
    lines: dict[str, list[ParetoPoint]] = {}
    refs = {}
    for m in results["config"]["methods"]:
        fig = overall.get(m["name"])
        if fig is None:
            continue
        if m["kind"] != "engine" or m["method"] == "ar":
            refs[m["name"]] = fig
            continue
        auto = m["budget"] == "auto"
        budget = fig.get("budget_mean") if auto else (m["budget"] if m["budget"] is not None else default)
        if budget is None:
            budget = fig.get("nodes_per_step", 0.0)
        lines.setdefault(m["method"], []).append(ParetoPoint(float(budget), fig["speedup"] or 0.0, fig["tau"], auto))
    for pts in lines.values():
        pts.sort()
    return Pareto(lines, refs)


def pareto(results: dict, path: Path) -> Path:
    """Speedup (left) and τ (right) against the budget, a line per engine method, the rest as reference lines."""
    lines, refs = pareto_points(results)
    fig = _figure((10, 4.2))
    ax1, ax2 = fig.subplots(1, 2)
    cmap = _cmap("tab10")
    for j, (method, pts) in enumerate(sorted(lines.items())):
        color = cmap(j % 10)
        fixed = [p for p in pts if not p.auto]
        for ax, figure in ((ax1, "speedup"), (ax2, "tau")):
            if fixed:
                ax.plot([p.budget for p in fixed], [getattr(p, figure) for p in fixed], marker="o", color=color,
                        label=method)
            for p in pts:
                if p.auto:
                    ax.plot([p.budget], [getattr(p, figure)], marker="*", markersize=14, color=color,
                            linestyle="none", label=f"{method} auto")
    styles = ["--", ":", "-.", (0, (5, 1))]
    for i, (name, figs) in enumerate(refs.items()):
        ax1.axhline(figs["speedup"] or 0.0, color="gray", linestyle=styles[i % len(styles)], linewidth=1, label=name)
        ax2.axhline(figs["tau"], color="gray", linestyle=styles[i % len(styles)], linewidth=1, label=name)
    budgets = sorted({p.budget for pts in lines.values() for p in pts if p.budget > 0})
    for ax, label in ((ax1, "speedup over ar"), (ax2, "τ (tokens per target forward)")):
        if budgets and budgets[-1] / budgets[0] >= 4:
            ax.set_xscale("log", base=2)
        ax.set_xlabel("verification budget (tree nodes per step)")
        ax.set_ylabel(label)
        ax.grid(True, alpha=0.3)
    ax1.legend(fontsize=7)
    fig.suptitle(_title(results), fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return path


def write_all(out_dir: Path, results: dict) -> list[Path]:
    """Every figure of a run, into ``out_dir``."""
    out_dir = Path(out_dir)
    return [speedup_by_category(results, out_dir / "speedup_by_category.png"), pareto(results, out_dir / "pareto.png")]


def training_curves(state: dict, path: Path) -> Path:
    """A head's training (``graft heads ship --plot``): the loss against tokens seen, and the held-out top-1
    acceptance of each TTT step at every checkpoint."""
    fig = _figure((11, 4))
    left, right = fig.subplots(1, 2)
    history = state["history"]
    left.plot([h[1] for h in history], [h[2] for h in history], color="tab:blue", label="training (weighted sum)")
    evals = state["evals"]
    left.plot([e["tokens"] for e in evals], [e["loss"] for e in evals], "o-", color="tab:orange", label="held out")
    left.set_xlabel("tokens seen")
    left.set_ylabel("loss")
    left.legend()
    steps = len(evals[-1]["acceptance"]) if evals else 0
    for k in range(steps):
        right.plot([e["tokens"] for e in evals], [e["acceptance"][k] for e in evals], "o-", label=f"step {k}")
    right.set_xlabel("tokens seen")
    right.set_ylabel("held-out top-1 acceptance")
    right.legend(fontsize=8, ncol=2)
    s = state["settings"]
    fig.suptitle(f"EAGLE-3 head for {s['model']}: {state['step']:,} steps, {state['tokens']:,} tokens")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return path
