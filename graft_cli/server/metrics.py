"""``GET /metrics``: what a server did, in Prometheus' text format (version 0.0.4), per request and in total.

Counters over the server's life (requests by how they ended, prompt, cached and generated tokens, verification
steps, accepted tokens by source, seconds generating), the prefix cache's lookups, hits, cached tokens, bytes and
nodes, the queue as it is now, and two per-request histograms: tokens per second and accepted tokens per step.
The worker counts a request when it ends (:meth:`Metrics.count`); a scrape reads under the same lock.
"""

from __future__ import annotations

import threading
from collections import Counter
from typing import Any, Callable

from graft_cli.api import Completion

RATE_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500)  # tokens per second of a request
STEP_BUCKETS = (1, 1.5, 2, 3, 4, 6, 8, 12)  # accepted tokens per verification step of a request


class Histogram:
    """Prometheus' cumulative buckets, their sum and count."""

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds, self.counts, self.sum, self.count = bounds, [0] * len(bounds), 0.0, 0

    def observe(self, value: float) -> None:
        for i, bound in enumerate(self.bounds):
            if value <= bound:
                self.counts[i] += 1
        self.sum += value
        self.count += 1

    def lines(self, name: str) -> list[str]:
        rows = [f'{name}_bucket{{le="{bound:g}"}} {n}' for bound, n in zip(self.bounds, self.counts)]
        return [*rows, f'{name}_bucket{{le="+Inf"}} {self.count}', f"{name}_sum {self.sum:.6g}",
                f"{name}_count {self.count}"]


class Metrics:
    """The server's figures; ``queue``: the worker's (waiting, busy) when scraped; ``prefix``: the prefix cache's
    totals and size when scraped (None: no prefix cache)."""

    def __init__(self, queue: Callable[[], tuple[int, bool]], prefix: Callable[[], dict] | None) -> None:
        self.queue, self.prefix = queue, prefix
        self.lock = threading.Lock()
        self.finished: Counter = Counter()  # requests by finish reason
        self.tokens: Counter = Counter()  # prompt, cached, generated
        self.steps = 0
        self.seconds = 0.0
        self.accepted: Counter = Counter()  # by source ("bonus": the target's own)
        self.rate, self.per_step = Histogram(RATE_BUCKETS), Histogram(STEP_BUCKETS)

    def count(self, completion: Completion) -> None:
        """A request that ended (stopped, at its length, or cut off), from the worker thread."""
        stats = completion.stats
        with self.lock:
            self.finished[completion.finish_reason] += 1
            self.tokens.update(prompt=completion.prompt_tokens, cached=stats.cached_tokens,
                               generated=len(completion.token_ids))
            self.steps += stats.steps
            self.seconds += stats.wall
            self.accepted.update(stats.accepted)
            if stats.wall > 0:
                self.rate.observe(stats.tokens_per_s)
            if stats.steps:
                self.per_step.observe(stats.tau)

    def text(self) -> str:
        """The exposition, one family after another."""
        waiting, busy = self.queue()
        with self.lock:
            families = [
                ("graft_requests_total", "counter", "Requests that ended, by finish reason.",
                 [(f'{{finish="{k}"}}', v) for k, v in sorted(self.finished.items())] or [("", 0)]),
                ("graft_tokens_total", "counter", "Prompt tokens, prompt tokens from the prefix cache, generated "
                 "tokens.", [(f'{{kind="{k}"}}', self.tokens[k]) for k in ("prompt", "cached", "generated")]),
                ("graft_steps_total", "counter", "Verification steps of the target.", [("", self.steps)]),
                ("graft_accepted_tokens_total", "counter", "Accepted tokens by source (bonus: the target's own).",
                 [(f'{{source="{k}"}}', v) for k, v in sorted(self.accepted.items())] or [("", 0)]),
                ("graft_generation_seconds_total", "counter", "Seconds spent generating.", [("", self.seconds)]),
                ("graft_queue_waiting", "gauge", "Requests waiting for the model.", [("", waiting)]),
                ("graft_busy", "gauge", "1 while a request runs.", [("", int(busy))]),
                *_prefix_families(self.prefix() if self.prefix is not None else None),
            ]
            lines = [line for family in families for line in _family(*family)]
            for name, help_text, histogram in (
                    ("graft_request_tokens_per_second", "Generated tokens per second of each request.", self.rate),
                    ("graft_request_accepted_per_step", "Accepted tokens per verification step of each request.",
                     self.per_step)):
                lines += [f"# HELP {name} {help_text}", f"# TYPE {name} histogram", *histogram.lines(name)]
        return "\n".join(lines) + "\n"


def _prefix_families(totals: dict | None) -> list[tuple[str, str, str, list[tuple[str, Any]]]]:
    if totals is None:
        return []
    return [
        ("graft_prefix_cache_lookups_total", "counter", "Requests that looked the prefix cache up.",
         [("", totals["lookups"])]),
        ("graft_prefix_cache_hits_total", "counter", "Lookups that resumed from cached rows.", [("", totals["hits"])]),
        ("graft_prefix_cache_cached_tokens_total", "counter", "Prompt tokens resumed from the prefix cache.",
         [("", totals["cached_tokens"])]),
        ("graft_prefix_cache_bytes", "gauge", "Bytes of KV rows the prefix cache holds.", [("", totals["bytes"])]),
        ("graft_prefix_cache_nodes", "gauge", "Nodes of the prefix cache's radix tree.", [("", totals["nodes"])]),
    ]


def _family(name: str, kind: str, help_text: str, samples: list[tuple[str, Any]]) -> list[str]:
    values = [f"{name}{labels} {value:.6g}" if isinstance(value, float) else f"{name}{labels} {value}"
              for labels, value in samples]
    return [f"# HELP {name} {help_text}", f"# TYPE {name} {kind}", *values]
