"""Captured regions: a CUDA graph per shape, recorded lazily after a warm-up and replayed from then on; the eager
call wherever that cannot be (a CPU, the switch off, a capture that failed).

A region is a function of static buffers only (graft_cli/runtime/fixed_shapes.py): it reads its inputs from tensors
the host writes in place, and the tensors it returns are its outputs, which a replay overwrites where the capture
put them. Each key (a bucket, what is asked of it, and the addresses of the memory it touches) is run eagerly
``warmup`` times first (its first call may load kernels, build caches, install hooks: things a capture must not
see), then captured once with ``torch.cuda.CUDAGraph`` -- the eager kernels recorded as they are, which takes
about as long as a few eager calls (``torch.compile``'s "reduce-overhead" would compile the model first: minutes
per bucket on an 8B model) -- into ONE memory pool that every graph of the target shares (a drafter's graphs
share one of their own).

Graphs in one pool may reuse each other's memory: a graph recorded later may put its outputs where an earlier one
keeps its scratch. So in a pool every graph's outputs are used before a graph recorded earlier replays: each
draft level's outputs before the next level, a verification's and its acceptance's by the step (the acceptance
graph is keyed by the keys its verification read, so the two are recorded together, in the order they replay).

A capture that fails (an operation a graph cannot hold, memory) leaves that key eager for good, with one line on
stderr: a graph is an optimisation, never a reason to stop generating.

The keys are bounded: an acceptance graph is keyed by its sampling settings, so a server that meets many of them
would keep a graph (and its memory) for each. Past ``LIMIT`` keys every graph is dropped at the next step's start
(:meth:`Graphs.trim`) and recorded again as its shapes come back: never one graph alone, nor in the middle of a
step, since a graph must be recorded after the graphs whose outputs it reads (the acceptance after its
verification) and before those that read its own (the pool's order above).
"""

from __future__ import annotations

import sys
from collections import Counter
from time import perf_counter
from typing import Any, Callable, Hashable

import torch

from graft_cli.runtime.compiled import Compiler, Compiling

WARMUP = 2  # eager calls of a key before it is captured
LIMIT = 256  # keys (counted or captured) a Graphs holds before it drops them all
Region = Callable[[], Any]
Replay = Callable[[], None]


class CudaCapture:
    """Records a region as a CUDA graph into one pool shared by every graph it records."""

    def __init__(self) -> None:
        self.pool: Any = None

    def apart(self) -> CudaCapture:
        """A capture into a pool of its own (a drafter's graphs, which replay between the target's)."""
        return CudaCapture()

    def __call__(self, region: Region) -> tuple[Replay, Any]:
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            out = region()
        return graph.replay, out


Capture = Callable[[Region], tuple[Replay, Any]]


class Graphs:
    """Regions by key: replayed once captured, eager before that and wherever ``capture`` is None. ``seconds``:
    what each capture took (the start-up cost the docs quote). A :class:`Compiling` capture compiles each keyed
    region first (graft_cli/runtime/compiled.py): its warm-ups and its capture run the compiled region."""

    def __init__(self, capture: Capture | Compiling | None, warmup: int = WARMUP, limit: int = LIMIT) -> None:
        self.compiler: Compiler | None = capture.compiler if isinstance(capture, Compiling) else None
        self.capture = capture.inner if isinstance(capture, Compiling) else capture
        self.warmup, self.limit = warmup, limit
        self.captured: dict[Hashable, tuple[Replay, Any]] = {}
        self.calls: Counter = Counter()
        self.failed: set[Hashable] = set()
        self.seconds: dict[Hashable, float] = {}

    def run(self, key: Hashable | None, region: Region) -> Any:
        """``region``'s outputs for this call: replayed, captured now, or run eagerly (``key`` None: always)."""
        found = self.captured.get(key) if key is not None else None
        if found is not None:
            found[0]()
            return found[1]
        if key is None or key in self.failed:
            return region()
        if self.compiler is not None:
            region = self.compiler(region)
        if self.capture is None:
            return region()
        self.calls[key] += 1
        if self.calls[key] <= self.warmup:
            return region()
        return self._captured(key, region)

    def _captured(self, key: Hashable, region: Region) -> Any:
        started = perf_counter()
        try:
            replay, out = self.capture(region)
        except Exception as e:  # noqa: BLE001 -- any failure of a capture means: run this shape eagerly
            self.failed.add(key)
            reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            print(f"graft: {_name(key)} could not be captured as a CUDA graph ({reason}); it runs eagerly",
                  file=sys.stderr)
            return region()
        self.seconds[key] = perf_counter() - started
        self.captured[key] = (replay, out)
        replay()  # a capture records and runs nothing: this call's results come from the first replay
        return out

    def trim(self) -> None:
        """Past ``limit`` keys, drop every graph (and what was counted of each key). Called by the owner where no
        region's outputs are still to be read by another (a step's start): a graph that reads another's outputs
        must be recorded after it, so the two must start counting again together."""
        if len(self.calls) + len(self.failed) > self.limit:
            self.forget()
            self.failed.clear()
            self.seconds.clear()

    def forget(self) -> None:
        """Drop every graph (the memory they recorded has moved: a cache that grew); warm-ups start again."""
        self.captured.clear()
        self.calls.clear()


def _name(key: Hashable) -> str:
    """A key as a line on stderr names it: its leading words (the region and its bucket)."""
    if isinstance(key, tuple):
        words = [str(part) for part in key[:2]]
        return " of ".join(words[:1] + [f"{words[1]} rows"] if len(words) > 1 else words)
    return str(key)
