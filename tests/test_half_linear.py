"""A draft model's half-precision linears: the product over fp16-rounded weights, a copy that leaves the loaded
model as it was, and drafting through it that stays lossless; ``--draft-weights`` wired and checked."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch.nn import functional as F

from graft_cli.core import DraftSettings, GraftError, Stats
from graft_cli.method import builder as methods
from graft_cli.method.config import draft_weights_for
from graft_cli.runtime.cpu_linear import CpuLinear, use_cpu_linears
from plugins import draft_model
from plugins.draft_model import DraftModelDrafter, draft_vocab
from graft_cli.drafting.proposer import GraftProposer
from graft_cli.runtime.half_linear import HalfLinear, half_available, half_copy
from graft_cli.method.builder import MethodConfig
from tests.test_drafters import run, similar_draft, tiny_loaded
from tests.tiny import VOCAB, tiny_model

pytestmark = pytest.mark.skipif(not half_available(), reason="this torch build has no FBGEMM fp16 linear")


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("packed", [False, True])  # from a plain nn.Linear, and from a oneDNN-packed CpuLinear
def test_a_half_linear_gives_the_product_over_fp16_rounded_weights(bias, packed):
    torch.manual_seed(0)
    layer = torch.nn.Linear(96, 200, bias=bias)
    if packed:
        use_cpu_linears(layer, pack=True)
    twin = half_copy(torch.nn.Sequential(layer))[0]
    assert type(twin) is HalfLinear and "packed" not in twin.__dict__
    for rows in (0, 1, 3, 4, 17):
        x = torch.randn(1, rows, 96)
        want = F.linear(x, layer.weight.half().float(), layer.bias)
        torch.testing.assert_close(twin(x), want, rtol=1e-5, atol=1e-5)


def test_the_half_copy_shares_every_tensor_and_leaves_the_model_as_it_was():
    model = tiny_model(seed=3)
    model.lm_head.weight = model.model.embed_tokens.weight
    use_cpu_linears(model, pack=True)
    ids = torch.tensor([[1, 5, 9, 2]])
    before = model(ids).logits
    twin = half_copy(model)
    assert all(type(m) is CpuLinear and m.packed is not None for m in model.modules() if isinstance(m, torch.nn.Linear))
    assert all(type(m) is HalfLinear for m in twin.modules() if isinstance(m, torch.nn.Linear))
    assert {p.data_ptr() for p in twin.parameters()} <= {p.data_ptr() for p in model.parameters()}
    assert twin.lm_head.weight is twin.model.embed_tokens.weight is model.model.embed_tokens.weight
    assert torch.equal(model(ids).logits, before)
    torch.testing.assert_close(twin(ids).logits, before, rtol=1e-2, atol=1e-2)  # fp16 weights: close, not equal


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
@pytest.mark.parametrize("reduced", [False, True])
def test_a_half_weight_draft_stays_lossless(kind, reduced):
    accepted = 0
    for seed in range(2):
        target, draft = similar_draft(kind, seed)
        vocab = draft_vocab(None, VOCAB, 48) if reduced else None
        drafter = DraftModelDrafter(half_copy(draft), VOCAB, depth=5, top_k=3, vocab=vocab)
        if reduced:
            assert type(drafter.cache.head) is HalfLinear  # the sliced head runs on the same kernel
        prompt = np.random.default_rng(seed).integers(0, VOCAB, 12).tolist()
        stats = Stats()
        assert run(target, GraftProposer(12, drafter=drafter), prompt, 40, stats) == run(target, GraftProposer(0),
                                                                                         prompt, 40)
        accepted += stats.accepted["draft"]
    assert accepted > 0


def test_draft_weights_default_to_fp16_on_a_cpu_and_are_checked(monkeypatch):
    assert draft_weights_for("cpu") == "fp16" and draft_weights_for("cuda") == "full"
    seen = []
    import graft_cli.runtime.loading

    monkeypatch.setattr(graft_cli.runtime.loading, "load_model", lambda spec, device, dtype: tiny_loaded(tiny_model(seed=2)))
    real_make = draft_model.make

    def make(env):
        seen.append(env.settings.draft_weights)
        return real_make(env)
    monkeypatch.setattr(methods, "load_drafter", lambda kind, env: make(env))
    loaded = tiny_loaded(tiny_model(seed=1))
    p = methods.build(MethodConfig("dense", 8, draft="d"), loaded)
    assert seen[-1] == "fp16" and type(p.drafter.cache.model.lm_head) is HalfLinear
    p = methods.build(MethodConfig("dense", 8, draft="d", drafting=DraftSettings(draft_weights="full")), loaded)
    assert seen[-1] == "full" and type(p.drafter.cache.model.lm_head) is not HalfLinear
    with pytest.raises(GraftError, match="--draft-weights must be one of fp16, full"):
        methods.build(MethodConfig("dense", 8, draft="d", drafting=DraftSettings(draft_weights="int4")), loaded)
    monkeypatch.setattr(draft_model, "half_available", lambda: False)
    with pytest.raises(GraftError, match="no FBGEMM"):
        methods.build(MethodConfig("dense", 8, draft="d", drafting=DraftSettings(draft_weights="fp16")), loaded)
