"""The response cache: continuations of the current context found in the responses this process has produced
(and, with ``responses.file``, the ones an earlier process kept).

Agents, chats and tools repeat themselves across requests: a rewrite of the last answer, the same tool call with
other arguments, the same boilerplate. The prompt-local cache sees only one request; Token Recycling remembers
which token follows which, not the text. This retriever remembers the text: every response is added, as tokens,
to an index (``plugins.response_index``: sorted backward n-gram keys in two runs, evicted oldest first past
``responses.max_tokens``), and a lookup proposes what followed the longest matching suffix of the context (up to
``responses.max_match`` tokens), as a count-scored trie, the way graft's other lookups do
(``datastores.suffix_array.continuation_trie``), calibrated per matched length (``plugins.calibration``).

Each response is stored with the last ``max_match`` tokens of its prompt in front (the chat template's
"assistant" turn, say), so that the opening of an answer is found from the end of its prompt. The response
being generated is indexed as it is accepted, so it is searched too. ``start`` commits the previous response,
``close`` commits the last one and saves the file (atomically, without pickles, refused under another
tokenizer: ``datastores.responses``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

import numpy as np

from datastores import DatastoreError, fingerprint_from_tokenizer
from datastores.responses import read_responses, write_responses
from datastores.suffix_array import continuation_trie
from graft_cli.plugin import GraftError, RetrieverDefaults, RetrieverEnv, Step, Tree, option
from plugins.calibration import LookupCalibration, match_group
from plugins.response_index import ResponseIndex, Run, lookup
from plugins.store_retriever import to_tree

NAME = "responses"


class CacheFile:
    """Where the cache is kept between processes, and under which tokenizer its ids are meaningful."""

    def __init__(self, path: str, fingerprint: str | None, vocab_size: int) -> None:
        self.path, self.fingerprint, self.vocab_size = Path(path).expanduser(), fingerprint, vocab_size

    def load(self, index: ResponseIndex) -> None:
        """Add what the file holds (when it exists) to ``index``; one GraftError line for a file of another
        tokenizer or a corrupt one."""
        if not self.path.exists():
            return
        try:
            file = read_responses(self.path)
            file.check(self.path, self.fingerprint, self.vocab_size)
        except DatastoreError as e:
            raise GraftError(str(e)) from None
        index.add(file.sequences())

    def save(self, index: ResponseIndex) -> None:
        tokens, offsets = index.sequences()
        try:
            write_responses(self.path, tokens, offsets, self.fingerprint, self.vocab_size)
        except OSError as e:
            raise GraftError(f"cannot save the response cache to {self.path}: {e.strerror or e}") from None


class ResponseCache(RetrieverDefaults):
    name = NAME
    stateless = False  # the current response is indexed as it is accepted: lookups of the real context only
    calibrated = True  # by LookupCalibration, per matched length

    def __init__(self, index: ResponseIndex, min_match: int = 2, max_length: int = 16, max_matches: int = 64,
                 file: CacheFile | None = None, factor: float = 0.0, min_score: float = 0.0) -> None:
        if not 1 <= min_match <= index.width or max_length < 1 or max_matches < 1 or factor < 0 or min_score < 0:
            raise ValueError("responses needs 1 <= min_match <= max_match, max_length >= 1, max_matches >= 1 "
                             "and factor, min_score >= 0")
        self.index, self.file = index, file
        self.min_match, self.max_length, self.max_matches = min_match, max_length, max_matches
        self.factor = factor  # continuations at most factor x the matched length deep (0: max_length)
        self.min_score = min_score  # nodes whose calibrated acceptance estimate is lower are not proposed
        self.live: Run | None = None  # the response being generated, behind the end of its prompt
        self.prompt_len = self.generated = 0
        self.changed = False  # responses added since the file was read
        self.calibration = LookupCalibration()  # its one calibration layer (the proposer adds none)
        if file is not None:
            file.load(index)

    def start(self, prompt: Sequence[int]) -> None:
        self._commit()
        self.live = Run(self.index.width)
        self.live.extend(np.asarray(prompt[-self.index.width :], dtype=np.int64))
        self.prompt_len, self.generated = len(prompt), 0

    def observe(self, step: Step) -> None:
        self.calibration.observe(step)
        self._catch_up(step.context)

    def _catch_up(self, context: Sequence[int]) -> None:
        """Index the tokens the context gained since the last call (the first: the prefill's token)."""
        done = self.prompt_len + self.generated
        if self.live is not None and len(context) > done:
            new = context[done:]
            self.live.extend(np.asarray(new, dtype=np.int64))
            self.generated += len(new)

    def retrieve(self, context: Sequence[int], budget: int) -> Tree:
        if budget <= 0 or self.live is None:
            return Tree()
        self._catch_up(context)
        runs = [(self.live, 1), *self.index.runs()]
        n, rows = lookup(runs, context, self.index.width, self.min_match, self.max_matches, self.max_length)
        if not n:
            return Tree()
        if self.factor:  # a short match is weak evidence for a long continuation
            rows = rows[:, : max(1, min(self.max_length, int(self.factor * n)))]
        tree = to_tree(continuation_trie(rows, budget), self.name)
        tree = self.calibration.apply(tree, len(context), match_group(n, cap=self.index.width))
        if not self.min_score:
            return tree
        # the calibration judges the whole lookup; the proposer gets the nodes worth a slot (prefix-closed: a
        # node's estimate never exceeds its parent's)
        return tree.subtree([i for i, node in enumerate(tree.nodes) if node.score >= self.min_score])

    def _commit(self) -> None:
        """The response generated so far joins the index (with its prompt's end in front)."""
        if self.live is not None and self.generated:
            self.index.add([self.live.tokens[1:]])
            self.changed = True
        self.live = None

    def close(self) -> None:
        """Commit the last response and save the cache to ``responses.file`` (when anything was added)."""
        self._commit()
        if self.file is not None and self.changed:
            self.file.save(self.index)
            self.changed = False


def make(env: RetrieverEnv) -> ResponseCache:
    index = ResponseIndex(option(env, "max_tokens", 1_000_000, int), option(env, "max_match", 8, int))
    path = option(env, "file", None)
    file = None
    if path:
        fingerprint = fingerprint_from_tokenizer(env.tokenizer) if env.tokenizer is not None else None
        file = CacheFile(path, fingerprint, env.vocab_size)
    return ResponseCache(index, min_match=option(env, "min_match", 2, int),
                         max_length=option(env, "max_length", 16, int),
                         max_matches=option(env, "max_matches", 64, int), file=file,
                         factor=option(env, "factor", 0.0, float),
                         min_score=option(env, "min_score", 0.0, float))
