"""Retriever over a FAISS n-gram datastore (``graft index build --kind ngram``).

Entry point ``ngram = "plugins.ngram_faiss:make"``. Options (strings; ``ngram.<key>`` wins over ``<key>``):

``datastore``   store name (under ``$GRAFT_HOME/datastores``) or path -- required
``neighbours``  nearest stored contexts consulted besides the exact one (8; 0 = exact n-grams only)
``min_sim``     cosine similarity a neighbour needs to count (0.8)
``depth``       longest continuation proposed (8)

Scores: at the first level, ``max similarity x sum(sim x count) / sum(sim x total)`` over the exact context and
its neighbours; deeper nodes multiply by the exact n-gram probability of each next token.
"""

from __future__ import annotations

from typing import Sequence

from graft_cli.errors import GraftError
from graft_cli.tree import Tree
from plugins.base import RetrieverEnv, Step
from plugins.suffix_array import lookup_to_tree, open_datastore, option


class NgramRetriever:
    name = "ngram"

    def __init__(self, env: RetrieverEnv) -> None:
        self.index = open_datastore(env, self.name, "ngram")
        n = self.name
        self.params = {
            "neighbours": option(env, n, "neighbours", 8, int),
            "min_sim": option(env, n, "min_sim", 0.8, float),
            "depth": option(env, n, "depth", 8, int),
        }
        if self.params["neighbours"] < 0 or self.params["depth"] < 1:
            raise GraftError(f"retriever {n}: neighbours must be at least 0 and depth at least 1")
        self.last = None

    def start(self, prompt: Sequence[int]) -> None:
        pass

    def retrieve(self, context: Sequence[int], budget: int) -> Tree:
        if budget <= 0 or not context:
            return Tree()
        self.last = self.index.lookup(context, budget=budget, **self.params)
        return lookup_to_tree(self.last, self.name)

    def observe(self, step: Step) -> None:
        pass


def make(env: RetrieverEnv) -> NgramRetriever:
    return NgramRetriever(env)
