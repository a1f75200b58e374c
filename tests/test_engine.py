"""The lossless contract on tiny random models: greedy token identity, exact stops, KV compaction."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from graft_cli.runtime.engine import decode
from graft_cli.drafting.proposer import GraftProposer
from graft_cli.runtime.sampling import Sampling
from graft_cli.core import Stats, Tree
from graft_cli.runtime.target import Target
from tests.tiny import VOCAB, OracleTreeProposer, tiny_model


def run(model, proposer, prompt, n, sampling=Sampling(), stop=frozenset(), seed=0, stats=None):
    return [t for step in decode(Target(model), proposer, prompt, sampling, n, set(stop), seed, stats) for t in step]


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_ar_greedy_equals_transformers_generate(kind):
    model = tiny_model(kind, seed=1)
    for seed in range(3):
        prompt = torch.randint(0, VOCAB, (int(torch.randint(1, 30, ())),), generator=torch.Generator().manual_seed(seed)).tolist()
        hf = model.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=40)
        assert run(model, GraftProposer(0), prompt, 40) == hf[0, len(prompt) :].tolist()


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
@pytest.mark.parametrize("shape", ["mixed", "deep", "wide", "empty", "random"])
def test_random_trees_are_lossless_under_greedy(kind, shape):
    for seed in range(4):
        model = tiny_model(kind, seed=seed)
        prompt = np.random.default_rng(seed).integers(0, VOCAB, 12).tolist()
        truth = run(model, GraftProposer(0), prompt, 60)
        stats = Stats()
        got = run(model, OracleTreeProposer(truth, len(prompt), seed, shape), prompt, 60, stats=stats)
        assert got == truth
        if shape == "deep":
            assert stats.tau > 2  # the oracle paths really were accepted


def test_max_new_tokens_is_exact_even_when_a_long_path_is_accepted():
    model = tiny_model(seed=3)
    prompt = [1, 2, 3]
    truth = run(model, GraftProposer(0), prompt, 50)
    for n in (1, 2, 7, 13):
        got = run(model, OracleTreeProposer(truth, len(prompt), 0, "deep"), prompt, n)
        assert got == truth[:n]


def test_stops_at_stop_token_and_drops_what_follows():
    model = tiny_model(seed=4)
    prompt = [5, 6, 7]
    truth = run(model, GraftProposer(0), prompt, 40)
    stop = truth[10]
    first = truth.index(stop)
    got = run(model, OracleTreeProposer(truth, len(prompt), 0, "deep"), prompt, 40, stop={stop})
    assert got == truth[: first + 1]


def test_kv_compaction_matches_a_fresh_forward():
    model = tiny_model(seed=5)
    prompt = list(range(10, 30))
    truth = run(model, GraftProposer(0), prompt, 30)
    target = Target(model)
    proposer = OracleTreeProposer(truth, len(prompt), 1, "random")
    tokens = [t for step in decode(target, proposer, prompt, Sampling(), 30, set()) for t in step]
    # the cache holds everything but the last token; feeding it must give a fresh forward's logits
    logits = target.verify(tokens[-1], Tree()).logits[-1]
    fresh = model(torch.tensor([prompt + tokens])).logits[0, -1]
    torch.testing.assert_close(logits, fresh, atol=1e-4, rtol=1e-4)
    assert target.length == len(prompt) + len(tokens)
