"""Replay the greedy outputs of a ``graft bench`` run through the prompt-lookup proposer, with no model: what τ
and what decoding speedup over ``ar`` it would get under a latency curve (one-token forward = 1).

Greedy decoding is deterministic, so ``ar``'s tokens are what every lossless method outputs: at each step the
proposer's tree is walked along them (the accepted path, then the next token as the bonus), the proposer
observes the step, and the step costs ``latency(tree nodes + 1)``. It answers "what would a different latency
curve, budget or lookup setting do" in seconds instead of a bench run (the prefill is left out).

    python benchmarks/replay_lookup.py docs/bench/pld/runs.jsonl --categories summarization,rag
    python benchmarks/replay_lookup.py docs/bench/pld/runs.jsonl --curve 1:1,2:1.21,4:1.39,8:1.67,16:2.13
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from graft_cli.bench import load_questions, resolve_dataset  # noqa: E402
from graft_cli.budget import LatencyModel  # noqa: E402
from graft_cli.graft import GraftProposer  # noqa: E402
from graft_cli.loading import encode  # noqa: E402
from graft_cli.stats import Stats  # noqa: E402
from graft_cli.tree import ROOT as TREE_ROOT  # noqa: E402
from graft_cli.tree import Tree  # noqa: E402
from plugins.base import Step  # noqa: E402
from plugins.prompt_lookup import PromptLookup  # noqa: E402


def replay(proposer: GraftProposer, prompt: list[int], output: list[int], latency: LatencyModel) -> tuple[float, int]:
    """Cost (in one-token forwards) and steps of decoding ``output`` after ``prompt`` with ``proposer``."""
    context = [*prompt, output[0]]  # the prefill gives the first token
    proposer.start(prompt, Step(context, [output[0]], Tree(), list(range(len(prompt)))))
    done, cost, steps = 1, 0.0, 0
    while done < len(output):
        tree = proposer.propose(context, Stats())
        node, path = TREE_ROOT, []
        while done + len(path) < len(output):
            child = tree.child(node, output[done + len(path)])
            if child is None:
                break
            path.append(child)
            node = child
        new = output[done : done + len(path) + 1]
        cost += latency(len(tree) + 1)
        steps += 1
        done += len(new)
        context = context + new
        proposer.observe(Step(context, new, tree, [0] + [i + 1 for i in path]))
    return cost, steps


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("runs", type=Path, help="runs.jsonl of a graft bench run that includes ar")
    ap.add_argument("--dataset", default="spec-bench")
    ap.add_argument("--model", default="smollm2-135m-instruct", help="whose tokenizer rebuilds the prompts")
    ap.add_argument("--categories", default=None)
    ap.add_argument("--budget", type=int, default=16)
    ap.add_argument("--curve", default=None, help="N:COST,... (default: the CPU default latency curve)")
    args = ap.parse_args()

    from transformers import AutoTokenizer

    from graft_cli.catalog import resolve_model

    tokenizer = AutoTokenizer.from_pretrained(resolve_model(args.model, pull_if_missing=False))
    wanted = args.categories.split(",") if args.categories else None
    questions = {json.dumps(q.question_id): q for q in load_questions(resolve_dataset(args.dataset), wanted)}
    if args.curve:
        latency = LatencyModel({int(n): float(c) for n, c in (p.split(":") for p in args.curve.split(","))})
    else:
        latency = LatencyModel.default("cpu")
    proposer = GraftProposer(args.budget, [PromptLookup()], latency=latency)  # one for the run, as in the bench
    totals: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0, 0.0])
    for line in args.runs.read_text().splitlines():
        record = json.loads(line)
        question = questions.get(json.dumps(record["question_id"]))
        if record["method"] != "ar" or question is None:
            continue
        messages = []
        for text, turn in zip(question.turns, record["turns"]):
            messages.append({"role": "user", "content": text})
            prompt = encode(tokenizer, messages)
            if len(prompt) != turn["prompt_tokens"]:
                raise SystemExit(f"question {record['question_id']}: the prompt does not match the run's")
            cost, steps = replay(proposer, prompt, turn["tokens"], latency)
            t = totals[record["category"]]
            t[0] += len(turn["tokens"]) - 1
            t[1] += cost
            t[2] += steps
            messages.append({"role": "assistant", "content": turn["text"]})
    print("category | decoding speedup over ar | tau")
    for category, (tokens, cost, steps) in totals.items():
        print(f"{category} | {tokens / cost:.3f} | {tokens / steps:.2f}")


if __name__ == "__main__":
    main()
