"""Prune-then-graft: the draft tree keeps only what the drafter is confident about, and the verification slots
that frees are filled with retrieved nodes. Every method is this proposer with some parts left out: no drafter
and no retrievers is plain decoding, retrievers alone are PLD/REST/Token Recycling, a drafter alone is EAGLE."""

from __future__ import annotations

from typing import Protocol, Sequence

from graft_cli.budget import Calibration, LatencyModel
from graft_cli.stats import Stats
from graft_cli.tree import Tree
from plugins.base import Retriever, Step


class Drafter(Protocol):
    """Grows a draft tree from the context (and prunes it itself when given a pruner)."""

    wants_hidden: bool

    def start(self, prompt: Sequence[int], prefill: Step) -> None: ...

    def draft(self, context: Sequence[int], budget: int, stats: Stats) -> Tree: ...

    def observe(self, step: Step) -> None: ...


class GraftProposer:
    def __init__(
        self,
        budget: int,
        retrievers: Sequence[Retriever] = (),
        drafter: Drafter | None = None,
        latency: LatencyModel | None = None,
    ) -> None:
        self.budget = budget
        self.retrievers = list(retrievers)
        self.drafter = drafter
        self.latency = latency or LatencyModel.default("cpu")
        self.calibration = Calibration()
        self.wants_hidden = bool(drafter and drafter.wants_hidden)

    def start(self, prompt: Sequence[int], prefill: Step) -> None:
        if self.drafter:
            self.drafter.start(prompt, prefill)
        for retriever in self.retrievers:
            retriever.start(prompt)

    def propose(self, context: Sequence[int], stats: Stats) -> Tree:
        tree = self.drafter.draft(context, self.budget, stats) if self.drafter else Tree()
        room = self.budget - len(tree)
        if room <= 0 or not self.retrievers:
            return tree
        pool = Tree()
        for retriever in self.retrievers:
            pool.merge(self.calibration.apply(retriever.retrieve(context, room)))
        # retrieved nodes only take a slot when the tokens they are expected to add pay for their verification
        scores = [pool.nodes[i].score for i in pool.ranked()[:room]]
        keep = self.latency.best_count(len(tree), sum(n.score for n in tree.nodes), scores)
        tree.graft(pool.select(keep), self.budget)
        return tree

    def observe(self, step: Step) -> None:
        if self.drafter:
            self.drafter.observe(step)
        for retriever in self.retrievers:
            retriever.observe(step)
        self.calibration.observe(step.tree, [row - 1 for row in step.kept[1:]])
