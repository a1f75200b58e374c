"""The adapter for vLLM 0.32 and 0.33: a proposer class vLLM's ``custom_class`` method constructs by its dotted
path (``speculative_config={"method": "custom_class", "model": "graft_vllm.custom_class.GraftProposer"}``).

vLLM builds it with the engine's configuration and asks it, after every step, for one chain per batch row, handing
over the tokens each row sampled this step (the accepted draft tokens and the target's own), each row's token
count and the rows' tokens. That interface names no request, so :mod:`graft_vllm.rows` recognises requests by
their tokens; a request no row holds any more has finished, and its state is freed.
"""

from __future__ import annotations

from typing import Any, Sequence

from graft_vllm.chains import ChainProposer
from graft_vllm.engine import chain_proposer
from graft_vllm.rows import Rows


class GraftProposer:
    def __init__(self, vllm_config: Any) -> None:
        self.chains: ChainProposer = chain_proposer(vllm_config)
        self.rows = Rows()

    def load_model(self, model: Any) -> None:
        """Nothing to load (vLLM's CPU runner asks every drafter): graft drafts from its retrievers."""

    def propose(self, sampled_token_ids: Sequence[Sequence[int]], num_tokens_no_spec: Sequence[int],
                token_ids_cpu: Any, slot_mappings: Any = None) -> list[list[int]]:
        """One chain per row (empty: nothing worth verifying, or a row still reading its prompt)."""
        drafts: list[list[int]] = []
        self.chains.batch(len(sampled_token_ids))
        for row, sampled in enumerate(sampled_token_ids):
            if not len(sampled):  # a prompt read in chunks: nothing generated yet
                drafts.append([])
                continue
            length, tokens = int(num_tokens_no_spec[row]), token_ids_cpu[row]
            key, new = self.rows.claim(row, tokens, length, len(sampled))
            if new:
                drafts.append(self.chains.start(key, tokens[: length - len(sampled)], sampled))
            else:
                drafts.append(self.chains.step(key, sampled))
        for key in self.rows.gone():
            self.chains.finish(key)
        return drafts
