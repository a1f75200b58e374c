"""Prune-then-graft: the draft tree keeps only what the drafter is confident about, and the verification slots
that frees are filled with retrieved nodes. Every method is this proposer with some parts left out: no drafter
and no retrievers is plain decoding, retrievers alone are PLD/REST/Token Recycling, a drafter alone is EAGLE."""

from __future__ import annotations

import sys
from collections import Counter
from dataclasses import dataclass
from time import perf_counter
from typing import Callable, Protocol, Sequence

import numpy as np

from graft_cli.budget import Calibration, LatencyModel
from graft_cli.objective import Objective
from graft_cli.stats import Stats
from graft_cli.target import ROOM
from graft_cli.tree import ROOT, Tree
from plugins.base import Retriever, Step, complete


CHECK_FLOOR = 0.1  # a retrieved token less likely than this is not worth a row of the draft's first forward
CHECK_MAX = 16  # retrieved tokens checked per step at most


@dataclass
class _Pending:
    """What the step proposed so far cost, until observe() learns what it bought."""

    bucket: int
    drafted: bool
    draft_s: float
    draft_rows: list[int]
    line_probs: list[float]  # the drafter's own probabilities along its best path ...
    line: list[int]  # ... and that path's nodes (the tree's first nodes are the draft's)
    proposed_at: float  # perf_counter() when the tree left for verification


def _best_path(tree: Tree) -> list[int]:
    """From the root, the best-scored child at every level: the path a tree's depth is chosen for."""
    path, parent = [], ROOT
    while kids := tree.children(parent):
        parent = max(kids, key=lambda i: tree.nodes[i].score)
        path.append(parent)
    return path


class Drafter(Protocol):
    """Grows a draft tree from the context (and prunes it itself when given a pruner): everything the proposer
    uses of it (``TreeDrafter`` implements it all)."""

    wants_hidden: bool  # whether observe() needs the target's hidden states (EAGLE heads do)
    levels: int  # tree levels the last draft grew (the trace records them)
    forward_rows: list[int]  # rows fed by each forward of the last draft (the objective measures their cost)
    catch_up_s: float  # seconds the last draft spent first reading the request's prompt (a cost of joining)

    def start(self, prompt: Sequence[int], prefill: Step, capacity: int) -> None:
        """A new request that may reach ``capacity`` positions (prompt, new tokens and a tree): a drafter with a
        cache reserves it now, so the request never reallocates."""

    def draft(self, context: Sequence[int], budget: int, stats: Stats, chain: Sequence[int] = (),
              objective: Objective | None = None) -> Tree:
        """At most ``budget`` nodes, in a new Tree the caller may change (it grafts into it). With ``objective``:
        ``chain`` (retrieved tokens) is checked in the first forward, and the objective decides the depth and
        the nodes kept; without: the fixed depth and pruning."""

    def unread(self, context: Sequence[int]) -> int:
        """Context tokens the next draft must read first: what joining the request costs a drafter that reads
        its prompt lazily (0 for one that read it at ``start``)."""

    def observe(self, step: Step) -> None: ...

    def close(self) -> None:
        """End of the session: free or save what the drafter keeps."""


class GraftProposer:
    """``budget`` verified nodes per step: the drafter's (pruned) tree first, then the freed slots
    ``budget - K_draft`` filled with retrieved nodes that share the root, best calibrated estimate first.

    A retrieved path that begins like a draft path continues under that draft node (shared nodes cost no slot).
    With ``tail=True`` (Graft(TAIL) over a chain drafter) retrievers that can look up any context
    (``stateless = True``) also continue the drafted chain from its last token.

    ``trace`` holds one record per step of the current request: draft nodes kept, retrieved nodes grafted, the
    draft levels grown, and (after verification) accepted tokens by source.
    """

    def __init__(
        self,
        budget: int,
        retrievers: Sequence[Retriever] = (),
        drafter: Drafter | None = None,
        latency: LatencyModel | None = None,
        tail: bool = False,
        objective: Objective | None = None,
    ) -> None:
        self.budget = budget
        self.retrievers = [complete(r) for r in retrievers]  # a plugin may leave out the optional members
        self.drafter = drafter
        self.latency = latency or LatencyModel.default("cpu")
        self.calibration = Calibration()
        self.wants_hidden = bool(drafter and drafter.wants_hidden)
        self.tail = tail
        self.trace: list[dict] = []
        self.failed: set[str] = set()  # retrievers that raised (warned about once)
        self.objective = objective  # with a drafter: the cost-aware tree builder (else fixed depth and pruning)
        self._step: _Pending | None = None
        self._prompt, self._end = 0, 0  # the request's prompt length, and the context length at its limit
        self._joined = False  # whether the drafter has drafted in this request (read its prompt)
        self._alone = (0, 0.0, 0)  # this request's steps before it: accepted tokens, verification cost, steps

    def start(self, prompt: Sequence[int], prefill: Step, capacity: int) -> None:
        self.trace = []
        self._prompt, self._end, self._joined, self._alone = len(prompt), capacity - ROOM, False, (0, 0.0, 0)
        if self.drafter:
            self.drafter.start(prompt, prefill, capacity)
        for retriever in self.retrievers:
            self._safely(retriever, "start", lambda: retriever.start(prompt))
            # the prefill is a target forward too (its last row: the root's)
            self._safely(retriever, "observe", lambda: retriever.observe(prefill))

    def propose(self, context: Sequence[int], stats: Stats) -> Tree:
        self.latency.context = len(context)  # what a node costs depends on the cache it is verified over
        if self.objective is not None and self.drafter is not None and self.budget > 0:
            return self._retrieve_then_draft(context, stats)
        tree = self.drafter.draft(context, self.budget, stats) if self.drafter and self.budget > 0 else Tree()
        drafted = len(tree)
        record = {"draft": drafted, "retrieved": 0, "levels": self.drafter.levels if self.drafter else 0}
        self.trace.append(record)
        room = self.budget - drafted
        if room <= 0 or not self.retrievers:
            return tree
        t0 = perf_counter()
        pool = self._retrieved(context, room)
        if self.tail and drafted:
            self._tail(pool, tree, context, room)
        if len(pool):
            tree = self._graft(tree, pool)
        record["retrieved"] = len(tree) - drafted
        stats.times["retrieve"] += perf_counter() - t0
        return tree

    def _retrieve_then_draft(self, context: Sequence[int], stats: Stats) -> Tree:
        """The cost-aware step (graft_cli/objective.py): retrieve first, then draft only when the measured
        rates say it pays, checking the retrieved chain in the drafter's first forward and growing levels only
        while each is worth its time; the retrieved nodes then fill what the draft left of the budget."""
        objective, drafter = self.objective, self.drafter
        t0 = perf_counter()
        pool = self._retrieved(context, self.budget)
        t1 = perf_counter()
        ranked = np.array(sorted((n.score for n in pool.nodes), reverse=True), dtype=np.float64)
        bucket = objective.bucket(ranked)
        tree, drafted = Tree(), objective.should_draft(bucket)
        if drafted and not self._joined:  # a drafter joins a request only when that pays for reading its prompt
            unread = drafter.unread(context)
            remaining = objective.expected_remaining(len(context) - self._prompt, self._end - len(context))
            drafted = self._joined = not unread or objective.should_join(self._alone, unread, remaining, ranked)
        line: list[int] = []
        line_probs: list[float] = []
        if drafted:
            tree = drafter.draft(context, self.budget, stats, self._chain(pool), objective)
            line = _best_path(tree)  # its best path is calibrated, to compete fairly with retrieved nodes
            line_probs = [tree.nodes[i].score for i in line]
            for i, p in zip(line, objective.calibrated(np.array(line_probs))):
                tree.nodes[i].score = float(p)
        t2 = perf_counter()
        if self.tail and len(tree):
            self._tail(pool, tree, context, self.budget)
        kept = len(tree)
        draft_s = t2 - t1 - (drafter.catch_up_s if drafted else 0.0)  # joining is not drafting
        rows = list(drafter.forward_rows) if drafted else []
        if len(pool):
            tree = self._graft(tree, pool, objective.spent(draft_s, rows), objective.going())
        stats.times["retrieve"] += t1 - t0 + perf_counter() - t2
        self.trace.append({"draft": kept, "retrieved": len(tree) - kept, "levels": drafter.levels if drafted else 0})
        self._step = _Pending(bucket, drafted, draft_s, rows, line_probs, line, perf_counter())
        return tree

    def _chain(self, pool: Tree) -> list[int]:
        """The retrieved path worth checking in the draft's first forward: its best path while that stays at
        least ``CHECK_FLOOR`` likely (a row the draft pays for that little is wasted), ``CHECK_MAX`` at most."""
        chain = []
        for i in _best_path(pool)[:CHECK_MAX]:
            if pool.nodes[i].score < CHECK_FLOOR:
                break
            chain.append(pool.nodes[i].token)
        return chain

    def _retrieved(self, context: Sequence[int], room: int) -> Tree:
        """Every retriever's lookup, calibrated, merged into one pool."""
        pool = Tree()
        for retriever in self.retrievers:
            found = self._calibrated(retriever, self._retrieve(retriever, context, room))
            if not len(pool) and not retriever.calibrated:  # the proposer's calibrated copy is ours: the pool
                pool = found
            else:
                pool.merge(found)
        return pool

    def _graft(self, tree: Tree, pool: Tree, overhead: float = 0.0, going: float | None = None) -> Tree:
        """Graft ``pool`` best-first into the free slots, then keep only as many of the new nodes as pay for
        their verification (expected tokens per second under the latency model, after ``overhead`` spent, or
        against the ``going`` rate when known: ``LatencyModel.best_count``)."""
        drafted, gain = len(tree), sum(n.score for n in tree.nodes)
        tree.graft(pool, self.budget)  # the drafter's tree is ours to change (Drafter.draft)
        new = tree.nodes[drafted:]  # added best-first, so every prefix of them is prefix-closed
        if new:
            tree.truncate(drafted + self.latency.best_count(drafted, gain, [n.score for n in new], overhead, going))
        return tree

    def _calibrated(self, retriever: Retriever, found: Tree) -> Tree:
        """One calibration layer per source: the proposer's (a copy), unless the retriever keeps its own (its
        tree as it is: the retriever remembers it, so it is merged, never changed)."""
        return found if retriever.calibrated else self.calibration.apply(found)

    def _retrieve(self, retriever: Retriever, context: Sequence[int], budget: int) -> Tree:
        """A retriever's lookup, or nothing when it fails (raises, or returns no Tree): a plugin never stops
        generation."""
        try:
            found = retriever.retrieve(context, budget)
            if not isinstance(found, Tree):
                raise TypeError(f"it returned {type(found).__name__}, not a Tree")
            return found
        except Exception as e:  # a third-party plugin's bug must not end the generation
            self._failed(retriever, "retrieve", e)
            return Tree()

    def _safely(self, retriever: Retriever, what: str, call: Callable[[], None]) -> None:
        try:
            call()
        except Exception as e:
            self._failed(retriever, what, e)

    def _failed(self, retriever: Retriever, what: str, error: Exception) -> None:
        """Warn once per retriever on stderr; its results are dropped while it keeps failing."""
        if retriever.name not in self.failed:
            self.failed.add(retriever.name)
            print(f"graft: retriever {retriever.name} failed in {what}() ({type(error).__name__}: {error}); "
                  "its results are dropped", file=sys.stderr)

    def _tail(self, pool: Tree, chain: Tree, context: Sequence[int], room: int) -> None:
        """Continue the drafted chain's deepest node with lookups from its last token (Graft(TAIL))."""
        path = max(chain.paths(), key=len)
        tokens = [chain.nodes[i].token for i in path]
        parent = ROOT
        for i in path:  # the chain itself, so the tail has somewhere to hang (merging costs no slot)
            parent = pool.add(parent, chain.nodes[i].token, chain.nodes[i].source, chain.nodes[i].score)
        base = chain.nodes[path[-1]].score
        for retriever in self.retrievers:
            if not retriever.stateless:
                continue
            sub = self._calibrated(retriever, self._retrieve(retriever, [*context, *tokens], room))
            mapping = {ROOT: parent}
            for j, node in enumerate(sub.nodes):
                mapping[j] = pool.add(mapping[node.parent], node.token, node.source, base * node.score, node.raw)

    def observe(self, step: Step) -> None:
        verified_at = perf_counter()
        if self.drafter:
            self.drafter.observe(step)
        for retriever in self.retrievers:
            self._safely(retriever, "observe", lambda: retriever.observe(step))
        accepted = [row - 1 for row in step.kept[1:]]
        self.calibration.observe(step.tree, accepted)
        if self._step is not None and self.objective is not None:
            done, self._step = self._step, None
            self.objective.measured(done.bucket, done.drafted, len(step.accepted), len(step.tree),
                                    verified_at - done.proposed_at, done.draft_s, done.draft_rows)
            if not self._joined:
                tokens, cost, steps = self._alone
                self._alone = (tokens + len(step.accepted), cost + self.objective.verify_cost(len(step.tree)), steps + 1)
            reached = 0  # how far along the draft's best path the target accepted
            while reached < min(len(done.line), len(accepted)) and done.line[reached] == accepted[reached]:
                reached += 1
            self.objective.observe_draft(done.line_probs, reached)
        if self.trace:
            self.trace[-1]["accepted"] = Counter(step.tree.nodes[i].source for i in accepted)

    def close(self) -> None:
        """End of the session: retrievers and drafters that keep state on disk save it."""
        if self.drafter:
            self.drafter.close()
        for retriever in self.retrievers:
            retriever.close()
