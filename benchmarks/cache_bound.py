"""How much a cache of earlier answers could add at most, on a bench run's own answers.

A response cache (plugins/response_cache.py) can only help where an answer repeats text from an *earlier* answer that
the answer's own prompt and text so far do not already hold (prompt lookup finds those). So, for every answer of a
``graft bench`` run, in the order the run produced them (``answers/<method>.jsonl``; every method's tokens are the
same), each token is checked twice: is it the most frequent continuation of the longest match (``--min-match`` to
``--max-match`` tokens) of the text before it

- in its own prompt (the chat template's, earlier turns included) and the answer so far ("own"), and
- in the earlier answers ("earlier")?

The share predicted by the earlier answers alone ("earlier only") bounds what the cache adds to the accepted
tokens, one guess per position (a tree of guesses does somewhat better, both ways); graft's speedup cannot grow by
more than that share of its tokens per step::

    python -m benchmarks.cache_bound bench-results/run --model smollm2-135m-instruct
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import Counter, defaultdict
from pathlib import Path
from typing import Callable, Iterable, Sequence

Encode = Callable[[list[dict]], list[int]]  # chat messages -> the templated prompt's ids (or an answer's)


class Continuations:
    """For every n-gram (``lo`` to ``hi`` tokens) of the text added, how often each token followed it."""

    def __init__(self, lo: int, hi: int) -> None:
        self.lo, self.hi = lo, hi
        self.next: dict[tuple[int, ...], Counter] = defaultdict(Counter)

    def add(self, tokens: Sequence[int], start: int = 0, stop: int | None = None) -> None:
        """File every position from ``start`` to ``stop`` under the n-grams that end just before it."""
        for t in range(max(start, 1), len(tokens) if stop is None else stop):
            for n in range(self.lo, min(self.hi, t) + 1):
                self.next[tuple(tokens[t - n : t])][tokens[t]] += 1

    def guess(self, tokens: Sequence[int], t: int) -> int | None:
        """The most frequent continuation of the longest n-gram ending before ``t`` that was seen."""
        for n in range(min(self.hi, t), self.lo - 1, -1):
            found = self.next.get(tuple(tokens[t - n : t]))
            if found:
                return found.most_common(1)[0][0]
        return None


def bound(answers: Iterable[dict], questions: dict[int, dict], encode: Encode, answer_ids: Callable[[str], list[int]],
          lo: int = 2, hi: int = 8) -> dict[str, Counter]:
    """Per category: the tokens, and how many of them the own text, the earlier answers, and the earlier answers
    alone predict."""
    earlier, out = Continuations(lo, hi), defaultdict(Counter)
    for answer in answers:
        messages: list[dict] = []
        for turn, text in zip(questions[answer["question_id"]]["turns"], answer["choices"][0]["turns"]):
            messages.append({"role": "user", "content": turn})
            prompt, reply = encode(messages), answer_ids(text)
            tokens, own, counts = [*prompt, *reply], Continuations(lo, hi), out[answer["category"]]
            own.add(prompt)
            for t in range(len(prompt), len(tokens)):
                mine, theirs = own.guess(tokens, t) == tokens[t], earlier.guess(tokens, t) == tokens[t]
                counts.update(tokens=1, own=mine, earlier=theirs, earlier_only=theirs and not mine)
                own.add(tokens, t, t + 1)
            earlier.add(reply)
            messages.append({"role": "assistant", "content": text})
    return out


def table(counts: dict[str, Counter]) -> str:
    lines = ["| category | answer tokens | own text predicts | earlier answers predict | earlier answers only |",
             "|---|---|---|---|---|"]
    total = sum(counts.values(), Counter())
    for category, c in [*counts.items(), ("**all**", total)]:
        own, earlier, only = (f"{c[key] / max(c['tokens'], 1):.1%}" for key in ("own", "earlier", "earlier_only"))
        lines.append(f"| {category} | {c['tokens']} | {own} | {earlier} | {only} |")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("run", help="a graft bench --out directory")
    ap.add_argument("--method", default="ar", help="whose answers (every method's tokens are the same)")
    ap.add_argument("--model", default="smollm2-135m-instruct", help="the tokenizer's model")
    ap.add_argument("--dataset", default=None, help="the questions (default: the run's own)")
    ap.add_argument("--min-match", type=int, default=2)
    ap.add_argument("--max-match", type=int, default=8)
    args = ap.parse_args()
    from transformers import AutoTokenizer

    from graft_cli.catalog.resolve import resolve_model
    from graft_cli.runtime.loading import encode

    run = Path(args.run)
    dataset = args.dataset or json.loads((run / "results.json").read_text())["config"]["dataset"]["path"]
    questions = {q["question_id"]: q for q in map(json.loads, Path(dataset).read_text().splitlines()) if q}
    answers = [json.loads(line) for line in (run / "answers" / f"{args.method}.jsonl").read_text().splitlines()]
    tokenizer = AutoTokenizer.from_pretrained(str(resolve_model(args.model)))

    def prompt(messages: list[dict]) -> list[int]:
        return encode(tokenizer, messages)  # the chat template, as graft bench encodes a turn

    def reply(text: str) -> list[int]:
        return tokenizer.encode(text, add_special_tokens=False)

    print(table(bound(answers, questions, prompt, reply, args.min_match, args.max_match)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
