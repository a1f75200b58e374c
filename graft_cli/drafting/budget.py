"""How many candidate nodes are worth verifying: a latency model of the target.

A node earns its verification slot when the tokens it is expected to add outweigh the extra forward time it
costs. Both sides are estimates: latency by tokens fed (measured, or a device default), and acceptance from each
source's own score, calibrated (graft_cli/core/calibration.py).
"""

from __future__ import annotations

from bisect import bisect_right
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np

from graft_cli.core import defaults_for

DEFAULT_REFERENCE = 512  # the cache (tokens) the default curves were measured over (graft_cli/core/defaults.py)
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
        defaults = defaults_for(device)
        return cls(dict(defaults.latency), defaults.per_context, DEFAULT_REFERENCE)

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
