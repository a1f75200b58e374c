"""Every decoding step of a ``graft bench`` run, one JSON line each, and a figure of merit that needs no quiet
machine.

``trace``: runs ``graft bench`` with the given arguments and records, per step of every engine method, the tree
size, the target's verification time, the step's time from ``propose`` to the end of ``observe``, the tokens
accepted (with the bonus), the method's retriever count, and the tree's calibrated prediction by source.

``merit``: accepted tokens over the modelled cost of the steps, per method (by retriever count: 0 is ``ar``, 1
``pld``, 2 ``graft``'s defaults), where a step of ``n`` nodes costs the median step time of all ``n``-node steps
of a reference trace. Without a drafter graft's choices do not depend on timing, so a change of its rules gives
a new trace whose merit differs only by what the rules chose, on one shared cost curve: differences of a few
tenths of a percent are then real, where the bench's timings move by several percent from run to run.

    GRAFT_BENCH_DATA=/work/shared/data/bench python benchmarks/step_trace.py trace /tmp/base.jsonl -- \\
        --dataset spec-bench --limit 1 --max-new-tokens 128 --methods pld,graft --no-plots --out /tmp/tr
    python benchmarks/step_trace.py merit /tmp/base.jsonl /tmp/base.jsonl /tmp/variant.jsonl
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
    from graft_cli.cli import app

    verify, propose, observe = target.Target.verify, graft.GraftProposer.propose, graft.GraftProposer.observe
    now: dict = {}
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
            log.write(json.dumps({"nodes": nodes, "verify_s": verify_s, "step_s": perf_counter() - now["start"],
                                  "tokens": len(step.accepted), "retrievers": len(self.retrievers),
                                  "predicted": {k: round(v, 3) for k, v in predicted.items()}}) + "\n")
        now.clear()

    target.Target.verify, graft.GraftProposer.propose = timed_verify, timed_propose
    graft.GraftProposer.observe = timed_observe
    try:
        app(["bench", *bench_args], standalone_mode=False)
    finally:
        log.close()


def merit(reference: str, traces: list[str]) -> None:
    def read(path: str) -> list[dict]:
        return [json.loads(line) for line in open(path)]

    by_size = defaultdict(list)
    for step in read(reference):
        by_size[step["nodes"]].append(step["step_s"])
    sizes, costs, floor = sorted(by_size), [], 0.0
    for n in sizes:  # a larger tree never costs less
        floor = max(floor, median(by_size[n]))
        costs.append(floor)

    def cost(n: int) -> float:
        """The cost of the largest measured size not above ``n`` (the smallest, below them all)."""
        return costs[max(bisect_right(sizes, n) - 1, 0)]

    for path in traces:
        steps = read(path)
        for kind in sorted({s["retrievers"] for s in steps}):
            mine = [s for s in steps if s["retrievers"] == kind]
            tokens = sum(s["tokens"] for s in mine)
            print(f"{path} retrievers={kind}: {len(mine)} steps, tau {tokens / len(mine):.3f}, nodes "
                  f"{sum(s['nodes'] for s in mine) / len(mine):.2f}, merit {tokens / sum(cost(s['nodes']) for s in mine):.2f} tok/s")


if __name__ == "__main__":
    args = sys.argv[1:]
    if len(args) >= 2 and args[0] == "trace":
        trace(args[1], args[3:] if args[2:3] == ["--"] else args[2:])
    elif len(args) >= 3 and args[0] == "merit":
        merit(args[1], args[2:])
    else:
        sys.exit(__doc__)
