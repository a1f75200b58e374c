"""The decoding loop every method shares: propose a tree, verify it in one forward, accept, repeat.

Plain decoding is the same loop with a proposer that never proposes anything.
"""

from __future__ import annotations

from functools import partial
from time import perf_counter
from typing import Iterator, Sequence

import torch

from graft_cli.core import ROOM, Proposer, Stats, Step, Stopwatch, Tree
from graft_cli.runtime.sampling import Noise, Sampling
from graft_cli.runtime.target import Ahead, Forward, Outcome, Target
from graft_cli.runtime.verify import accept


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
    started = perf_counter()
    if max_new_tokens <= 0:
        return
    watch = Stopwatch(stats.times)  # prefill, start (a draft model's own prefill, indexing), then each step's phases
    noise = None if sampling.greedy else Noise(0 if seed is None else seed, target.device)
    capacity = len(prompt) + max_new_tokens + ROOM  # the caches of target and draft are reserved once
    # None: verified here, accepted on the host; else with the top-k a retriever learns from, in the step's read
    successors, layers = getattr(proposer, "successors", 0), getattr(proposer, "feature_layers", ())
    # a proposer that drafts the next step before a step's read, to read both at once (the fixed-shape path)
    ahead: Ahead | None = getattr(proposer, "ahead", None)
    device_step = target.device_step(sampling, noise, successors, layers, ahead is not None)
    prefill = _prefill(target, proposer, prompt, sampling, noise, capacity, ahead if device_step else None)
    context, new = prefill.context, list(prefill.accepted)
    watch.lap("prefill")
    proposer.start(prompt, prefill, capacity)
    watch.lap("start")
    while True:
        new = _clip(new, max_new_tokens - stats.new_tokens, stop_ids)
        stats.new_tokens += len(new)
        stats.wall = perf_counter() - started
        yield new
        if new[-1] in stop_ids or stats.new_tokens >= max_new_tokens:
            return
        watch.restart()
        tree = proposer.propose(context, stats).within(target.vocab_size)  # a plugin's bad ids never reach the model
        watch.lap("propose")
        if device_step is None:
            out = target.verify(context[-1], tree, hidden=proposer.wants_hidden)
            watch.lap("verify")
            result = accept(tree, out.logits, sampling, noise, len(context) - len(prompt))
            target.keep(result.rows(), len(tree) + 1)
        else:  # the fixed-shape path: accepted and compacted on the device, read once
            out, result = device_step(context[-1], tree, proposer.wants_hidden, len(context) - len(prompt), ahead)
            watch.lap("verify")
        rows = result.rows()
        new = [tree.nodes[i].token for i in result.nodes] + [result.bonus]
        context.extend(new)
        watch.lap("accept")
        proposer.observe(Step(context, new, tree, rows, out.logits, out.hidden, out.successors, out.features,
                              out.ahead))
        watch.lap("update")
        stats.count_step(tree, result.nodes)


def _prefill(target: Target, proposer: Proposer, prompt: Sequence[int], sampling: Sampling, noise: Noise | None,
             capacity: int, ahead: Ahead | None) -> Step:
    """The prompt's forward and its token, read once with (asked for) its row's top-k and the first draft queued
    ``ahead``: the prefill's Step."""
    layers = getattr(proposer, "feature_layers", ())
    out = target.prefill(list(prompt), proposer.wants_hidden, capacity)
    queue = None if ahead is None else partial(_prefill_ahead, ahead, prompt, out, layers, capacity)
    first, top, landed = target.first(out.logits[-1], sampling, noise, getattr(proposer, "successors", 0), queue)
    return Step([*prompt, first], [first], Tree(), list(range(len(prompt))), out.logits, out.hidden, top, ahead=landed)


def _prefill_ahead(ahead: Ahead, prompt: Sequence[int], out: Forward, layers: Sequence[int], capacity: int,
                   choice: torch.Tensor) -> torch.Tensor | None:
    """What ``ahead`` queues from the prefill, its token ``choice`` still on the device."""
    return ahead(Outcome.of_prefill(prompt, out, layers, choice, capacity))


def _clip(tokens: list[int], room: int, stop_ids: set[int]) -> list[int]:
    """Never more tokens than asked for, and nothing after a stop token."""
    tokens = tokens[:room]
    for i, token in enumerate(tokens):
        if token in stop_ids:
            return tokens[: i + 1]
    return tokens
