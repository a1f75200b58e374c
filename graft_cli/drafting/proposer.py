"""Prune-then-graft: the draft tree keeps only what the drafter is confident about, and the verification slots
that frees are filled with retrieved nodes. Every method is this proposer with some parts left out: no drafter
and no retrievers is plain decoding, retrievers alone are PLD/REST/Token Recycling, a drafter alone is EAGLE.
graft with a drafter chooses its tree by cost instead of a fixed depth (cost_aware.py)."""

from __future__ import annotations

import sys
from collections import Counter
from typing import Callable, Sequence

from graft_cli.core import complete, Calibration, Drafter, Needs, Recorder, Retriever, ROOT, Step, Tree
from graft_cli.drafting.budget import LatencyModel


def best_path(tree: Tree) -> list[int]:
    """From the root, the best-scored child at every level: the path a tree's depth is chosen for."""
    path, parent = [], ROOT
    while kids := tree.children(parent):
        parent = max(kids, key=lambda i: tree.nodes[i].score)
        path.append(parent)
    return path


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
        recorder: Recorder | None = None,
    ) -> None:
        self.budget = budget
        self.retrievers = [complete(r) for r in retrievers]  # a plugin may leave out the optional members
        self.drafter = drafter
        self.latency = latency or LatencyModel.default("cpu")
        self.recorder = recorder or Recorder()  # its clock, and where its retrieval seconds go ...
        if drafter is not None:
            drafter.recorder = self.recorder  # ... and its drafter's
        self.calibration = Calibration()
        self.tail = tail
        self.trace: list[dict] = []
        self.failed: set[str] = set()  # retrievers that raised (warned about once)

    @property
    def needs(self) -> Needs:
        """The drafter's states (its hidden layers), and the largest top-k a retriever learns from (read with the
        step where the target can: Token Recycling's)."""
        drafted = self.drafter.needs if self.drafter is not None else Needs()
        return Needs(drafted.hidden, drafted.layers, max((r.successors for r in self.retrievers), default=0))

    def start(self, prompt: Sequence[int], prefill: Step, capacity: int) -> None:
        self.trace = []
        if self.drafter:
            self.drafter.start(prompt, prefill, capacity)
        for retriever in self.retrievers:
            self._safely(retriever, "start", lambda: retriever.start(prompt))
            # the prefill is a target forward too (its last row: the root's)
            self._safely(retriever, "observe", lambda: retriever.observe(prefill))

    def propose(self, context: Sequence[int]) -> Tree:
        self.latency.context = len(context)  # what a node costs depends on the cache it is verified over
        tree = self.drafter.draft(context, self.budget) if self.drafter and self.budget > 0 else Tree()
        drafted = len(tree)
        record = {"draft": drafted, "retrieved": 0, "levels": self.drafter.levels if self.drafter else 0}
        self.trace.append(record)
        room = self.budget - drafted
        if room <= 0 or not self.retrievers:
            return tree
        with self.recorder.timed("retrieve"):
            pool = self._retrieved(context, room)
            if self.tail and drafted:
                self._tail(pool, tree, context, room)
            if len(pool):
                tree = self._graft(tree, pool)
        record["retrieved"] = len(tree) - drafted
        return tree

    def price(self, scores: Sequence[float]) -> int:
        return self.latency.best_count(0, 0.0, scores)

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
        if self.drafter:
            self.drafter.observe(step)
        for retriever in self.retrievers:
            self._safely(retriever, "observe", lambda: retriever.observe(step))
        accepted = [row - 1 for row in step.kept[1:]]
        self.calibration.observe(step.tree, accepted)
        if self.trace:
            self.trace[-1]["accepted"] = Counter(step.tree.nodes[i].source for i in accepted)

    def close(self) -> None:
        """End of the session: retrievers and drafters that keep state on disk save it."""
        if self.drafter:
            self.drafter.close()
        for retriever in self.retrievers:
            retriever.close()
