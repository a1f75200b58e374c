"""The preallocated, position-addressed KV cache and chunked prefill: same tokens and logits as the references."""

from __future__ import annotations

import inspect
import io

import numpy as np
import pytest
import torch

from plugins.draft_model import DraftModelDrafter
from graft_cli.runtime.engine import decode
from graft_cli.drafting.proposer import GraftProposer
from graft_cli.runtime.kv_cache import PositionCache, cache_keyword
from graft_cli.cli.prefill_bar import PrefillBar
from graft_cli.runtime.sampling import Sampling
from graft_cli.runtime.target import Target
from graft_cli.core import Tree
from tests.tiny import VOCAB, OracleTreeProposer, tiny_model


def tokens(target: Target, proposer, prompt: list[int], n: int) -> list[int]:
    return [t for step in decode(target, proposer, prompt, Sampling(), n, set(), 0) for t in step]


@pytest.mark.parametrize("length", [1, 9, 64, 300])
@pytest.mark.parametrize("chunk", [8, 512])
def test_plain_decoding_equals_generate_at_several_lengths(length, chunk):
    model = tiny_model("qwen2", seed=2, max_position_embeddings=1024)
    prompt = np.random.default_rng(length).integers(0, VOCAB, length).tolist()
    hf = model.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=30)[0, length:].tolist()
    assert tokens(Target(model, chunk=chunk), GraftProposer(0), prompt, 30) == hf


@pytest.mark.parametrize("length", [16, 200])
def test_random_trees_stay_lossless_over_a_long_context(length):
    model = tiny_model(seed=6, max_position_embeddings=1024)
    prompt = np.random.default_rng(length).integers(0, VOCAB, length).tolist()
    truth = tokens(Target(model), GraftProposer(0), prompt, 80)
    for seed in range(3):
        proposer = OracleTreeProposer(truth, len(prompt), seed, "random")
        assert tokens(Target(model, chunk=32), proposer, prompt, 80) == truth


def test_many_compactions_match_a_fresh_forward_and_never_reallocate():
    model = tiny_model(seed=7, max_position_embeddings=1024)
    prompt = np.random.default_rng(1).integers(0, VOCAB, 150).tolist()
    truth = tokens(Target(model), GraftProposer(0), prompt, 160)  # past the 120 asked: the last step may overshoot
    target = Target(model, chunk=40)
    steps = decode(target, OracleTreeProposer(truth, len(prompt), 2, "mixed"), prompt, Sampling(), 120, set(), 0)
    got = [*next(steps)]
    buffers = [layer.keys.data_ptr() for layer in target.cache.layers]
    for step in steps:
        got += step
    assert got == truth[:120]
    assert [layer.keys.data_ptr() for layer in target.cache.layers] == buffers  # reserved once, never regrown
    context = prompt + truth[: target.length - len(prompt) + 1]  # the cache holds all of it but the last token
    logits = target.verify(context[-1], Tree()).logits[-1]
    fresh = model(torch.tensor([context])).logits[0, -1]
    torch.testing.assert_close(logits, fresh, atol=1e-4, rtol=1e-4)


def test_the_draft_models_cache_is_reserved_once_per_request():
    """The draft model's cache is sized by the request like the target's (prompt, new tokens, tree room): drafting
    300 tokens past a short prompt never regrows it. It is reserved when the draft first reads the request (its
    first draft)."""
    model, draft = tiny_model(seed=7, max_position_embeddings=1024), tiny_model(seed=9, max_position_embeddings=1024)
    prompt = np.random.default_rng(2).integers(0, VOCAB, 20).tolist()
    drafter = DraftModelDrafter(draft, VOCAB, depth=4, top_k=3)
    steps = decode(Target(model), GraftProposer(12, drafter=drafter), prompt, Sampling(), 300, set(), 0)
    next(steps), next(steps)  # the first token, then the first drafted step's
    block = drafter.cache.cache.block
    assert block.shape[4] >= 20 + 300
    for _ in steps:
        pass
    assert drafter.cache.cache.block.data_ptr() == block.data_ptr()


def test_chunked_prefill_equals_one_shot():
    model = tiny_model(seed=8, max_position_embeddings=1024)
    prompt = np.random.default_rng(0).integers(0, VOCAB, 333).tolist()
    whole, seen = Target(model, chunk=10_000).prefill(prompt, hidden=True), []
    parts = Target(model, chunk=50, progress=lambda done, total: seen.append((done, total))).prefill(prompt, hidden=True)
    torch.testing.assert_close(parts.logits, whole.logits, atol=1e-5, rtol=1e-5)
    assert len(parts.hidden) == len(whole.hidden)
    for a, b in zip(parts.hidden, whole.hidden):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)  # float summation order only
    assert seen == [(0, 333)] + [(min(i + 50, 333), 333) for i in range(0, 333, 50)]


def test_a_cache_reserved_too_small_grows_and_keeps_its_rows():
    cache = PositionCache(1)
    cache.reserve(4)
    layer = cache.layers[0]
    rows = torch.arange(6.0).reshape(1, 1, 6, 1)
    layer.update(rows[:, :, :3], rows[:, :, :3])
    keys, _ = layer.update(rows[:, :, 3:], rows[:, :, 3:])
    assert keys.flatten().tolist() == list(range(6)) and layer.keys.shape[2] >= 8
    cache.keep(2, [1, 3])  # rows 3 and 5 move to 2 and 3
    assert layer.filled == 4 and layer.keys[0, 0, :4, 0].tolist() == [0, 1, 3, 5]



@pytest.mark.parametrize("shared", [True, False])
def test_one_block_holds_the_layers_that_fit_it_and_keep_moves_every_layer(shared):
    cache = PositionCache(3, shared=shared)
    cache.reserve(8)
    rows = torch.arange(5.0)
    shapes = [(1, 2, 5, 4), (1, 2, 5, 4), (1, 1, 5, 3)]  # the last layer's keys do not fit the first's block
    for layer, shape in zip(cache.layers, shapes):
        states = rows.reshape(1, 1, 5, 1).expand(shape).contiguous()
        layer.update(states, -states)
    assert (cache.block is not None) == shared
    assert [layer.own is not None for layer in cache.layers] == [not shared, not shared, True]
    cache.keep(1, [0, 1, 3])  # row 1 stays, rows 2 and 4 move to 2 and 3
    for layer in cache.layers:
        assert layer.filled == 4
        assert layer.keys[0, 0, :4, 0].tolist() == [0, 1, 2, 4]
        assert layer.values[0, -1, :4, -1].tolist() == [0, -1, -2, -4]

class _Terminal(io.StringIO):
    def __init__(self, tty: bool) -> None:
        super().__init__()
        self.tty = tty

    def isatty(self) -> bool:
        return self.tty


@pytest.mark.parametrize("tty", [True, False])
def test_the_prefill_bar_draws_only_on_a_terminal_and_only_when_slow(tty):
    for delay, drawn in ((0.0, tty), (60.0, False)):
        stream = _Terminal(tty)
        bar = PrefillBar(delay, stream)
        for done in (0, 100, 200, 300):
            bar(done, 300)
        assert bool(stream.getvalue()) == drawn and bar.bar is None


@pytest.mark.real_model
def test_smollm2_over_a_long_prompt_decodes_what_generate_does():
    """SmolLM2 on 1.5K tokens of real source: chunked prefill and the position cache give generate's tokens."""
    import inspect as source

    from graft_cli.runtime.loading import load_model

    loaded = load_model("smollm2-135m-instruct", device="cpu")
    ids = loaded.tokenizer.encode(source.getsource(source))[:1500]
    hf = loaded.model.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=24)[0, len(ids) :].tolist()
    whole = Target(loaded.model, chunk=2048).prefill(ids).logits[-1]
    assert (Target(loaded.model, chunk=512).prefill(ids).logits[-1] - whole).abs().max() < 1e-3
    assert tokens(Target(loaded.model, chunk=512), GraftProposer(0), ids, 24) == hf


def test_the_cache_goes_in_under_the_keyword_the_forward_takes():
    """transformers renamed ``past_key_values`` to ``cache`` within 5.x; the other name would be swallowed by
    ``**kwargs`` and the model would run without its cache (what the first CUDA run met, on transformers 5.17)."""

    class Old(torch.nn.Module):
        def forward(self, input_ids=None, past_key_values=None, use_cache=None, **kwargs):
            return input_ids

    class New(torch.nn.Module):
        def forward(self, input_ids=None, cache=None, use_cache=None, **kwargs):
            return input_ids

    assert cache_keyword(Old()) == "past_key_values"
    assert cache_keyword(New()) == "cache"
    model = tiny_model()
    assert cache_keyword(model) in inspect.signature(model.forward).parameters
    target = Target(model)
    assert target.cached == {cache_keyword(model): target.cache}
