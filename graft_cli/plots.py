"""PNG figures of a ``graft bench`` run (matplotlib, Agg backend: no display needed).

- ``speedup_by_category.png``: grouped bars, one group per category (and overall), one bar per method.
- ``pareto.png``: speedup and τ against the verification budget (nodes per step), one line per engine method run
  at several budgets (``--budgets 4,8,16,32``); ``auto`` budgets sit at the mean budget they chose, marked ★;
  the peers and ``ar`` are horizontal reference lines.
"""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402


def _title(results: dict) -> str:
    c = results["config"]
    model = Path(str(c["model"]["spec"])).name
    return f"{model}, {c['dataset']['spec']}, {c['max_new_tokens']} new tokens, {c['device']['device']}"


def speedup_by_category(results: dict, path: Path) -> Path:
    summary = results["summary"]
    groups = list(summary)
    methods = [m["name"] for m in results["config"]["methods"] if m["name"] != "ar"]
    fig, ax = plt.subplots(figsize=(max(6.0, 0.35 * len(groups) * max(1, len(methods)) + 2), 4.5))
    width = 0.8 / max(1, len(methods))
    cmap = plt.get_cmap("tab20" if len(methods) > 10 else "tab10")
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
    plt.close(fig)
    return path


def pareto_points(results: dict) -> tuple[dict[str, list[tuple[float, float, float, bool]]], dict[str, dict]]:
    """Engine methods as ``{method: [(budget, speedup, tau, auto), ...]}`` sorted by budget, and the other
    methods' overall figures (the reference lines)."""
    overall = results["summary"]["overall"]
    default = results["config"].get("default_budget")
    lines: dict[str, list] = {}
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
        lines.setdefault(m["method"], []).append((float(budget), fig["speedup"] or 0.0, fig["tau"], auto))
    for pts in lines.values():
        pts.sort()
    return lines, refs


def pareto(results: dict, path: Path) -> Path:
    lines, refs = pareto_points(results)
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4.2))
    cmap = plt.get_cmap("tab10")
    for j, (method, pts) in enumerate(sorted(lines.items())):
        color = cmap(j % 10)
        fixed = [p for p in pts if not p[3]]
        for ax, k in ((ax1, 1), (ax2, 2)):
            if fixed:
                ax.plot([p[0] for p in fixed], [p[k] for p in fixed], marker="o", color=color, label=method)
            for p in pts:
                if p[3]:
                    ax.plot([p[0]], [p[k]], marker="*", markersize=14, color=color, linestyle="none",
                            label=f"{method} auto")
    styles = ["--", ":", "-.", (0, (5, 1))]
    for i, (name, figs) in enumerate(refs.items()):
        ax1.axhline(figs["speedup"] or 0.0, color="gray", linestyle=styles[i % len(styles)], linewidth=1, label=name)
        ax2.axhline(figs["tau"], color="gray", linestyle=styles[i % len(styles)], linewidth=1, label=name)
    budgets = sorted({p[0] for pts in lines.values() for p in pts if p[0] > 0})
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
    plt.close(fig)
    return path


def write_all(out_dir: Path, results: dict) -> list[Path]:
    out_dir = Path(out_dir)
    return [speedup_by_category(results, out_dir / "speedup_by_category.png"), pareto(results, out_dir / "pareto.png")]


def training_curves(state: dict, path: Path) -> Path:
    """A head's training (``graft heads ship --plot``): the loss against tokens seen, and the held-out top-1
    acceptance of each TTT step at every checkpoint."""
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
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
    plt.close(fig)
    return path
