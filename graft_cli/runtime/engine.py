"""The decoding loop every method shares: propose a tree, verify it in one forward, accept, repeat.

Plain decoding is the same loop with a proposer that never proposes anything. The loop reads what the proposer
needs of each step once, at the start of the request (``Proposer.needs``), and the target makes each step's one
record (``Target.start``, ``Target.step``); the seconds of every phase are kept by :class:`Phases`, on the clock of
the recorder it was handed, so the loop itself is only the algorithm.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Iterator, Sequence

from graft_cli.core import ROOM, Proposer, Stats, Step, Tree
from graft_cli.core.constraint import Constraint
from graft_cli.runtime.prefix_cache import PrefixCache
from graft_cli.runtime.sampling import Noise, Sampling
from graft_cli.runtime.target import Rule, Target


def decode(
    target: Target,
    proposer: Proposer,
    prompt: Sequence[int],
    sampling: Sampling,
    max_new_tokens: int,
    stop_ids: set[int],
    seed: int | None = None,
    stats: Stats | None = None,
    constraint: Constraint | None = None,
    prefix: PrefixCache | None = None,
) -> Iterator[list[int]]:
    """Yield the new tokens of each step; stops after a stop token or exactly ``max_new_tokens`` tokens. Sampled
    text is a function of ``seed`` (with the model, prompt and sampling settings) alone, whatever the proposer.
    Phases are timed on the proposer's clock (its recorder's), counted into ``stats``. ``constraint``: the tokens
    the text may hold (a grammar), applied at every verified row; the same text as plain decoding under it.
    ``prefix``: the rows of earlier requests, resumed from at the start and given this one's at the end (cut off
    by the caller included: between steps every cache is whole)."""
    phases = Phases(target, proposer, stats if stats is not None else Stats(), prefix)
    if max_new_tokens <= 0:
        return
    noise = None if sampling.greedy else Noise(0 if seed is None else seed, target.device)
    rule = replace(target.rule(sampling, noise, proposer.needs, len(prompt)), constraint=constraint)
    step = phases.start(prompt, rule, len(prompt) + max_new_tokens + ROOM)  # caches reserved once a request
    while True:
        new = _clip(step.accepted, max_new_tokens - phases.stats.new_tokens, stop_ids)
        if constraint is not None and new[-1] not in stop_ids and phases.stats.new_tokens + len(new) < max_new_tokens:
            new += constraint.ending()  # a grammar that allows only its end: the stop, without a forward
        phases.emitted(new)
        try:
            yield new
        except GeneratorExit:
            phases.store(step.context)
            raise
        if new[-1] in stop_ids or phases.stats.new_tokens >= max_new_tokens:
            phases.store(step.context)
            return
        tree = phases.propose(step.context, constraint)
        step = phases.verify(step.context, tree, rule)
        phases.observe(step)


class Phases:
    """The loop's calls, each timed into its phase of the request's stats: prefill, start (a draft model's own
    prefill, indexing), then each step's propose, verify (the forward, acceptance and the cache kept) and update."""

    def __init__(self, target: Target, proposer: Proposer, stats: Stats, prefix: PrefixCache | None = None) -> None:
        self.target, self.proposer, self.recorder, self.stats = target, proposer, proposer.recorder, stats
        self.prefix = prefix
        self.recorder.begin(stats)
        self.began = self.recorder.clock()

    def start(self, prompt: Sequence[int], rule: Rule, capacity: int) -> Step:
        with self.recorder.timed("prefill"):
            kept = self.prefix.resume(prompt, capacity) if self.prefix is not None else 0
            self.stats.cached_tokens = kept
            step = self.target.start(prompt, rule, capacity, kept)
        with self.recorder.timed("start"):
            self.proposer.start(prompt, step, capacity)
        return step

    def propose(self, context: list[int], constraint: Constraint | None = None) -> Tree:
        with self.recorder.timed("propose"):  # a plugin's bad ids never reach the model, nor a grammar's
            tree = self.proposer.propose(context).within(self.target.vocab_size)
            return tree if constraint is None else constraint.shape(tree, self.proposer.price)

    def verify(self, context: list[int], tree: Tree, rule: Rule) -> Step:
        with self.recorder.timed("verify"):
            step = self.target.step(context, tree, rule)
        self.stats.count_step(step)
        return step

    def observe(self, step: Step) -> None:
        with self.recorder.timed("update"):
            self.proposer.observe(step)

    def store(self, context: list[int]) -> None:
        """The request's rows kept for the next ones, timed apart from its phases."""
        if self.prefix is not None:
            with self.recorder.timed("prefix store"):
                self.prefix.store(context)

    def emitted(self, tokens: list[int]) -> None:
        """``tokens`` went out: counted, and the request's wall time so far."""
        self.stats.new_tokens += len(tokens)
        self.stats.wall = self.recorder.clock() - self.began


def _clip(tokens: list[int], room: int, stop_ids: set[int]) -> list[int]:
    """Never more tokens than asked for, and nothing after a stop token."""
    tokens = tokens[:room]
    for i, token in enumerate(tokens):
        if token in stop_ids:
            return tokens[: i + 1]
    return tokens
