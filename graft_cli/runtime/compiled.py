"""Compiled regions: the fixed-shape path's verification, acceptance and draft levels fused by ``torch.compile``
(inductor), inside the captured graphs (``--graphs compiled``).

Why a compiler: a captured graph removes the host from a step, but replays the eager kernels as they were
recorded -- transformers' layers launch a kernel per norm, rotary, residual and mask operation, and a head's level
about one per operation. Inductor fuses those element-wise chains into a few kernels (Triton on a GPU, C++ on a
CPU) and leaves the matrix products to the vendor's libraries; a graph captured over the compiled region replays
the fused kernels.

What compiles: each region :class:`~graft_cli.runtime.graphs.Graphs` runs under a key -- a bucket's verification,
its acceptance, a drafter's level and catch-up -- whole (``fullgraph``: a break would be a host decision inside a
graph) and at static shapes (``dynamic=False``: a bucket is one shape), once per key, during the key's warm-up
calls (so a CUDA graph records compiled kernels, never a compilation). Regions run under no key (a tree past the
largest bucket) stay eager. Dynamo keys its compilations by the guards it finds, which are the same things a
graph's key holds, so a key compiles once and a request's later steps, and later requests, reuse it.

A compilation that fails (an operation dynamo cannot trace, the C++ compiler missing, Triton failing) turns
compiling off for the whole target and its drafter -- they share one :class:`Compiler` -- with ONE line on
stderr: the region then runs as it does without compiling, captured or eager.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any, Callable

import torch

Region = Callable[[], Any]
COMPILES = 1024  # compilations dynamo keeps per function: above every key a Graphs holds (graphs.LIMIT)


class Compiler:
    """Compiles regions with ``backend`` (inductor, or a test's); ``broken``: why compiling was turned off."""

    def __init__(self, backend: str | Callable = "inductor") -> None:
        import torch._dynamo  # lazy: a second of imports that only a compiling target needs

        self.backend = backend
        self.broken: str | None = None
        # dynamo stops compiling a function after 8 guard sets and runs it eagerly, silently: a target has a
        # verification per bucket and key count, so the limit is raised to the keys a Graphs may hold
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, COMPILES)
        torch._dynamo.config.accumulated_recompile_limit = max(torch._dynamo.config.accumulated_recompile_limit,
                                                               COMPILES)

    def __call__(self, region: Region) -> Region:
        """``region`` compiled, falling back to itself (for good, with one line) if compiling fails."""
        if self.broken is not None:
            return region
        compiled = torch.compile(region, backend=self.backend, fullgraph=True, dynamic=False)

        def run() -> Any:
            if self.broken is not None:
                return region()
            try:
                return compiled()
            except torch._dynamo.exc.TorchDynamoException as e:  # tracing or code generation (imported by __init__)
                self.fail(e)
                return region()
        return run

    def fail(self, error: Exception) -> None:
        """Compiling off for good, said once on stderr."""
        text = str(error).strip()
        self.broken = text.splitlines()[0] if text else type(error).__name__
        print(f"graft: the fixed-shape path could not be compiled ({self.broken}); it runs uncompiled",
              file=sys.stderr)


@dataclass(frozen=True)
class Compiling:
    """A capture whose regions are compiled first: ``inner`` records them (CUDA graphs), None runs them (a CPU)."""

    inner: Any
    compiler: Compiler
