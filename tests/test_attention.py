"""Split attention (a visible prefix without a mask, the tail under it): the same outputs as SDPA over the full
mask, and the same tokens through the model."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from graft_cli.models import attention as split_kernel
from graft_cli.runtime import attention
from plugins.draft_model import DraftModelDrafter
from graft_cli.drafting.proposer import GraftProposer
from graft_cli.runtime.target import Target
from tests.test_kv_cache import tokens
from tests.tiny import VOCAB, OracleTreeProposer, tiny_model


class Grouped(torch.nn.Module):
    num_key_value_groups = 3
    is_causal = True


@pytest.mark.parametrize("tail", ["causal", "bool", "float"])
def test_split_equals_sdpa_over_the_full_mask(tail, monkeypatch):
    monkeypatch.setattr(split_kernel, "SPLIT_FROM", 1)
    gen = torch.Generator().manual_seed(0)
    rows, visible = 7, 40
    query = torch.randn(1, 6, rows, 16, generator=gen)
    key, value = (torch.randn(1, 2, visible + rows, 16, generator=gen) for _ in range(2))
    allowed = torch.ones(rows, visible + rows, dtype=torch.bool)
    allowed[:, visible:] = torch.rand(rows, rows, generator=gen) < 0.5
    allowed[:, visible:] |= torch.eye(rows, dtype=torch.bool)
    if tail == "causal":
        allowed[:, visible:] = torch.ones(rows, rows, dtype=torch.bool).tril()
    mask = allowed[None, None]
    if tail == "float":
        mask = torch.zeros(mask.shape).masked_fill_(~mask, torch.finfo(torch.float32).min)
    want, _ = sdpa_attention_forward(Grouped(), query, key, value, mask, scaling=0.25)
    got, _ = attention.split_attention(Grouped(), query, key, value, None if tail == "causal" else mask,
                                       scaling=0.25, visible=visible)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_without_visible_or_below_the_threshold_it_is_sdpa():
    query = torch.randn(1, 6, 5, 16)
    key = value = torch.randn(1, 2, 30, 16)
    want, _ = sdpa_attention_forward(Grouped(), query, key, value, None)
    for visible in (None, 25):  # 25 < SPLIT_FROM
        got, _ = attention.split_attention(Grouped(), query, key, value, None, visible=visible)
        assert torch.equal(got, want)


def test_a_sliding_window_model_keeps_sdpa():
    model = tiny_model("qwen2", use_sliding_window=True, sliding_window=16, max_window_layers=0)
    assert not attention.use_split_attention(model) and model.config._attn_implementation == "sdpa"


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_trees_and_chunks_through_the_split_decode_what_plain_decoding_does(kind, monkeypatch):
    """Every verification and every prefill chunk past the first takes the split (threshold lowered), for the
    target and a draft model alike; the tokens are those of one-row decoding."""
    model, draft = tiny_model(kind, seed=3), tiny_model(kind, seed=4)
    prompt = np.random.default_rng(5).integers(0, VOCAB, 90).tolist()
    truth = tokens(Target(model), GraftProposer(0), prompt, 60)
    monkeypatch.setattr(split_kernel, "SPLIT_FROM", 8)
    assert tokens(Target(model, chunk=32), OracleTreeProposer(truth, len(prompt), 1, "mixed"), prompt, 60) == truth
    drafter = DraftModelDrafter(draft, VOCAB, depth=4, top_k=3)
    assert tokens(Target(model, chunk=32), GraftProposer(12, drafter=drafter), prompt, 60) == truth
    assert model.config._attn_implementation == draft.config._attn_implementation == attention.NAME
