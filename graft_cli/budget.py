"""How many candidate nodes are worth verifying: a latency model of the target and calibrated acceptance.

A node earns its verification slot when the tokens it is expected to add outweigh the extra forward time it
costs. Both sides are estimates: latency by tokens fed (measured, or a device default), and acceptance from each
source's own score, corrected online by how often that source's nodes were really accepted.
"""

from __future__ import annotations

from bisect import bisect_right
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Sequence

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
# What each context token past the curve's own cache (512 tokens) adds, in the same unit: to every forward, and per
# fed token after the first. CPU: SmolLM2-135M, one thread, verification at 4K against a few hundred tokens
# (docs/benchmarks.md, "Long context": one row 50 -> 86 ms, 17 rows 78 -> 200 ms). CUDA: not measured yet, so none.
DEFAULT_PER_CONTEXT = {"cpu": (1.9e-4, 2.8e-5), "cuda": (0.0, 0.0)}
DEFAULT_REFERENCE = 512
SPAN = 256  # node counts the latency curve is first tabulated for (more on demand)


@dataclass
class LatencyModel:
    """Target forward time by number of fed tokens (any unit; only ratios matter), interpolated linearly, over a
    cache of ``reference`` tokens; past that, each context token adds ``per_context[0]`` to every forward and
    ``per_context[1]`` per fed token after the first (attention reads the whole cache for every row, so at 4K
    tokens a tree's extra rows cost several times what they cost at a few hundred). ``context``: the cache the
    next verification runs over, set by the proposer every step. ``points`` is replaced, never changed in place
    (the interpolation table is cached by it)."""

    points: dict[int, float]
    per_context: tuple[float, float] = (0.0, 0.0)
    reference: int = 320
    context: int = 0
    _cached: tuple | None = field(default=None, repr=False, compare=False)  # (points, xs, ys, last slope)
    _spans: dict = field(default_factory=dict, repr=False, compare=False)  # context past reference -> curve from 0

    @classmethod
    def default(cls, device: str) -> LatencyModel:
        kind = "cuda" if device.startswith("cuda") else "cpu"
        return cls(dict(DEFAULT_LATENCY[kind]), DEFAULT_PER_CONTEXT[kind], DEFAULT_REFERENCE)

    def __call__(self, n: float) -> float:
        """Latency at one count: the scalar path (plain Python: the objective asks a few dozen times a step)."""
        _, xs, ys, slope = self._table()
        if n >= xs[-1]:
            out = ys[-1] + slope * (n - xs[-1])
        else:
            i = max(bisect_right(xs, n), 1)
            out = ys[0] if n <= xs[0] else ys[i - 1] + (ys[i] - ys[i - 1]) * (n - xs[i - 1]) / (xs[i] - xs[i - 1])
        longer = self.context - self.reference
        if longer > 0:
            out += longer * (self.per_context[0] + self.per_context[1] * (n - 1))
        return out

    def curve(self, ns: np.ndarray) -> np.ndarray:
        """Latency at every count of ``ns`` in one pass: linear between the points, the last slope beyond them,
        plus what the context past ``reference`` adds."""
        _, xs, ys, slope = self._table()
        out = np.interp(ns, xs, ys)
        beyond = ns >= xs[-1]
        out[beyond] = ys[-1] + slope * (ns[beyond] - xs[-1])
        longer = self.context - self.reference
        if longer > 0:
            out = out + longer * (self.per_context[0] + self.per_context[1] * (np.asarray(ns, dtype=np.float64) - 1))
        return out

    def _table(self) -> tuple[dict, list[float], list[float], float]:
        """The points, as sorted lists, and the last slope, rebuilt only when ``points`` is replaced (returned as
        cached: no new tuple on the scalar path)."""
        cached = self._cached
        if cached is None or cached[0] is not self.points:
            xs = [float(x) for x in sorted(self.points)]
            ys = [float(self.points[x]) for x in sorted(self.points)]
            slope = (ys[-1] - ys[-2]) / (xs[-1] - xs[-2]) if len(xs) > 1 else 0.0
            cached = self._cached = (self.points, xs, ys, slope)
            self._spans.clear()
        return cached

    def best_count(self, fixed: int, fixed_gain: float, scores: Sequence[float], overhead: float = 0.0,
                   going: float | None = None) -> int:
        """How many of ``scores`` (best first) to verify on top of ``fixed`` nodes: max expected tokens/second.
        ``overhead``: what the step costs besides the forward, in the curve's unit (the drafting already done);
        ``going``: what a unit of time buys on average (tokens per unit), when known: then the count with the most
        tokens beyond what its time would buy at that rate (a node pays when it beats the going rate, however
        the step went so far)."""
        row = np.asarray(scores, dtype=np.float64)[None]
        counts, _ = self.best_counts(fixed, fixed_gain, row, np.array([overhead]), going)
        return int(counts[0])

    def best_counts(self, fixed: int, fixed_gain: float, scores: np.ndarray, overheads: np.ndarray,
                    going: float | None = None) -> tuple[np.ndarray, np.ndarray]:
        """:meth:`best_count` for every row of ``scores`` ``[R, n]``, each with its overhead, in one array pass
        over every candidate count (the first count reaching a row's best value wins, so a row padded with zeros
        never takes its padding); and each row's expected tokens there (1 + ``fixed_gain`` + its scores')."""
        rows, n = scores.shape
        gains = np.empty((rows, n + 1))
        gains[:, 0] = 1.0 + fixed_gain
        gains[:, 1:] = scores
        np.cumsum(gains, axis=1, out=gains)
        costs = overheads[:, None] + self._counts(fixed + 1, n + 1)
        values = gains / costs if going is None else gains - going * costs  # a rate, or tokens beyond their time
        values[np.isnan(values)] = -np.inf  # a NaN score never wins (nor does any count after it)
        counts = np.argmax(values, axis=1)
        return counts, gains[np.arange(rows), counts]

    def _counts(self, first: int, n: int) -> np.ndarray:
        """The latency of ``first, first + 1, ...`` (``n`` counts): a slice of the curve over every count from 0,
        kept while the points and the context stay (the curve is elementwise, so a slice equals the span computed
        alone; the tree sizes asked for change every step, the curve does not)."""
        self._table()  # new points drop the curves of the old
        # the context changes every step, but it moves the curve only past ``reference``, and only with a per-context
        # cost: a key without it then finds the same curve step after step
        longer = max(0, self.context - self.reference) if any(self.per_context) else 0
        end = first + n
        curve = self._spans.get(longer)
        if curve is None or curve.shape[0] < end:
            if len(self._spans) > 64:
                self._spans.clear()
            size = max(end, SPAN, 0 if curve is None else 2 * curve.shape[0])
            curve = self._spans[longer] = self.curve(np.arange(size, dtype=np.float64))
        return curve[first:end]


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
