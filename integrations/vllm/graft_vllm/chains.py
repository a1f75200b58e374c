"""graft's retrievers as a chain proposer for an engine that verifies one chain per request (vLLM).

Every request gets a :class:`Session`: its retrievers look the context up, their calibrated trees are merged into
one pool, and the pool's best path, cut where the estimate that the target accepts it falls below ``min_score``,
is the chain the engine verifies. What the engine accepted then feeds the retrievers (``observe``), exactly as
graft's own loop feeds them, so their calibration learns this model's habits within the request.

Which retrievers live how long is decided once, when the engine starts (:class:`Retrievers`): one that may be asked
about any context (``stateless``: Token Recycling's table) and graft's datastore lookups serve every request (a
datastore is opened, and its tokenizer checked, once; its calibration learns across requests), each told only the
outcome of its own last lookup; graft's response cache keeps one index across requests and gives each request a
view of it; every other retriever (the prompt-local cache, a third party's) is made per request, so no request
ever sees another's state.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, replace
from typing import Any, Callable, Hashable, Sequence

from graft_cli.core import Options, complete, discovery
from graft_cli.plugin import ROOT, Calibration, GraftError, Retriever, RetrieverEnv, Step, Tree
from graft_vllm.shared import SharedResponses, shareable
from graft_vllm.settings import Settings


@dataclass
class Counts:
    """What the proposer sent and what the engine accepted of it, over every request."""

    drafts: int = 0  # chains sent (non-empty)
    drafted: int = 0  # their tokens
    accepted: int = 0  # of those, accepted by the target

    @property
    def per_draft(self) -> float:
        return self.accepted / self.drafts if self.drafts else 0.0


class Retrievers:
    """The retrievers an engine drafts from, built once from the settings (so a typo fails at start-up), then
    handed out per request: shared, a view of a shared index, or made anew."""

    def __init__(self, settings: Settings, vocab_size: int, tokenizer: Any) -> None:
        options = Options(settings.options)
        self.env = RetrieverEnv(vocab_size=vocab_size, device="cpu", tokenizer=tokenizer, options=options)
        self.shared: list[Retriever] = []
        self.responses: list[SharedResponses] = []
        self.fresh: list[str] = []  # made per request
        # each retriever's factory, found once: finding one scans every installed distribution's entry points
        # (milliseconds in a vLLM environment), which a new request must not pay
        self.factories: dict[str, Callable[[RetrieverEnv], Any]] = {}
        self.looked_up: dict[int, Session] = {}  # a shared retriever (by id) -> the session of its last lookup
        for name in settings.retrievers:
            retriever = self._make(name)
            if SharedResponses.holds(retriever):
                self.responses.append(SharedResponses(retriever))
            elif retriever.stateless or shareable(retriever):  # its lookups read nothing of a request
                self.shared.append(retriever)
            else:
                self.fresh.append(name)
        unread = options.unread()
        if unread:
            raise GraftError(f"graft-vllm: no retriever reads the option {unread[0]!r} "
                             f"(retrievers: {', '.join(settings.retrievers)})")

    def _make(self, name: str) -> Retriever:
        env = replace(self.env, name=name)
        factory = self.factories.get(name)
        if factory is None:  # at start-up, where an unknown, broken or refused retriever is one GraftError line
            retriever = discovery.build(name, env)
            self.factories[name] = discovery.load_factory(name)
        else:
            retriever = factory(env)
        return complete(retriever)

    def for_request(self) -> list[Retriever]:
        return [*self.shared, *(r.view() for r in self.responses), *(self._make(name) for name in self.fresh)]

    def told(self, retriever: Retriever, session: Session) -> bool:
        """Whether ``session`` may tell ``retriever`` what its step accepted: always for its own retrievers; for
        a shared one only when the last lookup it made was this session's (the one it would judge)."""
        return all(retriever is not r for r in self.shared) or self.looked_up.get(id(retriever)) is session

    def looking_up(self, retriever: Retriever, session: Session) -> None:
        self.looked_up[id(retriever)] = session

    def close(self) -> None:
        for retriever in self.shared:
            retriever.close()


class Session:
    """One request: its retrievers, its context, and the chain last sent."""

    def __init__(self, owner: Retrievers, prompt: Sequence[int], appended: Sequence[int],
                 settings: Settings, warn: Callable[[Retriever, str, Exception], None]) -> None:
        self.owner, self.retrievers, self.settings, self.warn = owner, owner.for_request(), settings, warn
        self.tokens = [*map(int, prompt), *map(int, appended)]
        self.calibration = Calibration()  # for the retrievers that leave calibration to the proposer
        self.pool, self.path = Tree(), []  # the merged lookup and the chain sent from it (node indices)
        prefill = Step(list(self.tokens), [int(t) for t in appended], Tree(), list(range(len(prompt))))
        for retriever in self.retrievers:
            if owner.told(retriever, self):  # a shared one starts nothing per request
                self._safely(retriever, "start", lambda r=retriever: r.start(list(prompt)))
                self._safely(retriever, "observe", lambda r=retriever: r.observe(prefill))

    def feed(self, appended: Sequence[int]) -> int:
        """The tokens the engine appended since the last chain (its accepted prefix, then the target's own
        token); returns how many of the chain's tokens were accepted."""
        appended = [int(t) for t in appended]
        chain = [self.pool.nodes[i].token for i in self.path]
        accepted = 0
        while accepted < min(len(chain), len(appended) - 1) and chain[accepted] == appended[accepted]:
            accepted += 1
        self.tokens.extend(appended)
        verified = self.pool.subtree(self.path)
        step = Step(list(self.tokens), appended, verified, list(range(accepted + 1)))
        for retriever in self.retrievers:
            if self.owner.told(retriever, self):
                self._safely(retriever, "observe", lambda r=retriever: r.observe(step))
        self.calibration.observe(self.pool, self.pool.follow(appended), horizon=len(appended))
        return accepted

    def draft(self, limit: int, min_expected: float) -> list[int]:
        """At most ``limit`` tokens: the merged pool's best path while its estimate stays at ``min_score``; none
        when the tokens it is expected to add (the sum of its estimates) fall short of ``min_expected``."""
        pool = Tree()
        for retriever in self.retrievers:
            found = self._retrieve(retriever)
            pool.merge(found if retriever.calibrated else self.calibration.apply(found))
        path, parent = [], ROOT
        while len(path) < limit and (kids := pool.children(parent)):
            parent = max(kids, key=lambda i: pool.nodes[i].score)
            if pool.nodes[parent].score < self.settings.min_score:
                break
            path.append(parent)
        if sum(pool.nodes[i].score for i in path) < min_expected:  # not worth a verification
            path = []
        self.pool, self.path = pool, path
        return [pool.nodes[i].token for i in path]

    def _retrieve(self, retriever: Retriever) -> Tree:
        self.owner.looking_up(retriever, self)
        try:
            found = retriever.retrieve(self.tokens, self.settings.lookup)
            if not isinstance(found, Tree):
                raise TypeError(f"it returned {type(found).__name__}, not a Tree")
            return found
        except Exception as e:  # a retriever's bug costs its proposals, never the engine's request
            self.warn(retriever, "retrieve", e)
            return Tree()

    def _safely(self, retriever: Retriever, what: str, call: Callable[[], None]) -> None:
        try:
            call()
        except Exception as e:
            self.warn(retriever, what, e)

    def close(self) -> None:
        """The request ended: a response cache's view commits the response; the retrievers made for it go."""
        for retriever in self.retrievers:
            if SharedResponses.holds(retriever):
                self._safely(retriever, "close", retriever.close)


class ChainProposer:
    """Sessions by request key, and what they sent and had accepted (``counts``)."""

    def __init__(self, settings: Settings, vocab_size: int, tokenizer: Any, limit: int, max_len: int) -> None:
        self.settings, self.limit, self.max_len = settings, limit, max_len  # chain tokens, tokens a request may hold
        self.retrievers = Retrievers(settings, vocab_size, tokenizer)
        self.sessions: dict[Hashable, Session] = {}
        self.counts = Counts()
        self.failed: set[str] = set()
        self.min_expected = settings.min_expected  # the bar of the step being proposed for (:meth:`batch`)

    def batch(self, rows: int) -> None:
        """The next chains are for a step of ``rows`` requests: one alone gets ``min_expected``'s bar, several
        ``min_expected_batched``'s (settings.py says why)."""
        self.min_expected = self.settings.min_expected if rows <= 1 else self.settings.min_expected_batched

    def start(self, key: Hashable, prompt: Sequence[int], appended: Sequence[int]) -> list[int]:
        """A new request (its prompt and the first tokens generated): its first chain."""
        self.finish(key)
        self.sessions[key] = Session(self.retrievers, prompt, appended, self.settings, self._warn)
        return self._draft(key)

    def step(self, key: Hashable, appended: Sequence[int]) -> list[int]:
        """The tokens appended to request ``key`` since its last chain; its next chain."""
        self.counts.accepted += self.sessions[key].feed(appended)
        return self._draft(key)

    def _draft(self, key: Hashable) -> list[int]:
        """At most ``limit`` tokens, and never past the request's longest length."""
        session = self.sessions[key]
        chain = session.draft(max(0, min(self.limit, self.max_len - len(session.tokens))), self.min_expected)
        if chain:
            self.counts.drafts += 1
            self.counts.drafted += len(chain)
        return chain

    def __contains__(self, key: Hashable) -> bool:
        return key in self.sessions

    def finish(self, key: Hashable) -> None:
        session = self.sessions.pop(key, None)
        if session is not None:
            session.close()

    def close(self) -> None:
        for key in list(self.sessions):
            self.finish(key)
        self.retrievers.close()

    def _warn(self, retriever: Retriever, what: str, error: Exception) -> None:
        """Once per retriever, on stderr: its results are dropped while it keeps failing."""
        if retriever.name not in self.failed:
            self.failed.add(retriever.name)
            print(f"graft-vllm: retriever {retriever.name} failed in {what}() ({type(error).__name__}: {error}); "
                  "its results are dropped", file=sys.stderr)
