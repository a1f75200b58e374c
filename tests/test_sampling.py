"""Speculative sampling keeps the target's distribution: exact joint probabilities of the first speculated
tokens against thousands of samples, with a negative control that a biased verifier must fail."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
import torch

import graft_cli.runtime.engine as engine
import graft_cli.runtime.target as target_module
from graft_cli.runtime.sampling import Noise, Sampling, pick, probabilities
from graft_cli.runtime.target import Target
from graft_cli.core import ROOT, Stats, Tree
from graft_cli.runtime.verify import Accepted, accept
from tests.tiny import StaticProposer, tiny_model

V = 6
PROMPT = [1, 4, 2]


class FixedTreeProposer(StaticProposer):
    """Every step: three root children, each with two children; tokens drawn from its own RNG (proposals may
    depend on anything but the target's random draws)."""

    def __init__(self, seed: int) -> None:
        self.rng = np.random.default_rng(seed)

    def propose(self, context) -> Tree:
        tree = Tree()
        for a in self.rng.choice(V, 3, replace=False):
            node = tree.add(ROOT, int(a), "t", 0.5)
            for b in self.rng.choice(V, 2, replace=False):
                tree.add(node, int(b), "t", 0.4)
        return tree


def exact_joint(model, sampling: Sampling) -> dict[tuple[int, int], float]:
    """P(second, third generated token), summed over the first (which the prefill samples)."""
    dist = {}
    with torch.no_grad():
        p1 = probabilities(model(torch.tensor([PROMPT])).logits[0, -1], sampling)
        for a in range(V):
            p2 = probabilities(model(torch.tensor([PROMPT + [a]])).logits[0, -1], sampling)
            for b in range(V):
                p3 = probabilities(model(torch.tensor([PROMPT + [a, b]])).logits[0, -1], sampling)
                for c in range(V):
                    dist[(b, c)] = dist.get((b, c), 0.0) + float(p1[a] * p2[b] * p3[c])
    return dist


def sample_joint(model, sampling: Sampling, n: int) -> dict[tuple[int, int], int]:
    """Counts over ``n`` generations with seeds 1000.. (the distribution is over seeds)."""
    counts: dict[tuple[int, int], int] = {}
    target, proposer = Target(model), FixedTreeProposer(7)
    for seed in range(1000, 1000 + n):
        tokens = [t for s in engine.decode(target, proposer, PROMPT, sampling, 3, set(), seed) for t in s]
        counts[(tokens[1], tokens[2])] = counts.get((tokens[1], tokens[2]), 0) + 1
    return counts


def chi_square_rejects(expected: dict, counts: dict, n: int) -> bool:
    """Pearson's test at alpha = 0.001 (Wilson-Hilferty critical value), merging bins expected below 5."""
    stat, df, small_e, small_o = 0.0, -1, 0.0, 0
    for key, p in expected.items():
        e, o = p * n, counts.get(key, 0)
        if e < 5:
            small_e, small_o = small_e + e, small_o + o
            continue
        stat, df = stat + (o - e) ** 2 / e, df + 1
    if small_e > 0:
        stat, df = stat + (small_o - small_e) ** 2 / small_e, df + 1
    z = 3.09
    critical = df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3
    return stat > critical


def biased_accept(tree, logits, sampling, noise, position):
    """A wrong verifier: takes the first root child whenever the target gives it at least 5%."""
    first = tree.children(ROOT)
    if first and probabilities(logits[0], sampling)[tree.nodes[first[0]].token] > 0.05:
        return Accepted([first[0]], pick(logits[first[0] + 1], sampling, noise, position + 1))
    return accept(tree, logits, sampling, noise, position)


SETTINGS = [Sampling(temperature=1.0), Sampling(temperature=0.7, top_k=4, top_p=0.9)]


@pytest.mark.parametrize("sampling", SETTINGS, ids=["plain", "topk-topp"])
def test_speculative_sampling_preserves_the_distribution(sampling):
    model = tiny_model(seed=11, vocab=V, init=0.08)
    n = 2500
    assert not chi_square_rejects(exact_joint(model, sampling), sample_joint(model, sampling, n), n)


def test_the_statistical_test_catches_a_biased_verifier(monkeypatch):
    model = tiny_model(seed=11, vocab=V, init=0.08)
    sampling = SETTINGS[0]
    monkeypatch.setattr(target_module, "accept", biased_accept)
    n = 2500
    assert chi_square_rejects(exact_joint(model, sampling), sample_joint(model, sampling, n), n)


def test_same_seed_same_tokens():
    model = tiny_model(seed=2, vocab=50, init=0.05)
    sampling = Sampling(temperature=0.9, top_p=0.95)
    runs = []
    for proposer_seed in range(2):  # other trees, the same text
        runs.append([t for s in engine.decode(Target(model), FixedTreeProposer(proposer_seed), PROMPT, sampling, 20,
                                              set(), 42) for t in s])
    assert runs[0] == runs[1]


def test_top_p_keeps_the_smallest_set_reaching_p():
    probs = probabilities(torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05])), Sampling(temperature=1.0, top_p=0.8))
    assert torch.allclose(probs, torch.tensor([0.625, 0.375, 0.0, 0.0]))
    probs = probabilities(torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05])), Sampling(temperature=1.0, top_k=1))
    assert probs.tolist() == [1.0, 0.0, 0.0, 0.0]
    assert list(itertools.islice(iter(probs), 1)) == [1.0]


# --- drafter-invariant sampling: the same seed gives the same text whatever proposes ------------------------------


def plain_sampling(model, prompt: list[int], sampling: Sampling, n: int, seed: int) -> list[int]:
    """The reference: a full forward over the whole sequence per token, no cache, no tree, the same noise."""
    noise, ids = Noise(seed, "cpu"), list(prompt)
    with torch.no_grad():
        for position in range(n):
            ids.append(pick(model(torch.tensor([ids])).logits[0, -1], sampling, noise, position))
    return ids[len(prompt):]


def proposers(target, draft, head_dir) -> dict:
    """One proposer per method, built as methods.py builds them (tiny draft model, random EAGLE-3 head)."""
    from plugins.draft_model import DraftModelDrafter
    from graft_cli.heads import load_head
    from plugins.eagle3 import Eagle3Drafter
    from graft_cli.drafting.proposer import GraftProposer
    from graft_cli.core import PruneSchedule
    from plugins.adjacency import AdjacencyRetriever
    from plugins.prompt_lookup import PromptLookup

    vocab = target.config.vocab_size
    prune = PruneSchedule.parse("0:0.3,1:0.2")
    head = load_head(str(head_dir), target)
    return {
        "ar": GraftProposer(0),
        "pld": GraftProposer(10, [PromptLookup()]),
        "recycling": GraftProposer(10, [AdjacencyRetriever(vocab)]),
        "dense": GraftProposer(12, drafter=DraftModelDrafter(draft, vocab, 4, 3)),
        "pruned": GraftProposer(12, drafter=DraftModelDrafter(draft, vocab, 4, 3, prune)),
        "graft": GraftProposer(12, [PromptLookup(), AdjacencyRetriever(vocab)],
                               drafter=DraftModelDrafter(draft, vocab, 4, 3, prune)),
        "graft-budget-3": GraftProposer(3, [PromptLookup(), AdjacencyRetriever(vocab)],
                                        drafter=DraftModelDrafter(draft, vocab, 2, 2, prune)),
        "eagle3": GraftProposer(10, [PromptLookup()], drafter=Eagle3Drafter(head, target, depth=4, top_k=3, prune=prune)),
    }


IDENTITY_SETTINGS = [Sampling(temperature=1.0), Sampling(temperature=0.6), Sampling(temperature=1.5, top_k=5),
                     Sampling(temperature=0.9, top_p=0.8)]


def test_every_method_samples_the_same_text_as_plain_sampling(tmp_path):
    from tests.test_eagle3 import target_model, write_head

    target, draft = target_model("llama", seed=4), target_model("llama", seed=4)
    gen = torch.Generator().manual_seed(5)
    with torch.no_grad():  # a draft that agrees with the target often, not always
        for p in draft.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * 0.1)
    made = proposers(target, draft, write_head(tmp_path / "head", target, seed=1))
    accepted, differs = 0, False
    for i, sampling in enumerate(IDENTITY_SETTINGS):
        prompt = (np.random.default_rng(i).integers(0, 97, 6).tolist()) * 2
        for seed in (i, 100 + i):
            truth = plain_sampling(target, prompt, sampling, 30, seed)
            differs |= truth != plain_sampling(target, prompt, Sampling(), 30, 0)
            for name, proposer in made.items():  # proposers stay warm across prompts, as in a --jsonl session
                stats = Stats()
                got = [t for s in engine.decode(Target(target), proposer, prompt, sampling, 30, set(), seed, stats)
                       for t in s]
                assert got == truth, (name, sampling, seed)
                accepted += sum(n for source, n in stats.accepted.items() if source != "bonus")
    assert differs  # the settings really sample
    assert accepted > 50  # and the proposers really had tokens accepted


def test_noise_rows_depend_on_seed_and_position_only():
    a, b = Noise(3, "cpu"), Noise(3, "cpu")
    wide = a.at(torch.tensor([0, 4, 2]), 5, 5, 11)  # positions 5, 9, 7 first
    step = torch.cat([b.at(torch.tensor([0]), p, 1, 11) for p in range(10)])  # one position at a time
    assert torch.equal(wide, step[[5, 9, 7]])
    assert not torch.equal(Noise(4, "cpu").at(torch.tensor([0]), 0, 1, 11), Noise(3, "cpu").at(torch.tensor([0]), 0, 1, 11))
