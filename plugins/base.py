"""The retriever interface: the whole contract between the engine and a source of retrieved tokens.

A plugin is a factory ``make(env: RetrieverEnv) -> Retriever`` registered under the entry-point group
``graft.retrievers``. The engine calls ``start`` once per request, ``retrieve`` before every verification and
``observe`` after it. Retrievers return candidate continuations of the context as a :class:`Tree` whose node
scores estimate the probability that the target accepts each path: the engine ranks nodes from every source by
that score, so an honest estimate is what earns a retriever its share of the verification budget.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, Sequence, runtime_checkable

from graft_cli.tree import Tree

if TYPE_CHECKING:  # torch stays out of this module so that plugins without torch import it cheaply
    import torch


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


@dataclass
class Step:
    """What one target forward showed (the prefill, then each verification), for proposers that learn from it."""

    context: list[int]  # every token so far (prompt + generated); the last one is the next root
    accepted: list[int]  # tokens this step appended (the accepted path and the bonus token)
    tree: Tree  # the verified tree (empty for the prefill)
    kept: list[int]  # rows of the fed block that joined the context (prefill: every prompt position)
    logits: "torch.Tensor | None" = None  # target logits of the fed rows [T, V] (prefill: the last row only)
    hidden: "Sequence[torch.Tensor] | None" = None  # per-layer hidden states [T, H], when a proposer asks


@runtime_checkable
class Retriever(Protocol):
    """Everything the engine uses of a retriever. ``stateless``, ``calibrated`` and ``close`` may be left out by a plugin
    (:func:`complete` gives it :class:`RetrieverDefaults`'); the rest is the plugin's own."""

    name: str
    stateless: bool  # whether retrieve() may be asked about any context (a speculative one: Graft(TAIL))
    calibrated: bool  # whether its scores are already acceptance estimates it corrects itself (then not again)

    def start(self, prompt: Sequence[int]) -> None:
        """A new request begins with these prompt tokens."""

    def retrieve(self, context: Sequence[int], budget: int) -> Tree:
        """At most ``budget`` scored candidate nodes continuing ``context`` (its last token is the root)."""

    def observe(self, step: Step) -> None:
        """Learn from a verification (accepted tokens, and optionally the target's logits)."""

    def close(self) -> None:
        """End of the session: save what is kept across runs (on disk)."""


class RetrieverDefaults:
    """The members a retriever may leave out, as a base class to inherit from."""

    stateless = False  # lookups read the real context's state: not safe on a speculative one
    calibrated = False  # the proposer corrects its scores by how often its nodes were accepted

    def close(self) -> None:
        """Nothing to save."""


class _Completed(RetrieverDefaults):
    """A plugin retriever that leaves out optional members, seen through the whole :class:`Retriever`."""

    def __init__(self, inner: Any) -> None:
        self.inner, self.name = inner, inner.name
        self.stateless = bool(getattr(inner, "stateless", False))
        self.calibrated = bool(getattr(inner, "calibrated", False))
        self._close = getattr(inner, "close", None)

    def start(self, prompt: Sequence[int]) -> None:
        self.inner.start(prompt)

    def retrieve(self, context: Sequence[int], budget: int) -> Tree:
        return self.inner.retrieve(context, budget)

    def observe(self, step: Step) -> None:
        self.inner.observe(step)

    def close(self) -> None:
        if callable(self._close):
            self._close()


def complete(retriever: Any) -> Retriever:
    """``retriever`` with every member of :class:`Retriever`: itself when it has them, else wrapped with the
    defaults for what it leaves out. Checked once, when a proposer takes it, so that the engine never probes."""
    if all(hasattr(retriever, member) for member in ("stateless", "calibrated", "close")):
        return retriever
    return _Completed(retriever)
