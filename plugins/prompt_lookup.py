"""The prompt-local cache: continuations of the current suffix found earlier in the prompt or the output.

An n-gram position index grows by one entry per length with every new token, so a lookup never rescans the
context. Unlike transformers' prompt lookup, which copies the first match, every earlier occurrence of the
longest matching suffix contributes its continuation to a trie, and a node's score is the share of those
continuations that pass through it.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from typing import Sequence

from graft_cli.tree import ROOT, Tree
from plugins.base import RetrieverEnv, Step


class PromptLookup:
    name = "prompt"

    def __init__(self, min_match: int = 1, max_match: int = 8, max_length: int = 10, max_matches: int = 8) -> None:
        if not 1 <= min_match <= max_match:
            raise ValueError("prompt lookup needs 1 <= min_match <= max_match")
        self.min_match, self.max_match = min_match, max_match
        self.max_length, self.max_matches = max_length, max_matches
        self.tokens: list[int] = []
        self.ends: dict[tuple[int, ...], list[int]] = defaultdict(list)  # n-gram -> positions of its last token

    def start(self, prompt: Sequence[int]) -> None:
        self.tokens = []
        self.ends.clear()
        self._extend(prompt)

    def _extend(self, tokens: Sequence[int]) -> None:
        for token in tokens:
            self.tokens.append(int(token))
            end = len(self.tokens) - 1
            for n in range(self.min_match, min(self.max_match, end + 1) + 1):
                self.ends[tuple(self.tokens[end - n + 1 : end + 1])].append(end)

    def observe(self, step: Step) -> None:
        self._extend(step.context[len(self.tokens) :])

    def retrieve(self, context: Sequence[int], budget: int) -> Tree:
        self._extend(context[len(self.tokens) :])
        last = len(self.tokens) - 1
        for n in range(min(self.max_match, last), self.min_match - 1, -1):
            ends = [e for e in self.ends.get(tuple(self.tokens[last - n + 1 :]), ()) if e < last]
            if ends:
                conts = [self.tokens[e + 1 : e + 1 + self.max_length] for e in ends[-self.max_matches :]]
                return continuation_trie(conts, self.name).select(budget)
        return Tree()


def continuation_trie(continuations: list[Sequence[int]], source: str) -> Tree:
    """Merge continuations into a trie scored by counts: each step's conditional is count(child) / (count(parent)
    + 1), so a path seen once is not taken for a certainty (the engine calibrates the rest online)."""
    counts = Counter(tuple(c[:d]) for c in continuations for d in range(1, len(c) + 1))
    counts[()] = len(continuations)
    tree, nodes, scores = Tree(), {(): ROOT}, {(): 1.0}
    for prefix in sorted(counts, key=lambda p: (len(p), -counts[p]))[1:]:
        parent = prefix[:-1]
        scores[prefix] = scores[parent] * counts[prefix] / (counts[parent] + 1)
        nodes[prefix] = tree.add(nodes[parent], prefix[-1], source, scores[prefix])
    return tree


def make(env: RetrieverEnv) -> PromptLookup:
    opts = env.options
    return PromptLookup(
        min_match=int(opts.get("prompt.min_match", 1)),
        max_match=int(opts.get("prompt.max_match", 8)),
        max_length=int(opts.get("prompt.max_length", 10)),
        max_matches=int(opts.get("prompt.max_matches", 8)),
    )
