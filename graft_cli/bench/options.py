"""What one ``graft bench`` is asked to do: its options as the command line parsed them (graft_cli/cli/bench.py),
kept apart from the run so that every phase of it reads the same settings."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

from graft_cli.bench.plan import MethodSpec, Variant, method_config
from graft_cli.method.config import MethodConfig


class Shard(NamedTuple):
    """``--shard K/N``: questions K, K+N, K+2N, ... (from 0), so that N processes run one benchmark side by side."""

    k: int
    n: int

    def __str__(self) -> str:
        return f"{self.k}/{self.n}"

    @property
    def tag(self) -> str:
        """What the shard's files are called by: ``runs.K-of-N.jsonl``, ``results.K-of-N.json``."""
        return f"{self.k}-of-{self.n}"


@dataclass
class BenchOptions:
    model: str
    draft: str | None = None
    dataset: str = "spec-bench"
    categories: list[str] | None = None
    limit: int | None = None
    max_new_tokens: int = 128
    methods: list[str] = field(default_factory=lambda: ["all"])
    budgets: list[Any] = field(default_factory=list)  # ints and/or "auto"; empty: the device default
    options: dict[str, str] = field(default_factory=dict)  # retriever options (datastore=...)
    method_opts: dict[str, str] = field(default_factory=dict)  # other MethodConfig fields, e.g. depth=4, chain=true
    variants: dict[str, Variant] = field(default_factory=dict)  # named methods with settings of their own
    device: str = "auto"
    dtype: str = "auto"
    out: Path = Path("bench-results")
    resume: bool = False
    report_only: bool = False  # write the outputs from OUT/runs*.jsonl, run nothing
    shard: Shard | None = None  # questions K, K+N, ... only; records to OUT/runs.K-of-N.jsonl
    warmup: bool = True
    plots: bool = True
    command: str = ""
    device_map: str | dict | None = None  # accelerate's placement of a model larger than one GPU (--device-map)
    truncate: str | None = None  # left or right: cut prompts that would reach past the model's limits
    repeats: int = 1  # passes over the questions from freshly built methods; each turn from its fastest pass
    graphs: str = "auto"  # the fixed-shape path, captured as CUDA graphs (--graphs: auto, on, off, compiled)
    forward: str = "auto"  # whose modules run the target (--forward: auto, own, transformers), as generate's

    def __post_init__(self) -> None:
        if self.shard is not None:  # a plain (K, N) from a caller of the library reads as well
            self.shard = Shard(*self.shard)

    def method_config(self, spec: MethodSpec) -> MethodConfig:
        """The MethodConfig of an engine column under these options (--draft as given: KIND:SPEC)."""
        return method_config(spec, self.options, self.draft, self.method_opts)
