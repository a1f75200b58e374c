"""What a plugin factory is given: the environment a retriever or a drafter builds itself from, and the drafting
settings, one object from the command line to the drafter."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

from graft_cli.core.prune import PruneSchedule


class Options(dict):
    """Retriever options (strings by key) that remember which keys were looked up: after the retrievers are built,
    an option none of them read is a typo or a flag for another method, and is reported instead of ignored."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.read: set[str] = set()

    def get(self, key: str, default: Any = None) -> Any:
        self.read.add(key)
        return super().get(key, default)

    def __getitem__(self, key: str) -> Any:
        self.read.add(key)
        return super().__getitem__(key)

    def __contains__(self, key: object) -> bool:
        self.read.add(str(key))
        return super().__contains__(key)

    def peek(self, key: str) -> Any:
        """The value without counting as read (graft's own checks, not a retriever's use)."""
        return super().get(key)

    def unread(self) -> list[str]:
        """The options given that nothing looked up, in the order given."""
        return [key for key in self if key not in self.read]


@dataclass
class RetrieverEnv:
    """What a retriever may need to build itself."""

    vocab_size: int
    device: str = "cpu"
    tokenizer: Any = None  # the target's Hugging Face tokenizer
    options: dict[str, str] = field(default_factory=dict)  # e.g. {"datastore": "path"} from the command line
    name: str = ""  # what the retriever is installed as (its entry point): the prefix of its own options


@dataclass(frozen=True)
class DraftSettings:
    """How a drafter grows its tree. ``None`` means the device's default (graft_cli/defaults.py); the method
    configuration fills every default in before a drafter sees them."""

    depth: int | None = None  # tree levels at most
    draft_top_k: int | None = None  # nodes expanded per level, and children per expanded node
    prune_at: str | None = None  # pruning checkpoints "LEVEL:THRESHOLD[:SHARE],...[,floor:X]"
    chain: bool = False  # draft one path (with graft: Graft(TAIL))
    rope_theta: float | None = None  # EAGLE-3 heads: the RoPE base the head was trained with
    draft_vocab: int | None = None  # draft models: score N ranked ids + special + the prompt's (0: all)
    draft_window: int | None = None  # draft models: prompt tokens read at most (0: all)
    draft_weights: str | None = None  # draft models: "fp16" (linears over half weights, CPU) or "full"
    draft_ahead: bool | None = None  # draft models, fixed shapes: draft before the step's read (default: after it)


class LoadedModel(Protocol):
    """A loaded target as a drafter sees it (graft_cli.runtime.loading.Loaded)."""

    model: Any  # the transformers model
    tokenizer: Any

    @property
    def device(self) -> str: ...


@dataclass(frozen=True)
class Shapes:
    """The target runs at fixed shapes (``--graphs``), and so should a drafter's levels: ``capture`` records each
    shape once (CUDA graphs, into a memory pool of the drafter's own; compiled first where it is a ``Compiling``,
    graft_cli/runtime/compiled.py), None runs them eagerly (a CPU)."""

    capture: Any = None


@dataclass(frozen=True)
class DrafterEnv:
    """What a drafter factory gets: the loaded target, its ``--draft`` spec and the drafting settings with the
    device's defaults filled in; ``prune`` is the parsed pruning schedule, None when the method does not prune;
    ``shapes``: the target's fixed-shape path, None on the eager one."""

    target: LoadedModel
    spec: str  # --draft after "KIND:" (the whole value for a bare model name)
    settings: DraftSettings
    prune: PruneSchedule | None = None
    shapes: Shapes | None = None
