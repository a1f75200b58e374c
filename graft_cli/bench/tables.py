"""What the terminal shows of a benchmark: the table of categories x methods (three views of the same figures)
and the lossless line under it."""

from __future__ import annotations

from statistics import median
from typing import Sequence

from rich.table import Table


def table(summary: dict, methods: Sequence[str], title: str, decoding: bool = False, passes: bool = False) -> Table:
    """Rich table: categories x methods, each cell the speedup over ar and tau (ar's cell: its tokens/s).
    ``decoding``: the speeds after the first tokens (the prefill excluded), so the decoding speed-up shows alone;
    ``passes`` (``--repeats``): each pass's speedup on its own, their median and range."""
    speed, ratio = ("decode_tokens_per_s", "decode_speedup") if decoding else ("tokens_per_s", "speedup")
    what = "decoding alone, after the first tokens: " if decoding else ""
    caption = (f"cell: {what}speedup over ar (Spec-Bench: mean tok/s ratio) and τ (tokens per target forward); ar: "
               "its mean tok/s")
    if passes:
        caption = ("cell: the speedup over ar of each pass on its own (its methods ran side by side), the median "
                   "of the passes \\[lowest-highest]; ar: its median tok/s")  # rich markup: \\[ prints a bracket
    t = Table(title=title, caption=caption, caption_justify="left")
    t.add_column("category")
    for name in methods:
        t.add_column(name, justify="right")
    for group, row in summary.items():
        cells = []
        for name in methods:
            m = row[name]
            if passes:
                cells.append(_pass_cell(m, name == "ar"))
            elif name == "ar":
                cells.append(f"{m[speed]:.2f} tok/s" if m[speed] is not None else "-")
            else:
                sp = f"{m[ratio]:.2f}x" if m[ratio] is not None else "-"
                cells.append(f"{sp} τ{m['tau']:.2f}")
        t.add_row(group, *cells, end_section=group == list(summary)[-2] if len(summary) > 1 else False,
                  style="bold" if group == "overall" else None)
    return t


def _pass_cell(figures: dict, is_base: bool) -> str:
    """A --repeats cell: the median of the passes and their range (ar's: its median speed)."""
    if is_base:
        speeds = figures.get("pass_tokens_per_s")
        return f"{median(speeds):.2f} tok/s" if speeds else "-"
    ratios = figures.get("pass_speedups")
    if not ratios:
        return "-"
    return f"{figures['pass_speedup_median']:.2f}x \\[{min(ratios):.2f}-{max(ratios):.2f}]"


def lossless_line(lossless: dict) -> str:
    """Under the table: how many runs differed from ar, as floating-point ties (each with its margin) and as
    mismatches."""
    ties = ", ".join(f"{d['method']} q{d['question_id']} turn {d['turn']} token {d['position']} margin "
                     f"{d['ar_margin']:.4g}" for d in lossless["ties"])
    return (f"lossless: {len(lossless['mismatches'])} mismatches, {len(lossless['ties'])} floating-point ties (ar's "
            f"top-2 logit margin <= {lossless['tie_tolerance']:g} in {lossless['dtype']})" + (f": {ties}" if ties else ""))
