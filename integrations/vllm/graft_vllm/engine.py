"""What both vLLM adapters share: the chain proposer made from an engine's configuration and graft's settings."""

from __future__ import annotations

from typing import Any, Mapping

from graft_vllm import settings
from graft_vllm.chains import ChainProposer


def chain_proposer(vllm_config: Any, given: Mapping[str, Any] | None = None) -> ChainProposer:
    """The proposer for the engine ``vllm_config`` describes: its tokenizer (a datastore is checked against it),
    its vocabulary, its ``num_speculative_tokens`` as the longest chain and its ``max_model_len``."""
    from transformers import AutoTokenizer  # vLLM's own dependency: loaded in the engine's process only

    model = vllm_config.model_config
    tokenizer = AutoTokenizer.from_pretrained(model.tokenizer, trust_remote_code=model.trust_remote_code)
    limit = vllm_config.speculative_config.num_speculative_tokens
    return ChainProposer(settings.read(given=given), model.get_vocab_size(), tokenizer, limit, model.max_model_len)
