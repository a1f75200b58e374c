"""The model families graft's own forward serves, and what tells them apart: which projections carry a bias.

A config is served only when everything the forward does not model is absent: default rotary positions (no
scaling), no sliding window, SiLU activations. Anything else loads through transformers, the fallback for every
architecture and the reference the tests compare against.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

Flag = Callable[[Any], bool]


@dataclass(frozen=True)
class Family:
    qkv_bias: Flag  # the query, key and value projections
    out_bias: Flag  # the attention's output projection
    mlp_bias: Flag

    @staticmethod
    def rope_theta(config: Any) -> float:
        return float(rope(config).get("rope_theta", 10000.0))


FAMILIES = {
    "llama": Family(qkv_bias=lambda c: bool(c.attention_bias), out_bias=lambda c: bool(c.attention_bias),
                    mlp_bias=lambda c: bool(c.mlp_bias)),
    "qwen2": Family(qkv_bias=lambda c: True, out_bias=lambda c: False, mlp_bias=lambda c: False),
}


def rope(config: Any) -> dict:
    """The config's rotary parameters (``rope_parameters`` in transformers 5, else the older fields)."""
    return dict(getattr(config, "rope_parameters", None) or {"rope_theta": getattr(config, "rope_theta", 10000.0),
                                                             **(getattr(config, "rope_scaling", None) or {})})


def family(config: Any) -> Family | None:
    """The family that serves ``config``, or None (transformers then runs it)."""
    served = FAMILIES.get(getattr(config, "model_type", None))
    if served is None or rope(config).get("rope_type", "default") != "default":
        return None
    if getattr(config, "hidden_act", "silu") != "silu" or getattr(config, "use_sliding_window", False):
        return None
    types = set(getattr(config, "layer_types", None) or ["full_attention"])
    return served if types == {"full_attention"} else None
