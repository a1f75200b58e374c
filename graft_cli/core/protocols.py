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

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Protocol, Sequence, runtime_checkable

from graft_cli.core.step import Outcome, Step
from graft_cli.core.timing import Recorder
from graft_cli.core.tree import Tree

if TYPE_CHECKING:
    import torch

# queued on the device before a step's result is read (the next draft); what it returns is read with the step and
# handed back as ``Step.queued`` (None: nothing to read)
Queue = Callable[[Outcome], "torch.Tensor | None"]


@dataclass(frozen=True)
class Needs:
    """What a proposer (or a drafter) needs from every step, declared once: the loop reads a proposer's at the
    start of each request and the target hands over exactly that, so nothing is asked of a role by probing it."""

    hidden: bool = False  # the target's hidden states of the verified rows
    layers: tuple[int, ...] = ()  # ... only these layers' (the fixed-shape path gathers them on the device)
    successors: int = 0  # the target's top-k next tokens at every verified row (Token Recycling's), 0: none
    queue: Queue | None = None  # queued before each step's read, on the fixed-shape path (the next draft)


class Proposer(Protocol):
    """Grows the candidate tree for the next verification (drafters and retrievers hide behind one of these)."""

    recorder: Recorder  # its clock, and where it and its drafter count and time their work (the loop too)
    drafter: Drafter | None  # its drafter, whose own cache a prefix cache keeps beside the target's (None: none)

    @property
    def needs(self) -> Needs:
        """What it needs from each step (read at the start of every request)."""

    def start(self, prompt: Sequence[int], prefill: Step, capacity: int) -> None:
        """A new request of up to ``capacity`` positions (what the target's cache reserved)."""

    def propose(self, context: Sequence[int]) -> Tree:
        """The tree to verify after ``context`` (its last token is the root)."""

    def observe(self, step: Step) -> None:
        """Learn from the verification of the last proposed tree."""

    def price(self, scores: Sequence[float]) -> int:
        """How many of ``scores`` (candidate nodes' acceptance estimates, best first: a whole tree's, once a
        constraint added the tokens it forces) pay for their verification rows under its cost model."""

    def close(self) -> None:
        """End of the session (after its last request): parts that keep state on disk save it."""


class Drafter(Protocol):
    """Grows a draft tree from the context with a model of its own: everything a proposer uses of it, all
    declared (graft_cli.drafting.TreeDrafter implements it all; a plugin subclasses it or writes its own)."""

    needs: Needs  # the target's states it reads (``hidden``, ``layers``)
    recorder: Recorder  # its clock and counters: the proposer that takes it hands it its own
    levels: int  # tree levels the last draft grew (the trace records them)
    forward_rows: list[int]  # rows fed by each forward of the last draft (the objective measures their cost)
    catch_up_s: float  # seconds the last draft spent first reading the request's prompt (a cost of joining)
    # drafting before a step's read (the fixed-shape path): where the last queue() fed ("start": a prefill's,
    # "step": a verification's, None: nothing queued), whether its draft came back with the read, and the seconds
    # queueing and reading it took
    queued_at: str | None
    landed: bool
    queue_s: float

    def start(self, prompt: Sequence[int], prefill: Step, capacity: int) -> None:
        """A new request that may reach ``capacity`` positions (prompt, new tokens and a tree): a drafter with a
        cache reserves it now, so the request never reallocates."""

    def draft(self, context: Sequence[int], budget: int, chain: Sequence[int] = (), objective: Any = None) -> Tree:
        """At most ``budget`` nodes, in a new Tree the caller may change (it grafts into it). With ``objective``
        (graft_cli.drafting.Objective): ``chain`` (retrieved tokens) is checked in the first forward, and the
        objective decides the depth and the nodes kept; without: the fixed depth and pruning. A draft queued
        before the last read (``landed``) is handed over instead."""

    def queues(self, objective: Any) -> bool:
        """Whether :meth:`queue` drafts for ``objective`` (fixed-shape levels and a planned objective)."""

    def queue(self, outcome: Outcome, context: Sequence[int], budget: int, objective: Any) -> "torch.Tensor | None":
        """Feed a step's unread ``outcome`` and, with a ``budget``, queue the next draft before the step's read;
        what to read with the step (None: nothing), handed back to :meth:`observe` as ``Step.queued``."""

    def unread(self, context: Sequence[int]) -> int:
        """Context tokens the next draft must read first: what joining the request costs a drafter that reads
        its prompt lazily (0 for one that read it at ``start``)."""

    def observe(self, step: Step) -> None:
        """Learn from a verification: keep the accepted rows of the drafter's own cache, drop the rest."""

    # what a prefix cache keeps of the drafter across requests (graft_cli/runtime/prefix_cache.py): its row r
    # depends on the context's tokens up to r + ``lag`` (an EAGLE-3 head's pair reads the token after its own)
    lag: int

    def state(self, context: Sequence[int]) -> tuple[Any, int] | None:
        """Its own KV cache (a ``PositionCache``) and how many leading rows of ``context`` it holds now; None: it
        keeps nothing a prefix cache could reuse."""

    def resume(self, rows: int) -> None:
        """The next request's first ``rows`` rows are in its cache already (a prefix cache wrote them): its next
        ``start`` reads only what follows. Told before every request while a prefix cache is on (0: nothing)."""

    def close(self) -> None:
        """End of the session: free or save what the drafter keeps."""


class DrafterDefaults:
    """A drafter's declarations for one that needs nothing of the target, never drafts before a read and runs no
    model of its own: a base class for a small plugin, which then writes ``draft`` (graft_cli.drafting's
    TreeDrafter is the base for a drafter with a model)."""

    needs = Needs()
    levels = 0
    forward_rows: Sequence[int] = ()
    catch_up_s = 0.0
    queued_at: str | None = None
    landed = False
    queue_s = 0.0

    def __init__(self) -> None:
        self.recorder = Recorder()  # its proposer hands it its own

    def start(self, prompt: Sequence[int], prefill: Step, capacity: int) -> None:
        """Nothing to reserve."""

    def queues(self, objective: Any) -> bool:
        return False

    def queue(self, outcome: Outcome, context: Sequence[int], budget: int, objective: Any) -> None:
        return None

    def unread(self, context: Sequence[int]) -> int:
        return 0

    def observe(self, step: Step) -> None:
        """Nothing learnt."""

    lag = 0

    def state(self, context: Sequence[int]) -> tuple[Any, int] | None:
        return None  # no cache of its own

    def resume(self, rows: int) -> None:
        """Nothing held."""

    def close(self) -> None:
        """Nothing to free."""


@runtime_checkable
class Retriever(Protocol):
    """Everything the engine uses of a retriever. ``stateless``, ``calibrated``, ``successors`` and ``close`` may be
    left out by a plugin (:func:`complete` gives it :class:`RetrieverDefaults`'); the rest is the plugin's own."""

    name: str
    stateless: bool  # whether retrieve() may be asked about any context (a speculative one: Graft(TAIL))
    calibrated: bool  # whether its scores are already acceptance estimates it corrects itself (then not again)
    successors: int  # the target's top-k it learns from at every verified row (Step.successors), 0: none

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
    successors = 0  # no top-k of the target's is read for it

    def close(self) -> None:
        """Nothing to save."""


OPTIONAL = {"stateless": False, "calibrated": False, "successors": 0}  # a retriever's declarations, defaulted


class _Completed(RetrieverDefaults):
    """A plugin retriever written to the minimal protocol, seen through the whole :class:`Retriever`: its optional
    declarations read once, here, where a third-party plugin enters graft, and the defaults for the rest."""

    def __init__(self, inner: Any) -> None:
        self.inner, self.name = inner, inner.name
        declared = {name: value for cls in reversed(type(inner).__mro__) for name, value in vars(cls).items()}
        declared.update(inner.__dict__ if hasattr(inner, "__dict__") else {})
        self.stateless, self.calibrated, self.successors = (type(default)(declared.get(member, default))
                                                            for member, default in OPTIONAL.items())
        self._close = declared.get("close")

    def start(self, prompt: Sequence[int]) -> None:
        self.inner.start(prompt)

    def retrieve(self, context: Sequence[int], budget: int) -> Tree:
        return self.inner.retrieve(context, budget)

    def observe(self, step: Step) -> None:
        self.inner.observe(step)

    def close(self) -> None:
        if self._close is not None:
            self.inner.close()


def complete(retriever: Any) -> Retriever:
    """``retriever`` with every member of :class:`Retriever`: itself when it inherits the defaults (it declares
    everything), else wrapped with them. Done once, when a proposer takes it, so that nothing asks later."""
    return retriever if isinstance(retriever, RetrieverDefaults) else _Completed(retriever)
