"""The tiny models and test proposers the engine tests use; they live in graft_cli/bench/synthetic.py so that
benchmarks/gpu_check.py builds the same ones without importing from tests/."""

import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from graft_cli.bench.synthetic import VOCAB, OracleTreeProposer, StaticProposer, tiny_model

__all__ = ["VOCAB", "OracleTreeProposer", "StaticProposer", "tiny_model", "tiny_smollm2"]


def tiny_smollm2(layers: int = 1):
    """A random Llama, 32 wide, with SmolLM2's vocabulary, and the real SmolLM2 tokenizer (its chat template)."""
    from transformers import AutoTokenizer

    from graft_cli.catalog.resolve import resolve_model

    tokenizer = AutoTokenizer.from_pretrained(resolve_model("smollm2-135m-instruct"))
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=49152, hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=2048,
                         initializer_range=0.3, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2,
                         pad_token_id=2)
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32), tokenizer
