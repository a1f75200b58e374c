"""The decoding loop every method shares: propose a tree, verify it in one forward, accept, repeat.

Plain decoding is the same loop with a proposer that never proposes anything.
"""

from __future__ import annotations

from time import perf_counter
from typing import Iterator, Protocol, Sequence

from graft_cli.sampling import Noise, Sampling, pick
from graft_cli.stats import Stats
from graft_cli.target import ROOM, Target
from graft_cli.tree import Tree
from graft_cli.verify import accept
from plugins.base import Step


class Proposer(Protocol):
    """Grows the candidate tree for the next verification (drafters and retrievers hide behind one of these)."""

    wants_hidden: bool  # whether observe() needs the target's hidden states (EAGLE heads do)

    def start(self, prompt: Sequence[int], prefill: Step, capacity: int) -> None:
        """A new request of up to ``capacity`` positions (what the target's cache reserved)."""

    def propose(self, context: Sequence[int], stats: Stats) -> Tree: ...

    def observe(self, step: Step) -> None: ...

    def close(self) -> None:
        """End of the session (after its last ``decode``): parts that keep state on disk save it."""


def decode(
    target: Target,
    proposer: Proposer,
    prompt: Sequence[int],
    sampling: Sampling,
    max_new_tokens: int,
    stop_ids: set[int],
    seed: int | None = None,
    stats: Stats | None = None,
) -> Iterator[list[int]]:
    """Yield the new tokens of each step; stops after a stop token or exactly ``max_new_tokens`` tokens. Sampled
    text is a function of ``seed`` (with the model, prompt and sampling settings) alone, whatever the proposer."""
    stats = stats if stats is not None else Stats()
    clock = perf_counter()
    if max_new_tokens <= 0:
        return
    noise = None if sampling.greedy else Noise(0 if seed is None else seed, target.device)
    capacity = len(prompt) + max_new_tokens + ROOM  # the caches of target and draft are reserved once
    out = target.prefill(list(prompt), proposer.wants_hidden, capacity)
    first = pick(out.logits[-1], sampling, noise, 0)
    context = [*prompt, first]
    stats.times["prefill"] += perf_counter() - clock
    t0 = perf_counter()
    proposer.start(prompt, Step(context, [first], Tree(), list(range(len(prompt))), out.logits, out.hidden), capacity)
    stats.times["start"] += perf_counter() - t0  # a draft model's own prefill, the retrievers' indexing
    new = [first]
    while True:
        new = _clip(new, max_new_tokens - stats.new_tokens, stop_ids)
        stats.new_tokens += len(new)
        stats.wall = perf_counter() - clock
        yield new
        if new[-1] in stop_ids or stats.new_tokens >= max_new_tokens:
            return
        t0 = perf_counter()
        tree = proposer.propose(context, stats).within(target.vocab_size)  # a plugin's bad ids never reach the model
        t1 = perf_counter()
        out = target.verify(context[-1], tree, hidden=proposer.wants_hidden)
        t2 = perf_counter()
        result = accept(tree, out.logits, sampling, noise, len(context) - len(prompt))
        rows = result.rows()
        target.keep(rows, len(tree) + 1)
        new = [tree.nodes[i].token for i in result.nodes] + [result.bonus]
        context.extend(new)
        t3 = perf_counter()
        proposer.observe(Step(context, new, tree, rows, out.logits, out.hidden))
        stats.times["propose"] += t1 - t0
        stats.times["verify"] += t2 - t1
        stats.times["accept"] += t3 - t2
        stats.times["update"] += perf_counter() - t3
        stats.steps += 1
        stats.accept_lengths.append(len(new))
        stats.proposed.update(node.source for node in tree.nodes)
        stats.accepted.update(tree.nodes[i].source for i in result.nodes)
        stats.accepted["bonus"] += 1


def _clip(tokens: list[int], room: int, stop_ids: set[int]) -> list[int]:
    """Never more tokens than asked for, and nothing after a stop token."""
    tokens = tokens[:room]
    for i, token in enumerate(tokens):
        if token in stop_ids:
            return tokens[: i + 1]
    return tokens
