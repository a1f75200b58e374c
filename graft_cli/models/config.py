"""A served family's config.json and generation_config.json read as plain JSON, without transformers.

Why: transformers' ``AutoConfig`` imports its model machinery (about a second and a half on a 2-core EPYC) before
a weight is read, and graft's own forward reads only a dozen numbers of it. The rule that keeps this exact: a
config is read here only when its ``model_type`` is a family the own forward serves and every field the forward
and graft's limits read is in the file or has the default transformers gives it for that family; anything else
(another architecture, a quantized checkpoint, a sliding window) is None, and transformers reads it.
tests/test_light_loading.py compares these fields with ``AutoConfig``'s for the catalog's models.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from graft_cli.models.families import FAMILIES

REQUIRED = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
            "max_position_embeddings", "rms_norm_eps")


@dataclass
class PlainConfig:
    """The fields of a Llama or Qwen2 config that graft reads, under transformers' names."""

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    max_position_embeddings: int
    rms_norm_eps: float
    rope_parameters: dict
    head_dim: int | None = None  # None: hidden_size // num_attention_heads
    hidden_act: str = "silu"
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    mlp_bias: bool = False
    layer_types: list[str] = field(default_factory=list)
    use_sliding_window: bool = False
    sliding_window: int | None = None
    _attn_implementation: str | None = None  # transformers' attention choice: none, the own forward attends itself


@dataclass(frozen=True)
class PlainGeneration:
    """What graft reads of a generation config: the tokens that end a generation."""

    eos_token_id: int | list[int] | None = None


def plain_config(directory: Path) -> PlainConfig | None:
    """``directory``'s config.json as a :class:`PlainConfig`, or None where transformers must read it (module
    docstring)."""
    try:
        raw = json.loads((directory / "config.json").read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(raw, dict) or raw.get("model_type") not in FAMILIES or "quantization_config" in raw:
        return None
    if any(not isinstance(raw.get(name), (int, float)) for name in REQUIRED) or raw.get("use_sliding_window"):
        return None
    if raw.get("rope_scaling") and not raw.get("rope_parameters"):  # an older file's scaling: transformers reads it
        return None
    rope = raw.get("rope_parameters") or {"rope_theta": raw.get("rope_theta", 10000.0)}
    heads = raw["num_attention_heads"]
    return PlainConfig(
        model_type=raw["model_type"], vocab_size=raw["vocab_size"], hidden_size=raw["hidden_size"],
        intermediate_size=raw["intermediate_size"], num_hidden_layers=raw["num_hidden_layers"],
        num_attention_heads=heads, num_key_value_heads=raw.get("num_key_value_heads") or heads,
        max_position_embeddings=raw["max_position_embeddings"], rms_norm_eps=float(raw["rms_norm_eps"]),
        rope_parameters={"rope_type": "default", **rope}, head_dim=raw.get("head_dim"),
        hidden_act=raw.get("hidden_act", "silu"), tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        attention_bias=bool(raw.get("attention_bias", False)), mlp_bias=bool(raw.get("mlp_bias", False)),
        layer_types=list(raw.get("layer_types") or ["full_attention"] * raw["num_hidden_layers"]))


def plain_generation(directory: Path) -> PlainGeneration | None:
    """The stop tokens of ``directory``'s generation_config.json (None where it has none)."""
    path = directory / "generation_config.json"
    if not path.exists():
        return None
    return PlainGeneration(json.loads(path.read_text()).get("eos_token_id"))
