"""graft's own forward for the model families the catalog serves (Llama, Qwen2), on a CPU; transformers runs every
other architecture and stays the reference the tests compare against. ``--forward own|transformers`` chooses
(docs/models.md, "The forward")."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from graft_cli.models.decoder import FUSED, CausalLM
from graft_cli.models.families import family
from graft_cli.models.four_bit import attach, four_bit_weights
from graft_cli.models.weights import read_weights

FORWARDS = ("auto", "own", "transformers")  # --forward; auto: own where it serves the model and has proven faster


def servable(config: Any, device: str, device_map: object) -> bool:
    """Whether graft's own forward can run this model: a served family, whole on a CPU."""
    return device == "cpu" and device_map is None and family(config) is not None


def own_model(config: Any, directory: Path, dtype: torch.dtype, generation: Any = None,
              four_bit: bool = False) -> CausalLM:
    """``config``'s model over the checkpoint in ``directory`` (memory-mapped; converted only where ``dtype``
    differs from the file's), ready for inference. ``generation``: its generation config (its stop tokens).
    ``four_bit``: the linears the directory keeps quantized run over them (graft_cli/models/four_bit.py)."""
    served = family(config)
    if served is None:
        raise ValueError(f"graft's own forward does not serve {getattr(config, 'model_type', None)} models")
    with torch.device("meta"):
        model = CausalLM(config, served)
    weights = read_weights(directory)
    if four_bit:
        kept = four_bit_weights(directory)
        if kept is None or not attach(model, weights, kept):
            raise ValueError(f"{directory} keeps no quantized weights")
    weights = stacked({name: tensor.to(dtype) if tensor.is_floating_point() else tensor
                       for name, tensor in weights.items()}, len(model.model.layers))
    if "lm_head.weight" not in weights and getattr(config, "tie_word_embeddings", False):
        weights["lm_head.weight"] = weights["model.embed_tokens.weight"]
    missing = model.load_state_dict(weights, strict=False, assign=True).missing_keys
    if missing:
        raise ValueError(f"the checkpoint lacks {len(missing)} tensors of the model, e.g. {missing[0]}")
    if getattr(config, "tie_word_embeddings", False):
        model.lm_head.weight = model.model.embed_tokens.weight
    model.generation_config = generation
    return model.eval().requires_grad_(False)


def stacked(weights: dict[str, torch.Tensor], layers: int) -> dict[str, torch.Tensor]:
    """The checkpoint's tensors with each layer's ``FUSED`` projections stacked into one (weights and biases)."""
    for i in range(layers):
        for fused, parts in FUSED.items():
            for kind in ("weight", "bias"):
                names = [f"model.layers.{i}.{part}.{kind}" for part in parts]
                if all(name in weights for name in names):
                    weights[f"model.layers.{i}.{fused}.{kind}"] = torch.cat([weights.pop(name) for name in names])
    return weights
