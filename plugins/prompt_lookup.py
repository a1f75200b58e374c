"""The prompt-local cache: continuations of the current suffix found earlier in the prompt or the output.

An n-gram position index grows by one entry per length with every new token (a long prompt is indexed in one
linear pass), so a lookup never rescans the context and reads at most ``max_matches`` positions. Unlike transformers' prompt lookup, which copies the first match, every earlier occurrence of the
longest matching suffix contributes its continuation to a trie, scored by counts exactly as a suffix-array
datastore scores its matches (the same code: ``datastores.suffix_array.continuation_trie``).
Scores are then calibrated per matched length (``plugins.calibration``): long matches earn verification slots,
one-token matches few.

With ``periodic``, a continuation that runs into the end of the context goes on as it began: the occurrence
ending ``p`` tokens back was followed by the context's last ``p`` tokens, which end with the matched n-gram again,
so text that goes on as it did repeats them (a loop, a list, a table row); without it such a continuation stops
at the context's end, short, and weighs as a match that ended there.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Sequence

import numpy as np

from datastores.suffix_array import SEP, continuation_trie
from graft_cli.plugin import RetrieverDefaults, RetrieverEnv, Step, Tree, option
from plugins.calibration import LookupCalibration, match_group
from plugins.store_retriever import to_tree


class PromptLookup(RetrieverDefaults):
    name = "prompt"
    stateless = False  # its index is of the real context
    calibrated = True  # by LookupCalibration, per matched length

    def __init__(self, min_match: int = 1, max_match: int = 8, max_length: int = 10, max_matches: int = 8,
                 periodic: bool = False) -> None:
        if not 1 <= min_match <= max_match:
            raise ValueError("prompt lookup needs 1 <= min_match <= max_match")
        self.min_match, self.max_match = min_match, max_match
        self.max_length, self.max_matches = max_length, max_matches
        self.periodic = periodic  # a continuation cut by the context's end repeats (module docstring)
        self.tokens: list[int] = []
        self.ends: dict[tuple[int, ...], list[int]] = defaultdict(list)  # n-gram -> positions of its last token
        self.calibration = LookupCalibration()  # its one calibration layer (the proposer adds none)

    def start(self, prompt: Sequence[int]) -> None:
        self.tokens = []
        self.ends.clear()
        self._extend(prompt)

    def _extend(self, tokens: Sequence[int]) -> None:
        ends, low, high = self.ends, self.min_match, self.max_match
        for token in tokens:
            self.tokens.append(int(token))
            end = len(self.tokens) - 1
            tail = tuple(self.tokens[max(0, end + 1 - high) :])  # the longest n-gram ending here; shorter: its tails
            for n in range(low, len(tail) + 1):
                ends[tail[-n:]].append(end)

    def observe(self, step: Step) -> None:
        self.calibration.observe(step)
        self._extend(step.context[len(self.tokens) :])

    def retrieve(self, context: Sequence[int], budget: int) -> Tree:
        self._extend(context[len(self.tokens) :])
        last = len(self.tokens) - 1
        for n in range(min(self.max_match, last), self.min_match - 1, -1):
            # positions ascend and only the newest can be ``last`` itself: a frequent n-gram of a long prompt
            # costs max_matches, not its count
            ends = [e for e in self.ends.get(tuple(self.tokens[last - n + 1 :]), [])[-self.max_matches - 1 :] if e < last]
            if ends:
                conts = [self._continuation(e) for e in ends[-self.max_matches :]]
                rows = np.full((len(conts), max(map(len, conts))), SEP, dtype=np.uint32)
                for row, cont in zip(rows, conts):
                    row[: len(cont)] = cont
                tree = to_tree(continuation_trie(rows, budget), self.name)
                return self.calibration.apply(tree, len(context), match_group(n))
        return Tree()

    def _continuation(self, end: int) -> list[int]:
        """The tokens that followed position ``end`` (before the context's last), at most ``max_length``."""
        cont = self.tokens[end + 1 : end + 1 + self.max_length]
        if self.periodic and len(cont) < self.max_length:
            cont = (cont * -(-self.max_length // len(cont)))[: self.max_length]
        return cont


def make(env: RetrieverEnv) -> PromptLookup:
    return PromptLookup(
        min_match=option(env, "min_match", 1, int),
        max_match=option(env, "max_match", 8, int),
        max_length=option(env, "max_length", 10, int),
        max_matches=option(env, "max_matches", 8, int),
        periodic=option(env, "periodic", False, bool),
    )
