"""vLLM's general plugin hook (entry point ``vllm.general_plugins``), run in every engine process: from vLLM 0.34
on it registers the speculative method ``graft``; under 0.32 and 0.33 ``custom_class`` names the proposer class
directly and there is nothing to register."""

from __future__ import annotations

from graft_vllm import METHOD, registers_methods


def register() -> None:
    if not registers_methods():
        return
    from vllm.v1.worker.gpu.spec_decode.speculator_config import register_speculative_method  # lazy: 0.34 on

    register_speculative_method(METHOD, "graft_vllm.speculator.GraftSpeculatorConfig")
