"""Calibrated acceptance: each source's scores corrected online by how often its nodes were really accepted.

A retriever's count ("this continuation followed 3 times of 4") or a drafter's probability is an estimate of
acceptance only after calibration; the proposer ranks every source's nodes by the calibrated estimate, so a
source that over-promises loses slots. Retrievers that keep finer groups of their own use it too.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

from graft_cli.core.tree import ROOT, Tree

DEPTHS = 6  # depths from here on share one calibration entry


@dataclass
class Calibration:
    """Per source (or ``group``) and depth, the ratio of nodes accepted to acceptance predicted, applied to each
    node's conditional score. Starts at 1 (trust the source) with a weak prior, so it adapts within a few steps.

    The proposer keeps one over every source; a retriever may keep its own, grouped by what it knows of a lookup
    (the prompt-local cache: how long the matched suffix was)."""

    prior: float = 2.0
    predicted: dict = field(default_factory=lambda: defaultdict(float))
    accepted: dict = field(default_factory=lambda: defaultdict(float))

    @staticmethod
    def _key(source: str, depth: int) -> tuple[str, int]:
        return source, min(depth, DEPTHS)

    def ratio(self, source: str, depth: int) -> float:
        key = self._key(source, depth)
        return (self.accepted[key] + self.prior) / (self.predicted[key] + self.prior)

    def apply(self, tree: Tree, group: str | None = None, in_place: bool = False) -> Tree:
        """The same tree with every node's conditional score (score / parent's score) corrected.
        The shape is unchanged, so the copy is built in one pass (nothing to merge); ``in_place``: no copy, for
        a caller that owns ``tree`` (a retriever's fresh lookup)."""
        ratios: dict[tuple[str, int], float] = {}
        nodes, scores, raws = tree.nodes, [], []
        for node in nodes:
            key = (group or node.source, node.depth if node.depth < DEPTHS else DEPTHS)
            ratio = ratios.get(key)
            if ratio is None:
                ratio = ratios[key] = (self.accepted[key] + self.prior) / (self.predicted[key] + self.prior)
            if node.parent == ROOT:
                conditional = node.score
                scores.append(min(1.0, conditional * ratio))
            else:
                parent_raw = nodes[node.parent].score
                conditional = node.score / parent_raw if parent_raw > 0 else 0.0
                scores.append(scores[node.parent] * min(1.0, conditional * ratio))
            raws.append(conditional)
        if in_place:
            for node, score, raw in zip(nodes, scores, raws):
                node.score, node.raw = score, raw
            return tree
        return tree.rescored(scores, raws)

    def observe(
        self, tree: Tree, accepted_nodes: list[int], group: str | None = None, horizon: int | None = None
    ) -> None:
        """For every calibrated node whose parent was accepted: its source's own estimate, and the outcome.
        Nodes deeper than ``horizon`` are left out (their outcome is unknown when the tree was not verified)."""
        accepted = set(accepted_nodes)
        nodes = tree.nodes
        # only the children of the root and of accepted nodes were judged; in node order, so sums add up as before
        for i in sorted(i for parent in (ROOT, *accepted_nodes) for i in tree.children(parent)):
            node = nodes[i]
            if (horizon is None or node.depth <= horizon) and node.raw == node.raw:  # NaN: not calibrated
                key = self._key(group or node.source, node.depth)
                self.predicted[key] += node.raw
                self.accepted[key] += i in accepted
