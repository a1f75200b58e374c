"""Project a ``graft bench`` run onto a GPU: its device-independent counts, costed by a GPU's latencies.

What a step buys (τ: tokens per target forward) and what it spends (the nodes verified, the draft forwards run)
do not depend on the device the run was measured on, as long as the trees were chosen as the GPU would choose
them (budget 60, depth 7, draft top-k 8, and ``curve=cuda`` for every method that sizes its tree by latency).
This prices each turn's steps by a GPU's costs instead of this CPU's:

    step = curve(nodes + 1) + draft forwards x share + host

in one-token target forwards: ``curve`` is the verification latency by tokens fed (graft's CUDA default, flat
while the GPU is memory-bound, or ``--curve N:COST,...``), ``share`` a draft forward's cost against a one-token
target forward (``--draft-share``) and ``host`` the host's time per step (``--host-ms``, over ``--target-ms``).
Plain decoding costs 1 a token; only the decoding is priced (the prefill gives the first token). A question's
projected speedup is its tokens over its steps' cost; the run's is the mean over questions, as ``graft bench``
averages Spec-Bench.

It is a projection: the curve and the share are assumptions until ``benchmarks/gpu_check.py`` has measured them
on a GPU. (``benchmarks/replay.py`` cannot price an EAGLE-3 head's run: the head reads the target's hidden
states, which a replay without the target does not have; the bench's own counts are used instead.)

    python benchmarks/gpu_projection.py bench-results/runs.jsonl --draft-share 0.1
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from graft_cli.budget import LatencyModel  # noqa: E402


def project(records: list[dict], latency: LatencyModel, share: float, host: float = 0.0) -> dict[str, dict]:
    """Per method: τ, nodes and draft forwards per step over the run, and the mean projected speedup over
    plain decoding (one forward a token; its host time, a fraction of a speculative step's, is left out)."""
    sums: dict[str, dict] = defaultdict(lambda: defaultdict(float))
    for record in records:
        tokens = cost = 0.0
        out = sums[record["method"]]
        for turn in record["turns"]:
            steps = turn["steps"]
            if not steps:
                continue
            nodes = sum(turn["proposed"].values()) / steps
            forwards = turn.get("draft_forwards", 0) / steps
            decoded = turn["new_tokens"] - turn.get("first_tokens", 1)  # the prefill gives the first token
            tokens += decoded
            cost += steps * (latency(nodes + 1) + forwards * share + (host if record["method"] != "ar" else 0.0))
            for key, value in (("tokens", decoded), ("steps", steps), ("nodes", nodes * steps),
                               ("forwards", forwards * steps)):
                out[key] += value
        if cost:
            out["speedup"] += tokens * latency(1) / cost  # plain decoding: latency(1) a token
            out["questions"] += 1
    return {method: {"tau": s["tokens"] / s["steps"], "nodes_per_step": s["nodes"] / s["steps"],
                     "draft_forwards_per_step": s["forwards"] / s["steps"],
                     "speedup": s["speedup"] / s["questions"]}
            for method, s in sums.items() if s["steps"] and s["questions"]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("runs", type=Path, nargs="+", help="runs*.jsonl of graft bench runs")
    ap.add_argument("--curve", default=None, help="N:COST,...: verification cost by tokens fed, in one-token "
                    "forwards (default: graft's CUDA default curve)")
    ap.add_argument("--draft-share", type=float, default=0.1,
                    help="a draft forward against a one-token target forward (an assumption: 0.1 for an EAGLE-3 "
                         "head of a 32-layer target)")
    ap.add_argument("--host-ms", type=float, default=0.0, help="host time per speculative step (host_overhead.py)")
    ap.add_argument("--target-ms", type=float, default=9.0, help="a one-token target forward on the GPU")
    args = ap.parse_args()
    if args.curve:
        latency = LatencyModel({int(n): float(c) for n, c in (p.split(":") for p in args.curve.split(","))})
    else:
        latency = LatencyModel.default("cuda")
    records = [json.loads(line) for path in args.runs for line in path.read_text().splitlines() if line.strip()]
    table = project(records, latency, args.draft_share, args.host_ms / args.target_ms)
    print(f"projected on a GPU: curve {dict(sorted(latency.points.items()))}, draft forward {args.draft_share} of "
          f"a target forward, host {args.host_ms} ms a step over a {args.target_ms} ms forward")
    print(f"{'method':<14}{'tau':>7}{'nodes/step':>12}{'draft fw/step':>15}{'projected speedup':>19}")
    for method, row in table.items():
        print(f"{method:<14}{row['tau']:>7.2f}{row['nodes_per_step']:>12.1f}{row['draft_forwards_per_step']:>15.2f}"
              f"{row['speedup']:>18.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
