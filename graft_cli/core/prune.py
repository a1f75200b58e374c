"""Dynamic-depth pruning: stop drafting where the drafter stops being confident.

A drafter grows its tree level by level. At a few *checkpoints* it looks at its best path so far,
``c_d = exp(max cumulative log-prob at that level)``; when ``c_d < tau_d`` it stops growing and keeps only a
share of the verification budget, freeing the rest for retrieved tokens.

Checkpoint ``d`` is looked at once ``d + 1`` levels exist: ``0`` is the root's children (the first draft
forward), ``1`` the level after that, and so on. The paper's example stops at the root, after depth 1 and after
depth 5; with EAGLE's 60-node budget the draft then keeps 8, 24 and 40 nodes. Here that is a share of the budget
per checkpoint (8/60, 24/60, 40/60 by default, interpolated for other checkpoints), written as an optional third
field: ``--prune-at "0:0.35:0.13,1:0.25:0.4,5:0.15:0.67"``.

Between checkpoints a pruned drafter also stops *widening* where it is unsure: a frontier node whose path
probability is below ``floor`` is not expanded (its subtree could add at most that much to the accepted length,
less than a draft row costs on a CPU), and drafting ends when no frontier node is left. ``floor:X`` in
``--prune-at`` sets it; by default it follows the device (0.1 on a CPU, 0.02 on a GPU, where rows are nearly
free). The dense baseline has neither.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from graft_cli.core.defaults import defaults_for
from graft_cli.core.errors import GraftError

DEFAULT_SCHEDULE = "0:0.35,1:0.25,5:0.15"
# the paper's example: 8, 24 and 40 of 60 nodes kept when drafting stops at the root, after depth 1, after depth 5
_SHARE_AT = ([0, 1, 5], [8 / 60, 24 / 60, 40 / 60])


@dataclass(frozen=True)
class Checkpoint:
    level: int  # checked once level + 1 draft levels exist
    threshold: float  # stop when the best path's probability is below this
    share: float  # of the budget the draft keeps when it stops here


@dataclass(frozen=True)
class PruneSchedule:
    checkpoints: tuple[Checkpoint, ...]
    floor: float = 0.0  # frontier nodes less likely than this are not expanded

    @classmethod
    def parse(cls, text: str, floor: float = 0.0) -> PruneSchedule:
        """``"LEVEL:THRESHOLD[:SHARE],...[,floor:X]"``; ``none`` means no checkpoints. ``floor`` is the default
        for a text without ``floor:``."""
        text = (text or "").strip()
        if text.lower() in ("", "none", "off"):
            return cls((), floor)
        points = {}
        for part in text.split(","):
            fields = part.strip().split(":")
            if fields[0].strip().lower() == "floor":
                try:
                    floor = float(fields[1]) if len(fields) == 2 else -1.0
                except ValueError:
                    floor = -1.0
                if not 0 <= floor < 1:
                    raise GraftError(f"--prune-at: expected floor:X with 0 <= X < 1, got '{part.strip()}'")
                continue
            try:
                if len(fields) not in (2, 3):
                    raise ValueError
                level, threshold = int(fields[0]), float(fields[1])
                share = float(fields[2]) if len(fields) == 3 else float(np.interp(level, *_SHARE_AT))
            except ValueError:
                raise GraftError(f"--prune-at: expected LEVEL:THRESHOLD[:SHARE], got '{part.strip()}'") from None
            if level < 0 or not 0 <= threshold <= 1 or not 0 < share <= 1:
                raise GraftError(f"--prune-at: '{part.strip()}' needs LEVEL >= 0, 0 <= THRESHOLD <= 1, 0 < SHARE <= 1")
            if level in points:
                raise GraftError(f"--prune-at: level {level} is given twice")
            points[level] = Checkpoint(level, threshold, share)
        return cls(tuple(points[k] for k in sorted(points)), floor)

    @classmethod
    def default(cls, device: str = "cpu") -> PruneSchedule:
        return cls.parse(DEFAULT_SCHEDULE, defaults_for(device).prune_floor)

    def at(self, level: int) -> Checkpoint | None:
        for point in self.checkpoints:
            if point.level == level:
                return point
        return None

    def stops(self, level: int, best_logp: float) -> Checkpoint | None:
        """The checkpoint that stops drafting once ``level + 1`` levels exist, or None to go on."""
        point = self.at(level)
        if point is not None and math.exp(best_logp) < point.threshold:
            return point
        return None

    def chain_threshold(self, level: int) -> float:
        """For a chain: the threshold in force at ``level`` (the latest checkpoint at or before it; 0 before any)."""
        threshold = 0.0
        for point in self.checkpoints:
            if point.level <= level:
                threshold = point.threshold
        return threshold

    def keep(self, point: Checkpoint, budget: int) -> int:
        """How many draft nodes stay when drafting stopped at ``point``."""
        return max(1, min(budget, round(budget * point.share)))

    def __str__(self) -> str:
        points = [f"{p.level}:{p.threshold:g}:{p.share:.3g}" for p in self.checkpoints]
        return ",".join(points + ([f"floor:{self.floor:g}"] if self.floor else [])) or "none"
