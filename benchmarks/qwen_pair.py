"""Qwen2.5-Coder-1.5B (target) with Qwen2.5-Coder-0.5B (draft): plain decoding, transformers' assisted
generation, and the dense / pruned / graft trees, side by side in one process, interleaved prompt by prompt.

Prompts: Spec-Bench ``coding`` and ``math_reasoning`` (first turn) and GPTeacher codegen instructions, N of each.
Greedy; every engine method must reproduce ``ar``'s tokens exactly (the lossless check), and assisted generation
is compared with them too.

    .venv/bin/python benchmarks/qwen_pair.py --per-category 2 --max-new-tokens 64 --budgets 16,8

Writes one JSON line per (prompt, method) to ``--jsonl`` and prints a markdown table.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import Counter, defaultdict
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from graft_cli import methods  # noqa: E402
from graft_cli.bench import shared_models  # noqa: E402
from graft_cli.engine import decode  # noqa: E402
from graft_cli.loading import encode, load_model, stop_ids  # noqa: E402
from graft_cli.methods import MethodConfig  # noqa: E402
from graft_cli.sampling import Sampling  # noqa: E402
from graft_cli.stats import Stats  # noqa: E402
from graft_cli.target import Target  # noqa: E402

DATA = ROOT.parent / "shared" / "data"
TARGET, DRAFT = "qwen2.5-coder-1.5b-instruct", "qwen2.5-coder-0.5b-instruct"


def prompts(per_category: int) -> list[tuple[str, str]]:
    out = []
    spec = [json.loads(line) for line in (DATA / "bench" / "spec_bench_question.jsonl").read_text().splitlines() if line]
    for category in ("coding", "math_reasoning"):
        rows = [q for q in spec if q["category"] == category][:per_category]
        out += [(category, q["turns"][0]) for q in rows]
    code = (DATA / "corpus" / "gpteacher_codegen-instruct.jsonl").read_text().splitlines()
    for line in code[:per_category]:
        q = json.loads(line)
        text = q["instruction"] + (f"\n\n{q['input']}" if q.get("input") else "")
        out.append(("gpteacher_codegen", text))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--per-category", type=int, default=2)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--budgets", default="16,8")
    ap.add_argument("--methods", default="ar,assisted,dense,pruned,graft",
                    help="ar, assisted, dense, pruned, graft, graft-chain (Graft(TAIL) over a chain drafter); NAME@B runs "
                         "NAME at budget B only")
    ap.add_argument("--depth", type=int, default=None)
    ap.add_argument("--draft-top-k", type=int, default=None)
    ap.add_argument("--prune-at", default=None)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--jsonl", default=None, help="per-run records (default: none)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    names = args.methods.split(",")
    budgets = [int(b) for b in args.budgets.split(",")]
    target = load_model(TARGET, "cpu", "float32")
    draft = load_model(DRAFT, "cpu", "float32")
    stop = stop_ids(target)
    runners: list[tuple[str, object]] = []
    with shared_models(target, draft):  # drafter methods reuse the loaded draft model
        for name in names:
            if name in ("ar", "assisted"):
                runners.append((name, None))
                continue
            name, _, pinned = name.partition("@")  # name@B: this method at budget B only
            for budget in ([int(pinned)] if pinned else budgets):
                method, chain = ("graft", True) if name == "graft-chain" else (name, False)
                config = MethodConfig(method, budget, draft=DRAFT, depth=args.depth, draft_top_k=args.draft_top_k,
                                      prune_at=args.prune_at if method != "dense" else None, chain=chain)
                runners.append((f"{name}@{budget}", methods.build(config, target)))

    def run(name, proposer, ids, n):
        t0 = time.perf_counter()
        if name == "assisted":
            out = target.model.generate(torch.tensor([ids]), assistant_model=draft.model, do_sample=False,
                                        max_new_tokens=n, eos_token_id=sorted(stop), pad_token_id=sorted(stop)[0])
            tokens = out[0, len(ids):].tolist()
            return tokens, time.perf_counter() - t0, None
        stats = Stats()
        gen = torch.Generator().manual_seed(0)
        tokens = [t for s in decode(Target(target.model), proposer or methods.GraftProposer(0), ids, Sampling(), n,
                                    stop, gen, stats) for t in s]
        return tokens, time.perf_counter() - t0, stats

    work = prompts(args.per_category)
    warm = encode(target.tokenizer, "Say hi.")
    for name, proposer in runners:  # first-call overheads out of the measurement
        run(name, proposer, warm, 4)

    sink = open(args.jsonl, "w") if args.jsonl else None
    totals = defaultdict(lambda: {"tokens": 0, "time": 0.0, "steps": 0, "gained": 0, "draft_forwards": 0,
                                  "accepted": Counter(), "proposed": Counter(), "lossless": 0, "runs": 0,
                                  "draft_kept": 0, "retrieved": 0, "times": Counter()})
    started = time.time()
    for p, (category, text) in enumerate(work):
        ids = encode(target.tokenizer, text)
        reference = None
        order = runners[p % len(runners):] + runners[: p % len(runners)]  # rotate: no method always runs first
        results = {}
        for name, proposer in order:
            tokens, wall, stats = run(name, proposer, ids, args.max_new_tokens)
            results[name] = (tokens, wall, stats, getattr(proposer, "trace", None))
        reference = results["ar"][0] if "ar" in results else None
        for name, _ in runners:
            tokens, wall, stats, trace = results[name]
            t = totals[name]
            t["tokens"] += len(tokens)
            t["time"] += wall
            t["runs"] += 1
            t["lossless"] += int(reference is None or tokens == reference)
            if stats is not None:
                t["steps"] += stats.steps
                t["gained"] += sum(stats.accept_lengths)
                t["draft_forwards"] += stats.draft_forwards
                t["accepted"].update(stats.accepted)
                t["proposed"].update(stats.proposed)
                t["times"].update(stats.times)
            if trace:
                t["draft_kept"] += sum(r["draft"] for r in trace)
                t["retrieved"] += sum(r["retrieved"] for r in trace)
            record = {"prompt": p, "category": category, "method": name, "tokens": len(tokens), "wall_s": round(wall, 3),
                      "tok_s": round(len(tokens) / wall, 3), "lossless": reference is None or tokens == reference}
            if stats is not None:
                record.update(tau=round(stats.tau, 3), draft_forwards=stats.draft_forwards, steps=stats.steps,
                              accepted=dict(stats.accepted))
            if sink:
                sink.write(json.dumps(record) + "\n")
                sink.flush()
            print(json.dumps(record), file=sys.stderr, flush=True)
    elapsed = time.time() - started

    ar_rate = totals["ar"]["tokens"] / totals["ar"]["time"] if "ar" in totals else None
    print(f"\n{len(work)} prompts x {args.max_new_tokens} new tokens, {elapsed / 60:.1f} min, "
          f"torch threads {torch.get_num_threads()}\n")
    print("| method | tok/s | speedup vs ar | tau | draft fwd/step | draft kept/step | retrieved/step "
          "| accepted by source (per step) | draft / retrieve / verify s | lossless |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for name, _ in runners:
        t = totals[name]
        rate = t["tokens"] / t["time"]
        steps = t["steps"]
        if steps:
            tau = f"{t['gained'] / steps:.2f}"
            fwd = f"{t['draft_forwards'] / steps:.2f}"
            kept = f"{t['draft_kept'] / steps:.1f}"
            retrieved = f"{t['retrieved'] / steps:.1f}"
            acc = ", ".join(f"{k} {v / steps:.2f}" for k, v in sorted(t["accepted"].items()) if k != "bonus") or "-"
            times = " / ".join(f"{t['times'][k]:.0f}" for k in ("draft", "retrieve", "verify"))
        else:
            tau = fwd = kept = retrieved = acc = times = "-"
        speed = f"{rate / ar_rate:.2f}x" if ar_rate else "-"
        print(f"| {name} | {rate:.2f} | {speed} | {tau} | {fwd} | {kept} | {retrieved} | {acc} | {times} "
              f"| {t['lossless']}/{t['runs']} |")


if __name__ == "__main__":
    main()
