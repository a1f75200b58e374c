"""Every decoding step of a ``graft bench`` run, one JSON line each, and a figure of merit that needs no quiet
machine.

``trace``: runs ``graft bench`` with the given arguments and records, per step of every engine method, the tree
size, the target's verification time, the step's time from ``propose`` to the end of ``observe``, the tokens
accepted (with the bonus), the method's retriever count, and the tree's calibrated prediction by source.

``merit``: accepted tokens over the modelled cost of the steps, per method (by name; in traces recorded before
names were, by retriever count: 0 is ``ar``, 1 ``pld``, 2 ``graft``'s defaults), where a step of ``n`` nodes costs
the median step time of all ``n``-node steps of a reference trace (``--own-host``: the median verification time
of those steps, plus the step's own host time, so that a method's extra host work per step is charged to it
alone). Then per category, each method's merit over the best of the other methods (issue 17's per-category
rule, without the timing noise a single bench pass carries; a method traced twice, say before and after a
change, is compared with the others, not with itself). Without a drafter graft's choices do not depend on
timing, so a change of its rules gives a new trace whose merit differs only by what the rules chose, on one
shared cost curve: differences of a few tenths of a percent are then real, where the bench's timings move by
several percent from run to run.

    GRAFT_BENCH_DATA=/work/shared/data/bench python benchmarks/step_trace.py trace /tmp/base.jsonl -- \\
        --dataset spec-bench --limit 1 --max-new-tokens 128 --methods pld,graft --no-plots --out /tmp/tr
    python benchmarks/step_trace.py merit [--own-host] /tmp/base.jsonl /tmp/base.jsonl /tmp/variant.jsonl
"""

from __future__ import annotations

import json
import sys
from bisect import bisect_right
from collections import Counter, defaultdict
from pathlib import Path
from statistics import median
from time import perf_counter

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def trace(out: str, bench_args: list[str]) -> None:
    from graft_cli import graft, target
    from graft_cli.bench import execution
    from graft_cli.cli import app

    verify, propose, observe = target.Target.verify, graft.GraftProposer.propose, graft.GraftProposer.observe
    run_question = execution.run_question
    now: dict = {}
    turn: dict = {}  # the question being answered (none while warming up)

    def labelled(runner, question, conv, max_new_tokens):
        turn.update(method=runner.name, category=question.category)
        try:
            return run_question(runner, question, conv, max_new_tokens)
        finally:
            turn.clear()
    log = open(out, "w")

    def timed_verify(self, root, tree, hidden=False):
        t0 = perf_counter()
        result = verify(self, root, tree, hidden)
        now["verify"] = (len(tree), perf_counter() - t0)
        return result

    def timed_propose(self, context, stats):
        now["start"] = perf_counter()
        return propose(self, context, stats)

    def timed_observe(self, step):
        observe(self, step)
        if "start" in now and "verify" in now:
            nodes, verify_s = now["verify"]
            predicted: Counter = Counter()
            for node in step.tree.nodes:
                predicted[node.source] += node.score
            log.write(json.dumps({**turn, "nodes": nodes, "verify_s": verify_s, "step_s": perf_counter() - now["start"],
                                  "tokens": len(step.accepted), "retrievers": len(self.retrievers),
                                  "predicted": {k: round(v, 3) for k, v in predicted.items()}}) + "\n")
        now.clear()

    target.Target.verify, graft.GraftProposer.propose = timed_verify, timed_propose
    graft.GraftProposer.observe, execution.run_question = timed_observe, labelled
    try:
        app(["bench", *bench_args], standalone_mode=False)
    finally:
        log.close()


def merit(reference: str, traces: list[str], own_host: bool = False) -> None:
    def read(path: str) -> list[dict]:
        return [json.loads(line) for line in open(path)]

    timed = "verify_s" if own_host else "step_s"
    by_size = defaultdict(list)
    for step in read(reference):
        by_size[step["nodes"]].append(step[timed])
    sizes, costs, floor = sorted(by_size), [], 0.0
    for n in sizes:  # a larger tree never costs less
        floor = max(floor, median(by_size[n]))
        costs.append(floor)

    def cost(step: dict) -> float:
        """The curve at the largest measured size not above the step's (the smallest, below them all)."""
        curve = costs[max(bisect_right(sizes, step["nodes"]) - 1, 0)]
        return curve + step["step_s"] - step["verify_s"] if own_host else curve

    rates: dict[str, dict[str, float]] = defaultdict(dict)  # category -> method -> merit
    for path in traces:
        steps = read(path)
        named = any("method" in s for s in steps)  # then warm-up steps (no method) are left out
        groups: dict[str, list[dict]] = defaultdict(list)
        for s in steps:
            name = s.get("method") if named else f"retrievers={s['retrievers']}"
            if name:
                groups[name].append(s)
        for name, mine in sorted(groups.items()):
            label = name if len(traces) == 1 else f"{Path(path).stem}/{name}"
            tokens = sum(s["tokens"] for s in mine)
            print(f"{path} {name}: {len(mine)} steps, tau {tokens / len(mine):.3f}, nodes "
                  f"{sum(s['nodes'] for s in mine) / len(mine):.2f}, merit {tokens / sum(map(cost, mine)):.2f} tok/s")
            by_category: dict[str, list[dict]] = defaultdict(list)
            for s in mine:
                by_category[s.get("category", "")].append(s)
            for category, rows in by_category.items():
                if category:
                    rates[category][label] = sum(s["tokens"] for s in rows) / sum(map(cost, rows))
    labels = sorted({label for row in rates.values() for label in row})
    if len(labels) > 1:
        print("\nper category, merit in tok/s and over the best of the other methods:")
        print(f"{'category':16}" + "".join(f"{label:>26}" for label in labels))
        for category, row in rates.items():
            cells = []
            for label in labels:
                others = [v for k, v in row.items() if k.split("/")[-1] != label.split("/")[-1]]
                over = f" {row[label] / max(others):.3f}" if label in row and others else ""
                cells.append(f"{row[label]:.2f}{over}" if label in row else "-")
            print(f"{category:16}" + "".join(f"{cell:>26}" for cell in cells))


if __name__ == "__main__":
    args = sys.argv[1:]
    if len(args) >= 2 and args[0] == "trace":
        trace(args[1], args[3:] if args[2:3] == ["--"] else args[2:])
    elif len(args) >= 3 and args[0] == "merit":
        own_host = "--own-host" in args
        args = [a for a in args if a != "--own-host"]
        merit(args[1], args[2:], own_host)
    else:
        sys.exit(__doc__)
