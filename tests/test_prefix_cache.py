"""The prefix cache (graft_cli/runtime/prefix_cache.py): the radix tree's matching, splitting and LRU eviction on a
tiny random target; every method served from a warm cache gives a cold cache's tokens, greedy and sampled, eager
and at fixed shapes, sharded by a device map; a drafter's own rows are restored as it would have computed them."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from graft_cli.bench.runners import shared_models
from graft_cli.bench.synthetic import method_configs, synthetic_models
from graft_cli.core import Stats
from graft_cli.drafting.proposer import GraftProposer
from graft_cli.method import builder as methods
from graft_cli.method.config import configure
from graft_cli.runtime.engine import decode
from graft_cli.runtime.fixed_target import FixedShapeTarget
from graft_cli.runtime.loading import load_model
from graft_cli.runtime.prefix_cache import PrefixCache, prefix_cache_for
from graft_cli.runtime.sampling import Sampling
from graft_cli.runtime.target import Target
from plugins.draft_model import DraftModelDrafter
from plugins.eagle3 import Eagle3Drafter
from graft_cli.heads import load_head
from tests.tiny import VOCAB, tiny_model

SAMPLINGS = {"greedy": Sampling(), "sampled": Sampling(temperature=0.8, top_k=8, top_p=0.95)}


def run(target, proposer, prompt, prefix=None, sampling=Sampling(), n=24, seed=3):
    stats = Stats()
    out = [t for s in decode(target, proposer, prompt, sampling, n, set(), seed, stats, prefix=prefix) for t in s]
    return out, stats


def conversation(seed: int = 0) -> list[list[int]]:
    """A shared beginning (a system prompt), two requests after it, and the first again."""
    rng = np.random.default_rng(seed)
    system = rng.integers(0, VOCAB, 40).tolist()
    a, b = (system + rng.integers(0, VOCAB, 6).tolist() for _ in range(2))
    return [a, b, a, system[:20]]


def test_a_shared_beginning_is_matched_to_the_token_and_stored_once():
    model = tiny_model(seed=1, max_position_embeddings=1024)
    target = Target(model)
    cache = PrefixCache(2**30, target)
    first, second, again, short = conversation()
    _, cold = run(target, GraftProposer(0), first, cache)
    assert cold.cached_tokens == 0 and cache.nodes == 1
    out, stats = run(target, GraftProposer(0), second, cache)
    assert stats.cached_tokens == 40  # the system prompt, not the first request's own tokens
    assert cache.nodes == 3  # split where they differ: the system prompt and two branches
    held = cache.bytes
    _, stats = run(target, GraftProposer(0), again, cache)
    assert stats.cached_tokens == len(again) - 1  # all but the last token, whose forward gives the first token
    assert cache.bytes == held  # the same request again: nothing new to keep
    _, stats = run(target, GraftProposer(0), short, cache)
    assert stats.cached_tokens == 19
    assert cache.totals.hits == 3 and cache.totals.lookups == 4


def test_least_recently_used_leaves_go_first_within_the_budget():
    model = tiny_model(seed=1, max_position_embeddings=1024)
    target = Target(model)
    rng = np.random.default_rng(5)
    prompts = [rng.integers(0, VOCAB, 30).tolist() for _ in range(3)]
    probe = PrefixCache(2**30, target)
    run(target, GraftProposer(0), prompts[0], probe, n=4)
    one = probe.bytes  # one request's rows
    cache = PrefixCache(int(2.5 * one), target)
    for prompt in prompts[:2]:
        run(target, GraftProposer(0), prompt, cache, n=4)
    run(target, GraftProposer(0), prompts[0], cache, n=4)  # the first is used again: the second is older now
    run(target, GraftProposer(0), prompts[2], cache, n=4)
    assert cache.bytes <= cache.budget and cache.totals.evicted == 1
    assert run(target, GraftProposer(0), prompts[0], cache, n=4)[1].cached_tokens == 29
    assert run(target, GraftProposer(0), prompts[1], cache, n=4)[1].cached_tokens == 0


def test_a_zero_budget_is_off_and_a_negative_one_is_refused():
    from graft_cli.core import GraftError

    assert prefix_cache_for(0, None) is None
    with pytest.raises(GraftError, match="0 \\(off\\) or more MiB"):
        prefix_cache_for(-1, None)


@pytest.fixture(scope="module")
def synthetic(tmp_path_factory):
    root = tmp_path_factory.mktemp("prefix")
    target_dir, head = synthetic_models(root, layers=4)
    loaded = load_model(str(target_dir), "cpu", "float32")
    configs = {name: replace(config, curve="cpu") for name, config in method_configs(target_dir, head, None, 4).items()}
    configs["graft-eagle3"] = replace(configure("graft", draft=f"eagle3:{head}", depth=4), curve="cpu")
    return loaded, configs


@pytest.mark.parametrize("fixed, sampling", [(False, "greedy"), (False, "sampled"), (True, "sampled")])
def test_every_method_from_a_warm_cache_gives_the_cold_caches_tokens(synthetic, sampling, fixed):
    loaded, configs = synthetic
    sampling = SAMPLINGS[sampling]
    make = FixedShapeTarget if fixed else Target
    with shared_models(loaded):
        for name, config in configs.items():
            target = make(loaded.model)
            proposer = methods.build(config, loaded, target)
            cache = PrefixCache(2**30, target, proposer.drafter)
            requests = conversation()
            answer, _ = run(target, proposer, requests[0], cache, sampling)
            requests.append(requests[0] + answer + [5, 6, 7])  # a chat's next turn resends the answer
            hits = 0
            for prompt in requests:
                cold, _ = run(Target(loaded.model), methods.build(config, loaded), prompt, None, sampling)
                warm, stats = run(target, proposer, prompt, cache, sampling)
                assert warm == cold, name
                hits += stats.cached_tokens > 0
            assert hits == len(requests), name


def test_a_drafters_restored_rows_draft_what_its_own_would():
    """With the same requests in the same order, a drafter resumed from the cache drafts the trees it drafts
    reading every prompt itself: the same accepted lengths, step by step (a draft model and an EAGLE-3 head)."""
    import tempfile
    from pathlib import Path

    from tests.test_eagle3 import target_model, write_head

    model = target_model(seed=2)
    with tempfile.TemporaryDirectory() as tmp:
        head_dir = write_head(Path(tmp) / "h", model, seed=1)
        drafters = {"model": lambda: DraftModelDrafter(tiny_model("llama", seed=5), VOCAB, depth=4, top_k=2),
                    "eagle3": lambda: Eagle3Drafter(load_head(str(head_dir), model), model, depth=4, top_k=2)}
        for name, make in drafters.items():
            lengths = []
            for use in (False, True):
                drafter, resumed = make(), []
                resume = drafter.resume
                drafter.resume = lambda rows: (resumed.append(rows), resume(rows))
                target, proposer = Target(model), GraftProposer(8, drafter=drafter)
                cache = PrefixCache(2**30, target, drafter) if use else None
                seen = []
                for prompt in conversation(seed=4):
                    seen.append(run(target, proposer, prompt, cache)[1].accept_lengths)
                lengths.append(seen)
            assert lengths[0] == lengths[1], name
            assert resumed[1:] == [40 - drafter.lag, 45, 19], name  # the system prompt, a repeat, a beginning


def test_a_sharded_target_resumes_its_own_blocks(tmp_path):
    from graft_cli.bench.synthetic import save_model_dir, word_tokenizer

    model_dir = save_model_dir(tmp_path / "tiny", tiny_model("llama", seed=2), word_tokenizer())
    placed = {"model.embed_tokens": "cpu", "model.layers.0": "cpu", "model.layers.1": "disk", "model.norm": "cpu",
              "model.rotary_emb": "cpu", "lm_head": "cpu"}
    sharded = load_model(str(model_dir), "cpu", "float32", device_map=placed)
    whole = load_model(str(model_dir), "cpu", "float32")
    target = Target(sharded.model)
    assert not target.cache.shared
    cache = PrefixCache(2**30, target)
    for prompt in conversation(seed=2):
        warm, stats = run(target, GraftProposer(0), prompt, cache)
        assert warm == run(Target(whole.model), GraftProposer(0), prompt)[0]
    assert cache.totals.hits == 3
