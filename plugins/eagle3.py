"""The ``eagle3`` drafter: EAGLE-3 heads draft from the target's own hidden states (graft_cli/heads/head.py).

The head keeps its own KV cache of accepted pairs. Tree rows are dropped after each verification and the accepted
tokens are fed again with the target's real features, as EAGLE does: after the step's read, or, drafting ahead on
the fixed-shape path, before it, at a fixed shape from the unread result (every step, drafting or not).
"""

from __future__ import annotations

from functools import partial
from typing import Any, Sequence

import torch

from graft_cli.plugin import (
    Capture, DrafterEnv, Eagle3Head, FixedLevels, GraftError, Needs, Outcome, PruneSchedule, Step, TreeDrafter,
    head_catch_up, head_level, head_layers, kernels_outside, load_head, positions,
)


class Eagle3Drafter(TreeDrafter):
    def __init__(self, head: Eagle3Head, target: torch.nn.Module, depth: int = 6, top_k: int = 4,
                 prune: PruneSchedule | None = None, chain: bool = False) -> None:
        super().__init__(depth, top_k, prune, chain)
        self.head = head
        # the target layers it reads: a fixed-shape target gathers them for the accepted rows (Step.features)
        self.layers = head_layers(head.cfg, target.config.num_hidden_layers)
        self.needs = Needs(hidden=True, layers=self.layers)
        self.num_states = target.config.num_hidden_layers + 1
        self.pending_features: list[torch.Tensor] = []  # [n, 3·Ht] target features of pairs not yet fed
        self.pending_tokens: list[int] | torch.Tensor = []  # ... their tokens (on the device: the prefill's, ahead)
        self.committed = 0  # pairs in the head's cache
        self.next_position = 0
        self.resumed = 0  # pairs of the next prompt a prefix cache wrote into the head's cache (resume)

    def _features(self, hidden: tuple[torch.Tensor, ...] | None, rows: list[int]) -> torch.Tensor:
        if hidden is None or len(hidden) != self.num_states:
            raise GraftError("the EAGLE-3 head needs the target's hidden states of every layer")
        index = torch.tensor(rows, device=hidden[0].device)
        return torch.cat([hidden[i].index_select(0, index) for i in self.layers], dim=-1)

    def start(self, prompt: Sequence[int], prefill: Step, capacity: int) -> None:
        fed = self.queued_at == "start"  # the prompt was fed before the prefill's read (_root_queued)
        super().start(prompt, prefill, capacity)
        if fed:
            return
        self._begin(capacity)
        # pair (features at t, token t + 1): the prompt's positions with the next prompt token, the last with
        # the token the prefill chose (past the pairs resumed: the target fed exactly those rows)
        self.pending_features = [self._features(prefill.hidden, list(prefill.kept))]
        self.pending_tokens = [*list(prompt)[self.committed + 1 :], *prefill.accepted[:1]]

    def _begin(self, capacity: int) -> None:
        """A request's head cache: its first pairs those a prefix cache resumed, the rest empty."""
        self.head.reset(capacity, self.resumed)
        self.committed, self.resumed = self.resumed, 0

    lag = 1  # pair t reads the token after t

    def state(self, context: Sequence[int]) -> tuple[Any, int]:
        """The head's cache and its pairs, fed or not: those it has read."""
        return self.head.cache, self.committed

    def resume(self, rows: int) -> None:
        self.resumed = rows

    def observe(self, step: Step) -> None:
        fed = self.queued_at == "step"  # its pairs were fed on the device before the read (_count_fed)
        super().observe(step)
        if fed:
            return
        # the root and every accepted node, each paired with the token that followed it (gathered already on the
        # fixed-shape path, in a graph's output that the next step overwrites: copied)
        if step.features is not None:
            self.pending_features.append(step.features.clone())
        else:
            self.pending_features.append(self._features(step.hidden, list(step.kept)))
        self.pending_tokens.extend(step.accepted)

    def _drop_tree(self, keep_rows: list[int]) -> None:
        self.head.crop(self.committed)
        self.tree_rows = 0

    def _root(self, context: Sequence[int]) -> tuple[torch.Tensor, Any]:
        head = self.head
        features = torch.cat(self.pending_features, dim=0)
        n, past, device = len(self.pending_tokens), self.committed, head.device
        if n == 0:
            raise RuntimeError("nothing new for the EAGLE-3 head to read")
        tokens = self.pending_tokens
        if not isinstance(tokens, torch.Tensor):
            tokens = torch.tensor(tokens, dtype=torch.long, device=device)
        positions = torch.arange(past, past + n, device=device)
        allowed = torch.ones((n, past + n), dtype=torch.bool, device=device).tril(diagonal=past)
        out = head.forward(tokens, head.fuse(features), positions, allowed)
        self.committed += n
        self.pending_features, self.pending_tokens = [], []
        self.next_position = past + n  # where the root's children sit
        return head.logp(out[-1]), out[-1:]

    def _root_queued(self, outcome: Outcome, context: Sequence[int], budget: int) -> tuple[torch.Tensor, Any] | None:
        """The prefill's prompt rows fed as :meth:`start` feeds them, the last token still on the device; a step's
        accepted pairs at a fixed shape, where they begin known and how many of them not (:meth:`_catch_up`).
        Fed with or without a draft: they are on the device now, and on the host only as a copy."""
        if outcome.features is None:
            return None
        if outcome.start:
            self._reset()
            self._begin(outcome.start)
            self.pending_features, self.pending_tokens = [outcome.features], outcome.tokens
            return self._root(())
        if self.fixed is None:
            return None
        if len(self.pending_tokens):  # a step read without queueing (past the buckets' room): its pairs first
            self._root(())
        return self._catch_up(outcome)

    def _catch_up(self, outcome: Outcome) -> tuple[torch.Tensor, Any]:
        """The step's pairs written from the last committed row on, each seeing the context and the pairs before
        it (padded rows are overwritten by the levels, or never seen); the levels then see ``base`` rows."""
        fixed, head = self.fixed, self.head
        inputs = fixed.catch_up(head.cache, outcome, self.committed)
        features = fixed.states_for(outcome.features, inputs.rows)
        with kernels_outside(head):
            logp, state = fixed.run("head catch-up", head.cache, inputs,
                                    partial(head_catch_up, head, inputs, features, fixed.count))
        self.base, self.most = fixed.base, fixed.most
        return logp, state

    def _count_fed(self, rows: int) -> None:
        self.committed = self.next_position = self.committed + rows
        self.head.cache.settle(self.committed)

    def fix_levels(self, capture: Capture | None) -> bool:
        self.fixed = FixedLevels(capture, self.top_k, self.head.device)
        self.head.cache.zeroed = True  # levels read the head's whole cache, unfilled rows masked
        return True

    def _grow(self, tokens: torch.Tensor, states: Any, depth: int | torch.Tensor,
              mask: torch.Tensor) -> tuple[torch.Tensor, Any]:
        n, base = tokens.shape[0], self.base  # base: a draft queued ahead, whose context ends on the device
        at = positions((self.next_position if base is None else base) - 1, depth, n, mask.device)
        if self.fixed is not None:  # the head's whole cache, static buffers, a captured graph on a GPU
            inputs = self.fixed.prepare(self.head.cache, tokens, at, self.committed if base is None else base,
                                        self.tree_rows, mask, self.most)
            static = self.fixed.states_for(states, inputs.rows)
            with kernels_outside(self.head):
                logp, out = self.fixed.run("head level", self.head.cache, inputs,
                                           partial(head_level, self.head, inputs, static))
            return logp[:n], out[:n]
        allowed = torch.cat([torch.ones((n, self.committed), dtype=torch.bool, device=mask.device), mask], dim=1)
        out = self.head.forward(tokens, states, at, allowed)
        return self.head.logp(out), out

    def _to_target(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head.to_target(ids)

    def _from_target(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head.from_target(ids)


def make(env: DrafterEnv) -> Eagle3Drafter:
    """The ``eagle3`` drafter (``--draft eagle3:DIR|NAME``): the head read and checked against the target."""
    settings = env.settings
    head = load_head(env.spec, env.target.model, settings.rope_theta)
    return Eagle3Drafter(head, env.target.model, depth=settings.depth, top_k=settings.draft_top_k, prune=env.prune,
                         chain=settings.chain).following(env)
