"""Retriever over a FAISS n-gram datastore (``graft index build --kind ngram``).

Entry point ``ngram = "plugins.ngram_retriever:make"``. Options (strings; ``ngram.<key>`` wins over ``<key>``):

``datastore``   store name (under ``$GRAFT_HOME/datastores``) or path -- required
``neighbours``  nearest stored contexts consulted besides the exact one (8; 0 = exact n-grams only)
``min_sim``     cosine similarity a neighbour needs to count (0.8)
``depth``       longest continuation proposed (8)

Scores: at the first level, ``max similarity x sum(sim x count) / sum(sim x total)`` over the exact context and
its neighbours; deeper nodes multiply by the exact n-gram probability of each next token.
"""

from __future__ import annotations

from typing import Any

from graft_cli.plugin import GraftError, RetrieverEnv
from plugins.store_retriever import StoreRetriever


class NgramRetriever(StoreRetriever):
    """Exact and nearest n-gram contexts in a FAISS-indexed store; their next tokens scored by similarity x count."""

    name = "ngram"
    kind = "ngram"
    defaults = {"neighbours": 8, "min_sim": 0.8, "depth": 8}

    def check(self, params: dict[str, Any]) -> None:
        if params["neighbours"] < 0 or params["depth"] < 1:
            raise GraftError(f"retriever {self.name}: neighbours must be at least 0 and depth at least 1")


def make(env: RetrieverEnv) -> NgramRetriever:
    return NgramRetriever(env)
