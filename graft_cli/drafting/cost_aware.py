"""graft with a drafter: each step's tree chosen by expected accepted tokens per second (objective.py).

Retrieval runs first, since its chains cost nothing to propose. The drafter then joins the request only when that
pays for reading its prompt, drafts only when the measured rates say drafting beats retrieval alone at this
retrieval confidence, checks the retrieved chain in its first forward, and grows levels only while each is worth
its time; the retrieved nodes fill what the draft left of the budget. After verification the objective learns
what the step cost and bought.

On the fixed-shape path (a drafter at fixed shapes, a planned objective) the draft is queued ahead instead:
:meth:`CostAwareProposer.ahead` decides at a step's end, before its read, on the last retrieval, and the draft
comes back with the step's one read; no chain is checked in it.
"""

from __future__ import annotations

from dataclasses import dataclass
from time import perf_counter
from typing import Sequence

import numpy as np
import torch

from graft_cli.core import ROOM, Drafter, Retriever, Stats, Step, Tree
from graft_cli.drafting.budget import LatencyModel
from graft_cli.drafting.objective import Objective, RetrievalSoFar
from graft_cli.drafting.proposer import GraftProposer, best_path
from graft_cli.runtime.target import Outcome

CHECK_FLOOR = 0.1  # a retrieved token less likely than this is not worth a row of the draft's first forward
CHECK_MAX = 16  # retrieved tokens checked per step at most


@dataclass
class Pending:
    """What the step proposed cost, until observe() learns what it bought."""

    bucket: int  # the retrieval confidence bucket the step fell in
    drafted: bool
    draft_s: float  # seconds of drafting (joining a request excluded)
    draft_rows: list[int]  # rows fed by each draft forward
    line_probs: list[float]  # the drafter's own probabilities along its best path ...
    line: list[int]  # ... and that path's nodes (the tree's first nodes are the draft's)
    proposed_at: float  # perf_counter() when the tree left for verification


class CostAwareProposer(GraftProposer):
    """The cost-aware tree builder over a drafter and retrievers; ``budget`` is only the tree's ceiling."""

    def __init__(self, budget: int, retrievers: Sequence[Retriever], drafter: Drafter, latency: LatencyModel,
                 objective: Objective, tail: bool = False) -> None:
        super().__init__(budget, retrievers, drafter=drafter, latency=latency, tail=tail)
        self.objective = objective
        self._step: Pending | None = None
        self._prompt, self._end = 0, 0  # the request's prompt length, and the context length at its limit
        self._joined = False  # whether the drafter has drafted in this request (read its prompt)
        self._alone = RetrievalSoFar(0, 0.0, 0)  # this request's steps before the drafter joined
        self._bucket = 1  # the retrieval confidence of the last step proposed
        self._ahead = False  # whether the drafter fed the last step before its read (its draft came with it)
        self._ahead_s = 0.0  # ... and the seconds queueing it took
        self._queues = False  # whether its drafter drafts ahead (ahead() was asked, on the fixed-shape path)
        self._context: Sequence[int] = ()  # the last proposal's context and retrieved scores (ahead() decides on)
        self._ranked = np.zeros(0)

    def start(self, prompt: Sequence[int], prefill: Step, capacity: int) -> None:
        self._ahead = self._ahead and getattr(self.drafter, "ahead_of", None) == "start"  # this prefill's, or none
        super().start(prompt, prefill, capacity)
        self._prompt, self._end = len(prompt), capacity - ROOM
        self._joined, self._alone = False, RetrievalSoFar(0, 0.0, 0)

    def propose(self, context: Sequence[int], stats: Stats) -> Tree:
        if self.budget <= 0:
            return super().propose(context, stats)
        self.latency.context = len(context)  # what a node costs depends on the cache it is verified over
        objective, drafter = self.objective, self.drafter
        t0 = perf_counter()
        pool = self._retrieved(context, self.budget)
        t1 = perf_counter()
        ranked = np.array(sorted((n.score for n in pool.nodes), reverse=True), dtype=np.float64)
        bucket = self._bucket = objective.bucket(ranked)
        self._context, self._ranked = context, ranked
        ahead, self._ahead = self._ahead, False
        if ahead:
            drafted = drafter.landed
        else:  # a drafter that drafts ahead drafts only then (so that a step reads once), never after a read
            drafted = not self._queues and self._should_draft(context, bucket, ranked)
        tree, line, line_probs = Tree(), [], []
        if drafted:
            self._joined = True
            tree = drafter.draft(context, self.budget, stats, () if ahead else self._chain(pool), objective)
            line = best_path(tree)  # its best path is calibrated, to compete fairly with retrieved nodes
            line_probs = [tree.nodes[i].score for i in line]
            for i, p in zip(line, objective.calibrated(np.array(line_probs))):
                tree.nodes[i].score = float(p)
        t2 = perf_counter()
        if self.tail and len(tree):
            self._tail(pool, tree, context, self.budget)
        kept = len(tree)
        draft_s = 0.0  # joining (reading the prompt) is not drafting; a draft queued ahead was timed then
        if drafted:
            draft_s = (drafter.ahead_s if ahead else t2 - t1) - drafter.catch_up_s
        rows = list(drafter.forward_rows) if drafted else []
        if len(pool):
            tree = self._graft(tree, pool, objective.spent(draft_s, rows), objective.going())
        stats.times["retrieve"] += t1 - t0 + perf_counter() - t2
        self.trace.append({"draft": kept, "retrieved": len(tree) - kept, "levels": drafter.levels if drafted else 0})
        self._step = Pending(bucket, drafted, draft_s, rows, line_probs, line, perf_counter())
        return tree

    def ahead(self, outcome: Outcome) -> torch.Tensor | None:
        """The next step's draft queued before this step's result is read, so that one read brings both (the
        fixed-shape path, a planned objective, a drafter that can): whether to draft is decided at the last
        step's retrieval (the next one's needs the tokens this read brings), and no retrieved chain is checked in
        it. A drafter that has not read the request's prompt joins here (never at the prefill, before any
        retrieval)."""
        drafter, t0 = self.drafter, perf_counter()
        if not getattr(drafter, "drafts_ahead", lambda objective: False)(self.objective):
            return None
        self._queues = True
        if outcome.start:
            drafting = self.objective.should_draft(self._bucket)
        else:
            drafting = self._should_draft(self._context, self._bucket, self._ranked)
        read = drafter.draft_ahead(outcome, self._context, self.budget if drafting else 0, self.objective)
        self._ahead = drafter.ahead_of is not None
        self._ahead_s = perf_counter() - t0
        return read

    def _should_draft(self, context: Sequence[int], bucket: int, ranked: np.ndarray) -> bool:
        """Whether this step drafts: by the bandit's rates at this confidence, and, while the drafter has not
        joined the request, only when joining pays for reading the prompt."""
        objective = self.objective
        drafted = objective.should_draft(bucket)
        if drafted and not self._joined:
            unread = self.drafter.unread(context)
            remaining = objective.expected_remaining(len(context) - self._prompt, self._end - len(context))
            drafted = self._joined = not unread or objective.should_join(self._alone, unread, remaining, ranked)
        return drafted

    def _chain(self, pool: Tree) -> list[int]:
        """The retrieved path worth checking in the draft's first forward: its best path while that stays at
        least ``CHECK_FLOOR`` likely (a row the draft pays for that little is wasted), ``CHECK_MAX`` at most."""
        chain = []
        for i in best_path(pool)[:CHECK_MAX]:
            if pool.nodes[i].score < CHECK_FLOOR:
                break
            chain.append(pool.nodes[i].token)
        return chain

    def observe(self, step: Step) -> None:
        verified_at = perf_counter()
        super().observe(step)
        if self._step is None:
            return
        done, self._step, objective = self._step, None, self.objective
        queued, self._ahead_s = self._ahead_s, 0.0  # the next draft, queued inside this step: not its verification
        objective.measured(done.bucket, done.drafted, len(step.accepted), len(step.tree),
                           verified_at - done.proposed_at - queued, done.draft_s, done.draft_rows)
        if not self._joined:
            alone = self._alone
            self._alone = RetrievalSoFar(alone.tokens + len(step.accepted),
                                         alone.cost + objective.verify_cost(len(step.tree)), alone.steps + 1)
        accepted = [row - 1 for row in step.kept[1:]]
        reached = 0  # how far along the draft's best path the target accepted
        while reached < min(len(done.line), len(accepted)) and done.line[reached] == accepted[reached]:
            reached += 1
        objective.observe_draft(done.line_probs, reached)
