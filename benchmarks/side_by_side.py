"""The default-model Spec-Bench command in two checkouts, side by side in one run: category by category, the two
alternating which goes first, so that a shared machine's drift hits both alike.

    python -m benchmarks.side_by_side --before ../old-checkout --after . --out DIR [--limit 2] [--threads 1]
        [--variant 'head=graft draft=eagle3:smollm2-135m-instruct-eagle3']
        [--after-variant 'cached=graft retrievers=prompt,recycling,responses']
        [--model qwen2.5-coder-1.5b-instruct --draft qwen2.5-coder-0.5b-instruct --categories coding,math,...]
        [--methods ar,pld,graft]

Each checkout runs its own `.venv/bin/graft` (``--variant``: a named method both sides run too; ``--draft``: the
draft model of graft's column). Then per side and method: mean tokens/s over questions (Spec-Bench's
definition), the speedup over `ar`, after against before, and whether the two sides' tokens are identical.
Writes DIR/side_by_side.md; a run that stopped resumes where it was (finished categories are kept).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import time
from collections import defaultdict
from pathlib import Path

import numpy as np

CATEGORIES = ("writing roleplay reasoning math coding extraction stem humanities translation summarization qa "
              "math_reasoning rag").split()
METHODS = "ar,hf-pld,pld,graft"


def run(tree: Path, side: str, category: str, args: argparse.Namespace) -> None:
    out = args.out / side / category
    if (out / "results.json").exists():
        return
    variants = [v for v in (args.variant, args.after_variant if side == "after" else None) if v]
    methods = ",".join([args.methods, *(v.split("=")[0] for v in variants)])
    cmd = [str(tree / ".venv/bin/graft"), "bench", "--dataset", "spec-bench", "--categories", category, "--limit",
           str(args.limit), "--max-new-tokens", "128", "--methods", methods, "--threads", str(args.threads),
           "--model", args.model, *(["--draft", args.draft] if args.draft else []), "--no-plots", "--out", str(out),
           *(flag for v in variants for flag in ("--variant", v))]
    t0 = time.time()
    with open(args.out / f"{side}-{category}.log", "w") as log:
        subprocess.run(cmd, cwd=tree, stdout=log, stderr=subprocess.STDOUT, env=os.environ)
    print(f"{side:6} {category:15} {time.time() - t0:6.1f} s", flush=True)


def records(out: Path) -> list[dict]:
    return [json.loads(line) for category in CATEGORIES if (out / category / "runs.jsonl").exists()
            for line in (out / category / "runs.jsonl").read_text().splitlines() if line.strip()]


def speeds(recs: list[dict]) -> dict[tuple[str, str], float]:
    by = defaultdict(list)
    for r in recs:
        speed = sum(t["new_tokens"] for t in r["turns"]) / sum(t["wall_s"] for t in r["turns"])
        by[(r["category"], r["method"])].append(speed)
        by[("overall", r["method"])].append(speed)
    return {key: float(np.mean(v)) for key, v in by.items()}


def report(args: argparse.Namespace) -> str:
    before, after = records(args.out / "before"), records(args.out / "after")
    b, a = speeds(before), speeds(after)
    lines = ["| category | method | before tok/s | after tok/s | before x ar | after x ar | after / before |",
             "|---|---|---|---|---|---|---|"]
    for category in ("overall", *CATEGORIES):
        for method in sorted({m for c, m in a if c == category}, key=lambda m: (m not in METHODS, METHODS.find(m))):
            new, old = a[(category, method)], b.get((category, method))
            ratio = new / a[(category, "ar")]
            if old is None:  # an after-only variant: against graft on the same side
                lines.append(f"| {category} | {method} | - | {new:.2f} | - | {ratio:.3f} | "
                             f"{new / a[(category, 'graft')]:.3f} x graft |")
                continue
            lines.append(f"| {category} | {method} | {old:.2f} | {new:.2f} | {old / b[(category, 'ar')]:.3f} | "
                         f"{ratio:.3f} | {new / old:.3f} |")
    tokens = {(r["question_id"], r["method"]): [t["tokens"] for t in r["turns"]] for r in after}
    same = sum(tokens.get((r["question_id"], r["method"])) == [t["tokens"] for t in r["turns"]] for r in before)
    lines.append(f"\ntokens identical before and after: {same} of {len(before)} (question, method) records")
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--before", type=Path, required=True, help="the old checkout (with its own .venv)")
    ap.add_argument("--after", type=Path, required=True, help="the new checkout (with its own .venv)")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--limit", type=int, default=2)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--variant", default=None, help="'NAME=METHOD FIELD=VALUE ...' run on both sides")
    ap.add_argument("--after-variant", default=None, help="'NAME=METHOD FIELD=VALUE ...' run on the after side too")
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--methods", default=METHODS, help=f"graft bench --methods (default {METHODS})")
    ap.add_argument("--draft", default=None, help="graft's draft model (--draft of graft bench)")
    ap.add_argument("--categories", default=",".join(CATEGORIES), help="comma-separated Spec-Bench categories")
    ap.add_argument("--report", action="store_true", help="only write the table from what has run")
    args = ap.parse_args()
    args.out = args.out.resolve()  # each side runs in its own checkout
    args.out.mkdir(parents=True, exist_ok=True)
    if not args.report:
        for i, category in enumerate(args.categories.split(",")):
            for side in (("before", "after") if i % 2 == 0 else ("after", "before")):
                run(args.before if side == "before" else args.after, side, category, args)
    text = report(args)
    (args.out / "side_by_side.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
