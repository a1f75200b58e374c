"""Time as something handed in: the clock a part reads and the recorder its counts and seconds go to.

Nothing in graft reads the wall clock itself. The loop's phases, a drafter's draft and catch-up seconds, a
proposer's retrieval and the cost model's latency readings all go through a :class:`Recorder` made by whoever
runs the generation, so a benchmark that models another device's time (benchmarks/host_time/) replaces one
clock, and a decision that depends on time is a function of what it was handed.
"""

from __future__ import annotations

from contextlib import contextmanager
from time import perf_counter
from typing import Callable, Iterator

from graft_cli.core.stats import Stats

Clock = Callable[[], float]  # seconds, monotonic


class Recorder:
    """Where a request's counters and phase seconds go, read on ``clock``. One recorder serves a proposer for its
    whole life; :meth:`begin` points it at each request's :class:`Stats`."""

    def __init__(self, clock: Clock = perf_counter) -> None:
        self.clock = clock
        self.stats = Stats()

    def begin(self, stats: Stats) -> None:
        """A new request: what is recorded from now on goes to ``stats``."""
        self.stats = stats

    def add(self, phase: str, seconds: float) -> None:
        self.stats.times[phase] += seconds

    @contextmanager
    def timed(self, phase: str) -> Iterator[None]:
        """The seconds of the ``with`` block go to ``phase``."""
        start = self.clock()
        try:
            yield
        finally:
            self.add(phase, self.clock() - start)

