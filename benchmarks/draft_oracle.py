"""How much could pruning a draft ever save? A teacher-forced pass of the draft model over ``ar``'s greedy outputs
(from a ``graft bench`` run) gives, at every position, what a chain drafter would propose there and how sure it is;
from that the script replays chain drafting under stopping rules, costed in target one-token forwards:

- ``fixed D``: draft D tokens every step (the dense baseline's depth, as a chain);
- ``cumulative D c``: stop once the chain's probability falls below c (dynamic-depth pruning's rule);
- ``per-token D c``: stop at the first token drafted with probability below c (assisted generation's rule);
- ``oracle D``: stop right after the first token the target rejects (a pruner that knows the future: the bound).

A step costs its draft forwards x ``--draft-cost`` plus the verification of the chain from the target's latency
profile. Ratios are to ``fixed 8``. It also prints the draft's calibration (share of its top-1 tokens the target
keeps, by the draft's probability). Greedy and lossless, the outputs are the same for every rule.

    python benchmarks/draft_oracle.py docs/bench/qwen-grid2/runs.0-of-2.jsonl docs/bench/qwen-grid2/runs.1-of-2.jsonl \\
        --dataset docs/bench/qwen-grid2/prompts.jsonl --model qwen2.5-coder-1.5b-instruct \\
        --draft qwen2.5-coder-0.5b-instruct
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.replay import ar_turns  # noqa: E402
from graft_cli.bench.datasets import load_questions, resolve_dataset  # noqa: E402
from graft_cli.loading import load_model  # noqa: E402
from graft_cli.profile import latency_model  # noqa: E402


def draft_view(draft, prompt: list[int], output: list[int]) -> tuple[list[bool], list[float]]:
    """Per output position: whether the draft's top-1 given the true prefix is the true token, and its probability."""
    with torch.inference_mode():
        logits = draft(torch.tensor([prompt + output])).logits[0].float()
    probs, top = torch.softmax(logits[len(prompt) - 1 : len(prompt) + len(output) - 1], -1).max(-1)
    return [t == o for t, o in zip(top.tolist(), output)], probs.tolist()


def replay(seqs, stop, depth: int, draft_cost: float, verify) -> tuple[float, float, float]:
    """(tokens per one-token forward, tokens per step, draft forwards per step) of chain drafting with rule ``stop``
    (called with the chain's length, cumulative and last probability; True: drop that token and stop)."""
    cost = tokens = steps = forwards = 0.0
    for right, prob in seqs:
        done, n = 1, len(right)
        while done < n:
            length = accepted = fed = 0
            cum, matching = 1.0, True
            while length < depth and done + length < n:
                fed += 1  # the forward that proposes the next token
                p, ok = prob[done + length], matching and right[done + length]
                if stop(length, cum * p, p, ok):
                    break
                cum, matching = cum * p, ok
                accepted += ok
                length += 1
            new = min(accepted + 1, n - done)
            cost += fed * draft_cost + verify(length + 1)
            tokens, steps, forwards, done = tokens + new, steps + 1, forwards + fed, done + new
    return tokens / cost, tokens / steps, forwards / steps


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("runs", type=Path, nargs="+", help="runs*.jsonl of a graft bench run that includes ar")
    ap.add_argument("--dataset", required=True)
    ap.add_argument("--model", required=True, help="the run's target: tokenizer and latency profile")
    ap.add_argument("--draft", required=True)
    ap.add_argument("--draft-cost", type=float, default=None,
                    help="a draft forward in target one-token forwards (default: from both latency profiles)")
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    target = load_model(args.model, "cpu", "float32")
    draft = load_model(args.draft, "cpu", "float32")
    latency = latency_model(target)
    one = latency(1)
    draft_cost = args.draft_cost or latency_model(draft)(2) / one  # a chain's draft forward feeds 1-2 rows
    questions = {json.dumps(q.question_id): q for q in load_questions(resolve_dataset(args.dataset))}
    seqs = [draft_view(draft.model, prompt, turn["tokens"])
            for _, prompt, turn in ar_turns(args.runs, questions, target.tokenizer)]

    def verify(n: int) -> float:
        return latency(n) / one

    rules = {f"fixed {d}": (d, lambda *_: False) for d in (4, 6, 8, 10, 12, 16)}
    for d in (8, 16):
        for c in (0.3, 0.4, 0.5, 0.6, 0.7):
            rules[f"cumulative {d} {c}"] = (d, lambda length, cum, p, ok, c=c: cum < c)
            rules[f"per-token {d} {c}"] = (d, lambda length, cum, p, ok, c=c: p < c)
    for d in (8, 16, 32):
        rules[f"oracle {d}"] = (d, lambda length, cum, p, ok: not ok)
    base = replay(seqs, rules["fixed 8"][1], 8, draft_cost, verify)[0]
    print(f"{len(seqs)} outputs; a draft forward costs {draft_cost:.3f} target forwards")
    print("rule | vs fixed 8 | tokens per step | draft forwards per step")
    for name, (depth, stop) in rules.items():
        rate, tau, fwd = replay(seqs, stop, depth, draft_cost, verify)
        print(f"{name} | {rate / base:.3f} | {tau:.2f} | {fwd:.2f}")
    bins = defaultdict(lambda: [0, 0])
    for right, prob in seqs:
        for ok, p in zip(right[1:], prob[1:]):
            b = bins[min(int(p * 10), 9) / 10]
            b[0], b[1] = b[0] + 1, b[1] + ok
    print("draft probability | positions | target keeps")
    for b, (n, ok) in sorted(bins.items()):
        print(f">= {b:.1f} | {n} | {ok / n:.2f}")


if __name__ == "__main__":
    main()
