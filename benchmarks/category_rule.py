"""Issue 17's per-category rule over several ``graft bench`` passes, and the noise floor it is judged against.

The rule: a method (``graft``) at least ``--floor`` (0.97) times the best of the others (``pld``, ``hf-pld``)
in every category. One pass of ``--limit 2`` times each category on two questions, so its ratios move by several
percent from run to run on a shared machine even when nothing else changes. Two kinds of evidence come out:

- every pass's ratio per category, and per category their median, mean, spread and the passes under the floor;
- the **noise floor**: a run that lists a method twice under two names (``--variant pld-b=pld``) times identical
  work twice, so the twin's ratio to its original per category is pure timing noise, the resolution any single
  pass has.

A twin (``NAME-b`` by default, ``--twin``) makes a pass of its own: ``graft-b`` against ``pld-b`` and the others'
originals. Passes are kept only when the method's overall τ is ``--tau`` (when given), so runs of other settings
are left out.

    python benchmarks/category_rule.py docs/bench/i17-smollm2-*/results.json --against pld,hf-pld --tau 2.152
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path


def speedups(summary: dict, method: str, against: list[str], suffix: str) -> dict[str, float] | None:
    """Per category: ``method`` over the best of ``against`` (their ``suffix`` twins where the run has them);
    None when the run lacks any of them."""
    overall = summary.get("overall", {})
    others = [o + suffix if o + suffix in overall else o for o in against]
    if method not in overall or any(o not in overall for o in others):
        return None
    return {cat: row[method]["speedup"] / max(row[o]["speedup"] for o in others) for cat, row in summary.items()}


def passes(paths: list[Path], method: str, against: list[str], twin: str,
           tau: float | None) -> list[tuple[str, dict[str, float]]]:
    """One pass per results file, and one more per twin of ``method`` in it."""
    found = []
    for path in paths:
        summary = json.loads(path.read_text())["summary"]
        for suffix in ("", twin):
            name = method + suffix
            if name not in summary.get("overall", {}):
                continue
            if tau is not None and abs(summary["overall"][name]["tau"] - tau) > 0.005:
                continue
            ratios = speedups(summary, name, against, suffix)
            if ratios is not None:
                found.append((f"{path.parent.name}:{name}", ratios))
    return found


def noise(paths: list[Path], twin: str) -> list[tuple[str, dict[str, float]]]:
    """Every twin over its original, per category: the same work timed twice in one run."""
    found = []
    for path in paths:
        summary = json.loads(path.read_text())["summary"]
        overall = summary.get("overall", {})
        for name in overall:
            if name.endswith(twin) and name[: -len(twin)] in overall:
                original = name[: -len(twin)]
                found.append((f"{path.parent.name}:{name}/{original}",
                              {cat: row[name]["speedup"] / row[original]["speedup"] for cat, row in summary.items()}))
    return found


def table(rows: list[tuple[str, dict[str, float]]], floor: float | None) -> str:
    """Per category: median, mean, standard deviation, extremes and (with ``floor``) the passes under it."""
    lines = []
    for cat in rows[0][1]:
        values = [ratios[cat] for _, ratios in rows if cat in ratios]
        spread = statistics.stdev(values) if len(values) > 1 else 0.0
        line = (f"{cat:15s} median {statistics.median(values):.3f}  mean {statistics.mean(values):.3f}  "
                f"sd {spread:.3f}  min {min(values):.3f}  max {max(values):.3f}")
        if floor is not None:
            line += f"  under {floor}: {sum(v < floor for v in values)}/{len(values)}"
        lines.append(line)
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("results", nargs="+", type=Path, help="results.json files of graft bench runs")
    parser.add_argument("--method", default="graft")
    parser.add_argument("--against", default="pld,hf-pld", help="comma-separated: the methods to beat")
    parser.add_argument("--floor", type=float, default=0.97)
    parser.add_argument("--twin", default="-b", help="the suffix of a method run twice under two names")
    parser.add_argument("--tau", type=float, help="keep only passes where the method's overall τ is this")
    args = parser.parse_args()
    try:
        found = passes(args.results, args.method, args.against.split(","), args.twin, args.tau)
        floor = noise(args.results, args.twin)
    except (OSError, ValueError, KeyError, TypeError) as e:
        print(f"category_rule: {e}", file=sys.stderr)
        return 1
    if not found:
        print(f"category_rule: no pass has {args.method} beside {args.against}", file=sys.stderr)
        return 1
    for name, ratios in found:
        print(f"{name}: " + " ".join(f"{cat[:6]} {r:.3f}" for cat, r in ratios.items()))
    print(f"\n{args.method} over the best of {args.against}, {len(found)} passes:\n{table(found, args.floor)}")
    if floor:
        print(f"\nnoise floor, a method over its twin in the same run ({len(floor)} pairs):\n{table(floor, None)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
