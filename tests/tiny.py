"""Tiny randomly initialised Llama and Qwen2 models built from configs (no downloads), for engine tests.

A large initializer range makes their next-token distributions peaked, so greedy ties (which float noise between
batched and one-token forwards could flip) practically never occur.
"""

from __future__ import annotations

import torch
from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config

VOCAB = 97


def tiny_model(kind: str = "llama", seed: int = 0, vocab: int = VOCAB, init: float = 0.3):
    torch.manual_seed(seed)
    common = dict(
        vocab_size=vocab,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        initializer_range=init,
        tie_word_embeddings=False,
        attn_implementation="sdpa",
        bos_token_id=None,
        eos_token_id=None,  # no stop token unless a test asks for one
        pad_token_id=None,
    )
    config = LlamaConfig(**common) if kind == "llama" else Qwen2Config(**common, use_sliding_window=False)
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()


class StaticProposer:
    """Base of test proposers whose trees come from ``propose`` alone: they learn nothing from verification."""

    wants_hidden = False

    def start(self, prompt, prefill) -> None:
        pass

    def observe(self, step) -> None:
        pass


def tiny_smollm2(layers: int = 1):
    """A random Llama, 32 wide, with SmolLM2's vocabulary, and the real SmolLM2 tokenizer (its chat template)."""
    from transformers import AutoTokenizer

    from graft_cli.catalog import resolve_model

    tokenizer = AutoTokenizer.from_pretrained(resolve_model("smollm2-135m-instruct"))
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=49152, hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=2048,
                         initializer_range=0.3, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2,
                         pad_token_id=2)
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32), tokenizer
