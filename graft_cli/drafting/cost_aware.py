"""graft with a drafter: each step's tree chosen by expected accepted tokens per second (objective.py).

Retrieval runs first, since its chains cost nothing to propose. The drafter then joins the request only when that
pays for reading its prompt, drafts only when the measured rates say drafting beats retrieval alone at this
retrieval confidence, checks the retrieved chain in its first forward, and grows levels only while each is worth
its time; the retrieved nodes fill what the draft left of the budget. After verification the objective learns
what the step cost and bought.

On the fixed-shape path (a drafter at fixed shapes, a planned objective) the draft is queued ahead instead:
:meth:`CostAwareProposer.queue` (the loop's ``Needs.queue``) decides at a step's end, before its read, on the last
retrieval, and the draft comes back with the step's one read; no chain is checked in it.

Every second it learns from is read on the clock it was handed (its recorder's), never the wall's.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Sequence

import numpy as np
import torch

from graft_cli.core import ROOM, Drafter, Needs, Outcome, Recorder, Retriever, Step, Tree
from graft_cli.drafting.budget import LatencyModel
from graft_cli.drafting.objective import Objective, RetrievalSoFar
from graft_cli.drafting.proposer import GraftProposer, best_path

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
    proposed_at: float  # the clock when the tree left for verification


class CostAwareProposer(GraftProposer):
    """The cost-aware tree builder over a drafter and retrievers; ``budget`` is only the tree's ceiling."""

    def __init__(self, budget: int, retrievers: Sequence[Retriever], drafter: Drafter, latency: LatencyModel,
                 objective: Objective, tail: bool = False, recorder: Recorder | None = None) -> None:
        super().__init__(budget, retrievers, drafter=drafter, latency=latency, tail=tail, recorder=recorder)
        self.objective = objective
        self._step: Pending | None = None
        self._prompt, self._end = 0, 0  # the request's prompt length, and the context length at its limit
        self._joined = False  # whether the drafter has drafted in this request (read its prompt)
        self._alone = RetrievalSoFar(0, 0.0, 0)  # this request's steps before the drafter joined
        self._bucket = 1  # the retrieval confidence of the last step proposed
        self._fed = False  # whether the drafter fed the last step before its read (its draft came with it)
        self._queue_s = 0.0  # ... and the seconds queueing it took
        self._queueing = False  # whether its drafter drafts before reads (queue() was called, on fixed shapes)
        self._context: Sequence[int] = ()  # the last proposal's context and retrieved scores (queue() decides on)
        self._ranked = np.zeros(0)

    @property
    def needs(self) -> Needs:
        """A drafter that can draft before a step's read for this objective (fixed-shape levels, planned) has its
        draft queued there: :meth:`queue`."""
        needs = super().needs
        return replace(needs, queue=self.queue) if self.drafter.queues(self.objective) else needs

    def start(self, prompt: Sequence[int], prefill: Step, capacity: int) -> None:
        self._fed = self._fed and self.drafter.queued_at == "start"  # this prefill's, or none
        super().start(prompt, prefill, capacity)
        self._prompt, self._end = len(prompt), capacity - ROOM
        self._joined, self._alone = False, RetrievalSoFar(0, 0.0, 0)

    def propose(self, context: Sequence[int]) -> Tree:
        if self.budget <= 0:
            return super().propose(context)
        self.latency.context = len(context)  # what a node costs depends on the cache it is verified over
        objective, drafter, clock = self.objective, self.drafter, self.recorder.clock
        t0 = clock()
        pool = self._retrieved(context, self.budget)
        t1 = clock()
        ranked = np.array(sorted((n.score for n in pool.nodes), reverse=True), dtype=np.float64)
        bucket = self._bucket = objective.bucket(ranked)
        self._context, self._ranked = context, ranked
        fed, self._fed = self._fed, False
        if fed:
            drafted = drafter.landed
        else:  # a drafter that drafts before reads drafts only then (so that a step reads once), never after one
            drafted = not self._queueing and self._should_draft(context, bucket, ranked)
        tree, line, line_probs = Tree(), [], []
        if drafted:
            self._joined = True
            tree = drafter.draft(context, self.budget, () if fed else self._chain(pool), objective)
            line = best_path(tree)  # its best path is calibrated, to compete fairly with retrieved nodes
            line_probs = [tree.nodes[i].score for i in line]
            for i, p in zip(line, objective.calibrated(np.array(line_probs))):
                tree.nodes[i].score = float(p)
        t2 = clock()
        if self.tail and len(tree):
            self._tail(pool, tree, context, self.budget)
        kept = len(tree)
        draft_s = 0.0  # joining (reading the prompt) is not drafting; a draft queued ahead was timed then
        if drafted:
            draft_s = (drafter.queue_s if fed else t2 - t1) - drafter.catch_up_s
        rows = list(drafter.forward_rows) if drafted else []
        if len(pool):
            tree = self._graft(tree, pool, objective.spent(draft_s, rows), objective.going())
        end = clock()
        self.recorder.add("retrieve", t1 - t0 + end - t2)
        self.trace.append({"draft": kept, "retrieved": len(tree) - kept, "levels": drafter.levels if drafted else 0})
        self._step = Pending(bucket, drafted, draft_s, rows, line_probs, line, end)
        return tree

    def queue(self, outcome: Outcome) -> torch.Tensor | None:
        """The next step's draft queued before this step's result is read, so that one read brings both (the
        fixed-shape path, a planned objective, a drafter that can): whether to draft is decided at the last
        step's retrieval (the next one's needs the tokens this read brings), and no retrieved chain is checked in
        it. A drafter that has not read the request's prompt joins here (never at the prefill, before any
        retrieval)."""
        drafter, t0 = self.drafter, self.recorder.clock()
        self._queueing = True
        if outcome.start:
            drafting = self.objective.should_draft(self._bucket)
        else:
            drafting = self._should_draft(self._context, self._bucket, self._ranked)
        read = drafter.queue(outcome, self._context, self.budget if drafting else 0, self.objective)
        self._fed = drafter.queued_at is not None
        self._queue_s = self.recorder.clock() - t0
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
        verified_at = self.recorder.clock()
        super().observe(step)
        if self._step is None:
            return
        done, self._step, objective = self._step, None, self.objective
        queued, self._queue_s = self._queue_s, 0.0  # the next draft, queued inside this step: not its verification
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
