"""How many candidate nodes are worth verifying: a latency model of the target and calibrated acceptance.

A node earns its verification slot when the tokens it is expected to add outweigh the extra forward time it
costs. Both sides are estimates: latency by tokens fed (measured, or a device default), and acceptance from each
source's own score, corrected online by how often that source's nodes were really accepted.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

import numpy as np

from graft_cli.tree import ROOT, Tree

# Forward latency relative to one token, by tokens fed. CPU: measured on SmolLM2-135M with a 512-token cache and
# graft's CPU kernels (benchmarks/cpu_kernels.py, docs/benchmarks.md: the mean of two rounds, made non-decreasing);
# CUDA: flat while the GPU is memory-bound, the
# regime EAGLE's budget of 60 assumes.
DEFAULT_LATENCY = {
    "cpu": {1: 1.0, 2: 1.08, 3: 1.12, 4: 1.12, 6: 1.12, 8: 1.22, 12: 1.40, 16: 1.52, 24: 2.01, 32: 2.48, 48: 3.47,
            64: 4.26},
    "cuda": {1: 1.0, 16: 1.0, 32: 1.02, 64: 1.08, 128: 1.35},
}


@dataclass
class LatencyModel:
    """Target forward time by number of fed tokens (any unit; only ratios matter), interpolated linearly."""

    points: dict[int, float]

    @classmethod
    def default(cls, device: str) -> LatencyModel:
        return cls(dict(DEFAULT_LATENCY["cuda" if device.startswith("cuda") else "cpu"]))

    def __call__(self, n: int) -> float:
        xs = sorted(self.points)
        ys = [self.points[x] for x in xs]
        if n >= xs[-1]:  # extrapolate with the last slope
            slope = (ys[-1] - ys[-2]) / (xs[-1] - xs[-2]) if len(xs) > 1 else 0.0
            return ys[-1] + slope * (n - xs[-1])
        return float(np.interp(n, xs, ys))

    def best_count(self, fixed: int, fixed_gain: float, scores: list[float], overhead: float = 0.0) -> int:
        """How many of ``scores`` (best first) to verify on top of ``fixed`` nodes: max expected tokens/second.
        ``overhead``: what the step costs besides the forward, in the curve's unit (the drafting already done)."""
        best_k, gain = 0, 1.0 + fixed_gain
        best_rate = gain / (overhead + self(fixed + 1))
        for k, score in enumerate(scores, start=1):
            gain += score
            rate = gain / (overhead + self(fixed + k + 1))
            if rate > best_rate:
                best_k, best_rate = k, rate
        return best_k


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
        return source, min(depth, 6)

    def ratio(self, source: str, depth: int) -> float:
        key = self._key(source, depth)
        return (self.accepted[key] + self.prior) / (self.predicted[key] + self.prior)

    def apply(self, tree: Tree, group: str | None = None) -> Tree:
        """The same tree with every node's conditional score (score / parent's score) corrected."""
        out = Tree()
        for node in tree.nodes:
            parent_raw = 1.0 if node.parent == ROOT else tree.nodes[node.parent].score
            parent_new = 1.0 if node.parent == ROOT else out.nodes[node.parent].score
            conditional = node.score / parent_raw if parent_raw > 0 else 0.0
            corrected = min(1.0, conditional * self.ratio(group or node.source, node.depth))
            out.add(node.parent, node.token, node.source, parent_new * corrected, raw=conditional)
        return out

    def observe(
        self, tree: Tree, accepted_nodes: list[int], group: str | None = None, horizon: int | None = None
    ) -> None:
        """For every calibrated node whose parent was accepted: its source's own estimate, and the outcome.
        Nodes deeper than ``horizon`` are left out (their outcome is unknown when the tree was not verified)."""
        reached = {ROOT, *accepted_nodes}
        accepted = set(accepted_nodes)
        for i, node in enumerate(tree.nodes):
            if horizon is not None and node.depth > horizon:
                continue
            if node.parent in reached and node.raw == node.raw:  # NaN: not calibrated
                key = self._key(group or node.source, node.depth)
                self.predicted[key] += node.raw
                self.accepted[key] += i in accepted
