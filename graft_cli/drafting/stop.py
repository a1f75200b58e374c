"""When a drafter stops growing its tree, and how many of its nodes it keeps: the stop policies of the expansion
loop (tree_drafter.py).

After each level's forward the loop hands the policy the new frontier and the pool; the policy reads from the
device only what its rule needs, in one transfer, and returns the frontier to expand next (possibly narrowed) or
None to stop. Four policies:

- :class:`Checkpoints`: dynamic-depth pruning (graft_cli/core/prune.py): a fixed depth, cut at a checkpoint where
  the best path is unsure, the frontier narrowed below the expansion floor;
- :class:`ChainThreshold`: a chain (``--chain``) stops where its next token's path probability falls below the
  checkpoint threshold in force, keeping the confident prefix;
- :class:`PerLevel`: the cost-aware objective decides at every level whether another is worth its time, and how
  many nodes to keep (a CPU, where a read is cheap);
- :class:`Planned`: the cost-aware objective chose the depth before the draft; nothing is read until the end,
  when it replans the kept count from every level's figures (a GPU, where a read stalls the queue).

The fixed policies also stop for free once ``keep`` nodes of earlier levels outscore anything deeper could.
"""

from __future__ import annotations

import math
from typing import Callable, Sequence

import numpy as np
import torch

from graft_cli.core import Checkpoint, PruneSchedule
from graft_cli.drafting.objective import Objective
from graft_cli.drafting.pool import Frontier, Pool


def prob(logp: float) -> float:
    return math.exp(logp)


class StopPolicy:
    """The rule of one draft. ``keep``: the nodes the draft keeps (the budget until the rule says fewer);
    ``stopped_at``: the checkpoint that stopped it, if one did."""

    planned = False

    def __init__(self, cap: int, budget: int) -> None:
        self.cap, self.budget, self.keep = cap, budget, budget
        self.stopped_at: Checkpoint | None = None

    def level(self, index: int, frontier: Frontier, pool: Pool) -> Frontier | None:
        """After level ``index`` (0: the root's children): the frontier to expand next, or None to stop."""
        raise NotImplementedError

    def final_reads(self, pool: Pool) -> Sequence[torch.Tensor]:
        """Device values the draft's last read brings over for :meth:`count` (none but for a planned draft)."""
        return ()

    def count(self, chosen: int, read: list[float], forward_rows: Sequence[int]) -> int:
        """How many of the ``chosen`` nodes the tree keeps."""
        return chosen


class _Fixed(StopPolicy):
    """A rule without an objective: it reads the frontier only where a decision is open, and stops for free once
    no deeper node could make the cut."""

    def reads(self, index: int, deeper: bool) -> bool:
        raise NotImplementedError

    def decide(self, index: int, deeper: bool, frontier: Frontier, cum: list[float], pool: Pool) -> Frontier | None:
        raise NotImplementedError

    def level(self, index: int, frontier: Frontier, pool: Pool) -> Frontier | None:
        deeper = index + 1 < self.cap
        # only nodes of earlier levels can outscore the newest level's best, so a smaller pool cannot settle
        may_settle = deeper and pool.earlier >= self.keep
        cum, settled = [], False
        if self.reads(index, deeper) or may_settle:
            read = [frontier.cum.double()]
            if may_settle:
                read.append(pool.settled(self.keep, frontier.cum[0]).double()[None])
            host = torch.cat(read).tolist()
            cum, settled = host[: len(frontier)], may_settle and host[len(frontier)] > 0
        frontier = self.decide(index, deeper, frontier, cum, pool)
        if frontier is None or not len(frontier) or (may_settle and settled):
            return None
        return frontier


class Checkpoints(_Fixed):
    """Dynamic-depth pruning over a tree of ``cap`` levels; without a schedule, the dense tree."""

    def __init__(self, cap: int, budget: int, prune: PruneSchedule | None) -> None:
        super().__init__(cap, budget)
        self.prune = prune

    def reads(self, index: int, deeper: bool) -> bool:
        prune = self.prune
        return prune is not None and (prune.at(index) is not None or (deeper and prune.floor > 0))

    def decide(self, index: int, deeper: bool, frontier: Frontier, cum: list[float], pool: Pool) -> Frontier | None:
        prune = self.prune
        if prune is None:
            return frontier if deeper else None
        point = prune.at(index)
        if point is not None and prune.stops(index, max(cum)) is not None:
            self.stopped_at, self.keep = point, prune.keep(point, self.budget)
            return None
        if deeper and prune.floor > 0:  # not worth a draft row; the frontier is sorted, so the worthy nodes lead
            frontier = frontier.head(sum(1 for c in cum if c >= math.log(prune.floor)))
        return frontier if deeper else None


def chain_stops(prune: PruneSchedule | None, index: int, cum: list[float]) -> bool:
    """Whether a chain ends before its newest node: its path probability is under the threshold in force."""
    threshold = prune.chain_threshold(index) if prune is not None else 0.0
    return threshold > 0 and prob(cum[0]) < threshold


class ChainThreshold(_Fixed):
    """A chain of ``cap`` tokens at most, cut where it stops being confident (its confident prefix stays)."""

    def __init__(self, cap: int, budget: int, prune: PruneSchedule | None) -> None:
        super().__init__(cap, budget)
        self.prune = prune

    def reads(self, index: int, deeper: bool) -> bool:
        return self.prune is not None and self.prune.chain_threshold(index) > 0

    def decide(self, index: int, deeper: bool, frontier: Frontier, cum: list[float], pool: Pool) -> Frontier | None:
        if self.reads(index, deeper) and chain_stops(self.prune, index, cum):
            self.keep = min(self.keep, pool.size - 1)  # keep the confident prefix: the newest node goes
            return None
        return frontier if deeper else None


class PerLevel(StopPolicy):
    """The cost-aware objective, asked at every level: it reads the frontier and the pool's best nodes, keeps the
    count with the most expected tokens per second, and goes deeper only while a level is worth its time."""

    def __init__(self, objective: Objective, budget: int, prune: PruneSchedule | None, chain: bool,
                 elapsed: Callable[[], float], forward_rows: list[int]) -> None:
        super().__init__(objective.max_levels, budget)
        self.objective, self.prune, self.chain = objective, prune, chain
        self.elapsed, self.forward_rows = elapsed, forward_rows
        self.line: list[float] = []  # the best path's cumulative log-probs, one per level

    def level(self, index: int, frontier: Frontier, pool: Pool) -> Frontier | None:
        deeper, objective = index + 1 < self.cap, self.objective
        ranked = min(self.budget, pool.size)
        host = torch.cat([frontier.cum.double(), pool.best(ranked)]).tolist()
        cum = host[: len(frontier)]
        if self.chain and chain_stops(self.prune, index, cum):
            self.keep = min(self.keep, pool.size - 1)
            return None
        floor = self.prune.floor if deeper and self.prune is not None and not self.chain else 0.0
        if floor > 0:
            frontier = frontier.head(sum(1 for c in cum if c >= math.log(floor)))
            cum = cum[: len(frontier)]
        if cum:
            if self.line:
                objective.observe_confidence(self.line[-1], cum[0])
            self.line.append(cum[0])  # the best path's newest node
        spent = objective.spent(self.elapsed(), self.forward_rows)
        best_path = [prob(c) for c in self.line]
        plan = objective.best(np.exp(np.array(host[len(host) - ranked :])), spent, best_path)
        self.keep = plan.count
        if not deeper or not objective.extend([prob(c) for c in cum], plan, spent, best_path):
            return None
        return frontier if len(frontier) else None


class Planned(StopPolicy):
    """The depth the objective planned before the draft: every level's frontier and the pool's size then are
    kept on the device, read with the selection at the end, and the kept count replanned from them."""

    planned = True

    def __init__(self, objective: Objective, budget: int) -> None:
        super().__init__(objective.max_levels, budget)
        self.objective = objective
        self.levels: list[tuple[torch.Tensor, int]] = []  # each level's frontier (unread) and pool size
        self.ranked = 0

    def level(self, index: int, frontier: Frontier, pool: Pool) -> Frontier | None:
        self.levels.append((frontier.cum, pool.size))
        depth = index + 1
        if depth >= self.cap or not len(frontier) or depth >= (self.objective.levels or self.cap):
            return None
        return frontier

    def final_reads(self, pool: Pool) -> Sequence[torch.Tensor]:
        self.ranked = min(self.budget, pool.size)
        return [torch.cat([f for f, _ in self.levels]), pool.best_at([n for _, n in self.levels], self.ranked).flatten()]

    def count(self, chosen: int, read: list[float], forward_rows: Sequence[int]) -> int:
        widths = np.cumsum([0] + [len(f) for f, _ in self.levels])
        best, ranked = read[widths[-1] :], self.ranked
        walked = [(read[widths[i] : widths[i + 1]], best[i * ranked : i * ranked + min(ranked, n)])
                  for i, (_, n) in enumerate(self.levels)]
        return self.objective.replan(walked, forward_rows)
