"""The three roles of graft, and everything the engine asks of each.

* A :class:`Proposer` grows the candidate tree the target verifies next (every method is one).
* A :class:`Drafter` grows a tree from a model of its own (a draft model, an EAGLE-3 head): a plugin factory
  ``make(env: DrafterEnv) -> Drafter`` registered under the entry-point group ``graft.drafters``.
* A :class:`Retriever` proposes continuations looked up elsewhere (the prompt, a datastore, the target's own past
  predictions): a plugin factory ``make(env: RetrieverEnv) -> Retriever`` registered under ``graft.retrievers``.

Trees carry node scores that estimate the probability that the target accepts each path: the proposer ranks nodes
from every source by that score, so an honest estimate is what earns a source its share of the verification budget.
"""

from __future__ import annotations

from typing import Any, Protocol, Sequence, runtime_checkable

from graft_cli.core.stats import Stats
from graft_cli.core.step import Step
from graft_cli.core.tree import Tree


class Proposer(Protocol):
    """Grows the candidate tree for the next verification (drafters and retrievers hide behind one of these)."""

    wants_hidden: bool  # whether observe() needs the target's hidden states (EAGLE heads do)

    def start(self, prompt: Sequence[int], prefill: Step, capacity: int) -> None:
        """A new request of up to ``capacity`` positions (what the target's cache reserved)."""

    def propose(self, context: Sequence[int], stats: Stats) -> Tree:
        """The tree to verify after ``context`` (its last token is the root)."""

    def observe(self, step: Step) -> None:
        """Learn from the verification of the last proposed tree."""

    def close(self) -> None:
        """End of the session (after its last request): parts that keep state on disk save it."""


class Drafter(Protocol):
    """Grows a draft tree from the context with a model of its own: everything the proposer uses of it
    (graft_cli.drafting.TreeDrafter implements it all; a plugin subclasses it or writes its own)."""

    wants_hidden: bool  # whether observe() needs the target's hidden states (EAGLE heads do)
    # optional ``feature_layers: tuple[int, ...]``: the layers it reads of them; the fixed-shape path then hands
    # observe() those layers of the accepted rows, gathered on the device (``Step.features``); optional
    # ``draft_ahead(outcome, context, budget, objective)`` and ``drafts_ahead(objective)``: the next draft queued
    # before a step's read, read with it and handed to observe() as ``Step.ahead`` (with ``landed``, ``ahead_of``
    # and ``ahead_s``: TreeDrafter has them all)
    levels: int  # tree levels the last draft grew (the trace records them)
    forward_rows: list[int]  # rows fed by each forward of the last draft (the objective measures their cost)
    catch_up_s: float  # seconds the last draft spent first reading the request's prompt (a cost of joining)

    def start(self, prompt: Sequence[int], prefill: Step, capacity: int) -> None:
        """A new request that may reach ``capacity`` positions (prompt, new tokens and a tree): a drafter with a
        cache reserves it now, so the request never reallocates."""

    def draft(self, context: Sequence[int], budget: int, stats: Stats, chain: Sequence[int] = (),
              objective: Any = None) -> Tree:
        """At most ``budget`` nodes, in a new Tree the caller may change (it grafts into it). With ``objective``
        (graft_cli.drafting.Objective): ``chain`` (retrieved tokens) is checked in the first forward, and the
        objective decides the depth and the nodes kept; without: the fixed depth and pruning."""

    def unread(self, context: Sequence[int]) -> int:
        """Context tokens the next draft must read first: what joining the request costs a drafter that reads
        its prompt lazily (0 for one that read it at ``start``)."""

    def observe(self, step: Step) -> None:
        """Learn from a verification: keep the accepted rows of the drafter's own cache, drop the rest."""

    def close(self) -> None:
        """End of the session: free or save what the drafter keeps."""


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
