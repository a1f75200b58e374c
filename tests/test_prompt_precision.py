"""The mixed mode (``--dtype mixed``, graft_cli/runtime/prompt_precision.py): a prompt's linear layers in bf16,
every step in fp32. What it rests on (a packed bf16 product gives a row the same bits whatever rows travel with
it) and what it promises (every method's greedy tokens and seeded text are plain decoding's in the same mode,
whatever the prompt's chunking or a prefix cache resumed), on tiny models and on the real default model."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from graft_cli.bench.synthetic import save_model_dir, word_tokenizer
from graft_cli.core import GraftError
from graft_cli.drafting.proposer import GraftProposer
from graft_cli.runtime.cpu_linear import CpuLinear, packed_product, use_cpu_linears
from graft_cli.runtime.loading import load_model
from graft_cli.runtime.prompt_precision import PROMPT_DTYPE, add_prompt_copies, prompt_layers, prompt_precision
from graft_cli.runtime.target import Target
from tests.test_kv_cache import tokens
from tests.tiny import VOCAB, OracleTreeProposer, tiny_model


def test_a_rows_bf16_product_does_not_depend_on_the_rows_beside_it():
    weight = torch.randn(96, 64, dtype=PROMPT_DTYPE, generator=torch.Generator().manual_seed(0))
    packed = torch.ops.mkldnn._reorder_linear_weight(weight, 8)
    x = torch.randn(300, 64, generator=torch.Generator().manual_seed(1)).to(PROMPT_DTYPE)
    whole = packed_product(x, packed, None, 96)
    for start, stop in ((0, 1), (5, 8), (17, 33), (100, 229), (299, 300)):
        assert torch.equal(packed_product(x[start:stop], packed, None, 96), whole[start:stop]), (start, stop)


def test_prompt_layers_switch_only_inside_the_prompt():
    model = tiny_model("llama", seed=2)
    use_cpu_linears(model)
    assert prompt_layers(model) == []  # fp32: nothing to switch
    add_prompt_copies(model)
    layers = prompt_layers(model)
    assert layers and all(isinstance(m, CpuLinear) for m in layers)
    x = torch.randn(5, model.config.hidden_size)
    layer = layers[0]
    plain = layer(x)
    with prompt_precision(layers):
        low = layer(x)
    assert low.dtype == torch.float32 and not torch.equal(low, plain)
    torch.testing.assert_close(low, plain, atol=0.05, rtol=0.05)
    assert torch.equal(layer(x), plain) and not any(m.in_prompt for m in layers)


def mixed_model(tmp_path, kind: str, seed: int):
    folder = save_model_dir(tmp_path / f"{kind}{seed}", tiny_model(kind, seed=seed, max_position_embeddings=1024),
                            word_tokenizer())
    return load_model(str(folder), "cpu", "mixed", forward="own").model


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_every_tree_and_chunking_gives_plain_decodings_tokens_in_the_mode(kind, tmp_path):
    model = mixed_model(tmp_path, kind, seed=4)
    assert prompt_layers(model)
    ids = np.random.default_rng(1).integers(0, VOCAB, 70).tolist()
    truth = tokens(Target(model), GraftProposer(0), ids, 40)
    for chunk, shape in ((16, "mixed"), (7, "deep"), (512, "random")):
        assert tokens(Target(model, chunk=chunk), OracleTreeProposer(truth, len(ids), 1, shape), ids, 40) == truth


def test_mixed_refuses_a_gpu_in_one_line():
    from graft_cli.runtime.loading import pick_dtype

    with pytest.raises(GraftError, match="CPU mode"):
        pick_dtype("mixed", "cuda")
    assert pick_dtype("mixed", "cpu") == torch.float32


@pytest.mark.real_model
def test_the_default_model_in_the_mixed_mode_from_a_cold_and_a_warm_cache():
    """SmolLM2: ar and graft, greedy and seeded, give the same tokens, and a prefix cache's resumed prompt rows
    give a cold request's tokens."""
    from graft_cli.api import Generator
    from graft_cli.method.config import configure

    loaded = load_model("smollm2-135m-instruct", "cpu", "mixed")
    system = {"role": "system", "content": "You answer questions about trains in two sentences. " * 12}
    asks = [[system, {"role": "user", "content": q}] for q in ("What is a sleeper train?", "Why are trains late?")]
    runs = (("ar", False), ("graft", False), ("graft", True))  # (method, prefix cache)
    for sampling in (dict(max_new_tokens=16), dict(max_new_tokens=16, temperature=0.8, seed=3)):
        answers = []
        for method, cache in runs:
            generator = Generator(loaded, configure(method), **({} if cache else dict(prefix_cache=0)))
            done = [generator.generate(messages=m, **sampling) for m in asks]
            answers.append([c.token_ids for c in done])
            assert (done[1].stats.cached_tokens > 100) == cache  # the system prompt's rows resumed
        assert answers[0] == answers[1] == answers[2], sampling
