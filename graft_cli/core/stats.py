"""Counters for one generation: what each source proposed and got accepted, and where the time went."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from graft_cli.core.step import Step


@dataclass
class Stats:
    new_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens a prefix cache held, not fed again
    steps: int = 0  # verification forwards of the target (the prefill not counted)
    draft_forwards: int = 0
    proposed: Counter = field(default_factory=Counter)  # nodes verified, by source
    accepted: Counter = field(default_factory=Counter)  # tree tokens accepted, by source ("bonus" for the target's own)
    accept_lengths: list[int] = field(default_factory=list)  # tokens gained per verification step
    times: Counter = field(default_factory=Counter)  # seconds: prefill, start, propose, verify, update; retrieve, draft
    wall: float = 0.0
    budgets: list[int] = field(default_factory=list)  # tree nodes chosen per step under --budget auto

    def count_step(self, step: Step) -> None:
        """One verification: the tree's nodes by source, the accepted nodes by source, and the bonus token."""
        tree = step.tree
        self.steps += 1
        self.accept_lengths.append(len(step.accepted))
        self.proposed.update(node.source for node in tree.nodes)
        self.accepted.update(tree.nodes[row - 1].source for row in step.kept[1:])
        self.accepted["bonus"] += 1

    @property
    def tau(self) -> float:
        """Mean tokens gained per target verification forward (1.0 for plain decoding)."""
        return sum(self.accept_lengths) / len(self.accept_lengths) if self.accept_lengths else 1.0

    @property
    def tokens_per_s(self) -> float:
        return self.new_tokens / self.wall if self.wall else 0.0

    def as_dict(self) -> dict:
        return {
            "new_tokens": self.new_tokens,
            "cached_tokens": self.cached_tokens,
            "steps": self.steps,
            "tau": round(self.tau, 3),
            "tokens_per_s": round(self.tokens_per_s, 2),
            "wall_s": round(self.wall, 3),
            "draft_forwards": self.draft_forwards,
            "proposed": dict(self.proposed),
            "accepted": dict(self.accepted),
            "time_s": {k: round(v, 3) for k, v in self.times.items()},
            **({"budget_mean": round(sum(self.budgets) / len(self.budgets), 2)} if self.budgets else {}),
        }

    def summary(self) -> str:
        """One human line for stderr."""
        by_source = ", ".join(f"{k} {v}" for k, v in sorted(self.accepted.items())) or "-"
        times = " ".join(f"{k} {v:.2f}s" for k, v in self.times.items())
        if self.budgets:
            times += f"; budget auto: {sum(self.budgets) / len(self.budgets):.1f} nodes per step"
        cached = f", {self.cached_tokens} prompt tokens from the prefix cache" if self.cached_tokens else ""
        return (
            f"{self.new_tokens} tokens in {self.wall:.2f}s ({self.tokens_per_s:.1f} tok/s){cached}, "
            f"tau {self.tau:.2f} over {self.steps} steps; accepted: {by_source}; {times}"
        )

