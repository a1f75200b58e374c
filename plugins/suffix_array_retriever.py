"""Retriever over a suffix-array datastore (``graft index build --kind suffix-array``).

Entry point ``suffix-array = "plugins.suffix_array_retriever:make"``. Options (``env.options``, strings; a key prefixed
with the retriever's name, e.g. ``suffix-array.datastore``, wins over the plain key):

``datastore``        store name (under ``$GRAFT_HOME/datastores``) or path -- required
``max_match``        longest context suffix tried (16)
``min_match``        shortest suffix accepted (2)
``depth``            longest continuation proposed (8)
``max_occurrences``  occurrences counted per lookup, evenly spaced over the match (512)
``prior``            score = count / (occurrences + prior) (1.0)
``verify``           ``1`` to check full SHA-256 of every file at open (slow on big stores)

Each node's score is the share of the matched suffix's occurrences that continue with its path -- the
product of child/parent counts down the path, shrunk by ``prior`` -- an estimate of the probability that the
target accepts that path, comparable across retrievers.
"""

from __future__ import annotations

from typing import Any

from graft_cli.plugin import GraftError, RetrieverEnv
from plugins.store_retriever import StoreRetriever


class SuffixArrayRetriever(StoreRetriever):
    """Longest-suffix match in a suffix-array store; continuations counted into a scored trie."""

    name = "suffix-array"
    kind = "suffix-array"
    defaults = {"max_match": 16, "min_match": 2, "depth": 8, "max_occurrences": 512, "prior": 1.0}

    def check(self, params: dict[str, Any]) -> None:
        if params["min_match"] < 1 or params["max_match"] < params["min_match"]:
            raise GraftError(f"retriever {self.name}: need 1 <= min_match <= max_match")
        if params["depth"] < 1 or params["max_occurrences"] < 1 or params["prior"] < 0:
            raise GraftError(f"retriever {self.name}: depth and max_occurrences must be at least 1, prior at least 0")


def make(env: RetrieverEnv) -> SuffixArrayRetriever:
    return SuffixArrayRetriever(env)
