"""The layouts EAGLE-3 heads are published in, read into one ``HeadConfig`` and one set of tensor names.

Two layouts, told apart by ``speculators_model_type`` in config.json (docs/heads.md has the keys in full):

- **EAGLE** (the EAGLE authors' ``yuhuili/EAGLE3-*``, SpecForge's exports, SGLang's copies): a LlamaConfig of the
  head's one layer; ``draft_vocab_size``, ``target_hidden_size``, ``eagle_config.eagle_aux_hidden_state_layer_ids``
  (or top level: the *outputs* of those decoder layers, as SGLang and SpecForge capture them), SpecForge's
  ``fc_norm`` and ``norm_output``. Tensors ``midlayer.*``, ``fc``, ``norm``, ``lm_head``, ``d2t``, ``t2d``.
- **speculators** (vLLM's format, ``RedHatAI/*speculator.eagle3``): ``speculators_model_type: "eagle3"``, the layer
  in ``transformer_layer_config`` (llama, or qwen3 with its per-head ``q_norm``/``k_norm``), and at top level
  ``draft_vocab_size``, ``target_hidden_size``, ``eagle_aux_hidden_state_layer_ids`` (the *inputs* of those
  layers, as vLLM captures them), ``norm_before_residual`` (missing: true, as vLLM reads it), ``norm_before_fc``,
  ``fc_norm``, ``norm_output``. Tensors ``layers.0.*`` instead of ``midlayer.*``, often ``embed_tokens``.

Whatever the layout, ``midlayer.*`` is the name inside graft, and a head that does not fit its target fails here
with one line naming the number that differs.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from graft_cli.core import GraftError

ACTIVATIONS = {"silu": F.silu, "gelu": F.gelu, "relu": F.relu}
LAYER_PREFIX = re.compile(r"(?:layers|midlayers)\.(\d+)\.")


@dataclass
class HeadConfig:
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    draft_vocab: int
    rope_theta: float
    eps: float
    act: str
    rope_scaling: dict | None = None  # {"rope_type": "llama3" | "linear" | "default", "factor": ..., ...}
    layers: tuple[int, ...] | None = None  # entries of the target's hidden_states tuple; None: layer_indices
    target_hidden: int | None = None  # the width of each fused target feature, where the config says it
    fc_norm: bool = False  # an RMSNorm of each fused feature before fc (fc_norm.{i}.weight)
    input_norm: bool = False  # one RMSNorm of the concatenated features before fc (input_norm.weight)
    qk_norm: bool = False  # an RMSNorm of every query and key head before RoPE (qwen3's q_norm, k_norm)
    norm_before_residual: bool = False  # the attention adds to hidden_norm(h) rather than to h
    norm_logits: bool = True  # lm_head reads norm(out); SpecForge's norm_output false: out itself
    feed_normed: bool = False  # the next draft level reads norm(out) (speculators' norm_output)
    attention_bias: bool = False  # q, k, v and o projections with biases
    mlp_bias: bool = False  # gate, up and down projections with biases


def layer_indices(num_layers: int) -> tuple[int, int, int]:
    """Which entries of the target's ``hidden_states`` tuple (inputs of decoder layers) the head fuses."""
    return 2, num_layers // 2, num_layers - 3


def head_layers(cfg: HeadConfig, num_layers: int) -> tuple[int, ...]:
    return cfg.layers if cfg.layers is not None else layer_indices(num_layers)


def feature_count(cfg: HeadConfig) -> int:
    """How many of the target's hidden states the head fuses (three unless its config names others)."""
    return len(cfg.layers) if cfg.layers is not None else 3


def expected_shapes(cfg: HeadConfig, target_hidden: int) -> dict[str, tuple[int, ...]]:
    """Every tensor the head needs, by its name inside graft (``midlayer.*``), with its shape."""
    h, q, kv, i = cfg.hidden, cfg.heads * cfg.head_dim, cfg.kv_heads * cfg.head_dim, cfg.intermediate
    n = feature_count(cfg)
    shapes = {
        "fc.weight": (h, n * target_hidden),
        "midlayer.input_layernorm.weight": (h,),
        "midlayer.hidden_norm.weight": (h,),
        "midlayer.post_attention_layernorm.weight": (h,),
        "midlayer.self_attn.q_proj.weight": (q, 2 * h),
        "midlayer.self_attn.k_proj.weight": (kv, 2 * h),
        "midlayer.self_attn.v_proj.weight": (kv, 2 * h),
        "midlayer.self_attn.o_proj.weight": (h, q),
        "midlayer.mlp.gate_proj.weight": (i, h),
        "midlayer.mlp.up_proj.weight": (i, h),
        "midlayer.mlp.down_proj.weight": (h, i),
        "norm.weight": (h,),
        "lm_head.weight": (cfg.draft_vocab, h),
    }
    if cfg.fc_norm:
        shapes.update({f"fc_norm.{k}.weight": (target_hidden,) for k in range(n)})
    if cfg.input_norm:
        shapes["input_norm.weight"] = (n * target_hidden,)
    if cfg.qk_norm:
        shapes.update({f"midlayer.self_attn.{p}_norm.weight": (cfg.head_dim,) for p in "qk"})
    for flag, part in ((cfg.attention_bias, ".self_attn."), (cfg.mlp_bias, ".mlp.")):
        if flag:
            shapes.update({name: shape for name, shape in bias_shapes(cfg).items() if part in name})
    return shapes


def bias_shapes(cfg: HeadConfig) -> dict[str, tuple[int, ...]]:
    """Every bias a head may carry: used where the file has it, required where the config says so."""
    h, q, kv, i = cfg.hidden, cfg.heads * cfg.head_dim, cfg.kv_heads * cfg.head_dim, cfg.intermediate
    sizes = {"self_attn.q_proj": q, "self_attn.k_proj": kv, "self_attn.v_proj": kv, "self_attn.o_proj": h,
             "mlp.gate_proj": i, "mlp.up_proj": i, "mlp.down_proj": h}
    return {"fc.bias": (h,), **{f"midlayer.{name}.bias": (size,) for name, size in sizes.items()}}


def read_config(root: Path, where: str) -> dict:
    try:
        raw = json.loads((root / "config.json").read_text())
    except FileNotFoundError:
        raise GraftError(f"{where}: no config.json") from None
    except (OSError, ValueError) as e:
        raise GraftError(f"{where}: config.json is unreadable ({str(e).splitlines()[0]})") from None
    if not isinstance(raw, dict):
        raise GraftError(f"{where}: config.json is not a JSON object")
    return raw


def head_config(raw: dict, target: torch.nn.Module, rope_theta: float | None, where: str) -> HeadConfig:
    """The head's shape and variant from its config.json, in either layout; the target's vocabulary fills what a
    head leaves out. ``rope_theta`` (an option) overrides the RoPE base."""
    num_layers = target.config.num_hidden_layers
    vocab = target.get_input_embeddings().weight.shape[0]
    try:
        if raw.get("speculators_model_type") is not None:
            cfg = _speculators(raw, rope_theta, num_layers, vocab, where)
        else:
            cfg = _eagle(raw, rope_theta, num_layers, vocab)
    except KeyError as e:
        raise GraftError(f"{where}: config.json lacks {e.args[0]}") from None
    except (TypeError, ValueError, AttributeError) as e:
        raise GraftError(f"{where}: config.json has a bad value ({e})") from None
    if cfg.heads % cfg.kv_heads:
        raise GraftError(f"{where}: {cfg.heads} attention heads do not split into {cfg.kv_heads} key/value heads")
    if cfg.act not in ACTIVATIONS:
        raise GraftError(f"{where}: unsupported hidden_act '{cfg.act}'")
    if num_layers < 3:
        raise GraftError(f"{where}: the target has {num_layers} layers; EAGLE-3 needs at least 3")
    return cfg


def _eagle(raw: dict, rope_theta: float | None, num_layers: int, vocab: int) -> HeadConfig:
    """The EAGLE authors' and SpecForge's config: the layer's keys at top level; configured layer ids name the
    outputs of those decoder layers (SpecForge's and SGLang's numbering), hence one past them in hidden_states."""
    ids = raw.get("eagle_aux_hidden_state_layer_ids")
    if ids is None:
        ids = (raw.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    own_vocab = int(raw.get("vocab_size") or vocab)
    return HeadConfig(**_layer(raw, rope_theta), vocab=own_vocab,
                      draft_vocab=int(raw.get("draft_vocab_size") or own_vocab),
                      layers=_layer_ids(ids, num_layers, shift=1), target_hidden=_optional_int(raw, "target_hidden_size"),
                      fc_norm=bool(raw.get("fc_norm")), norm_logits=raw.get("norm_output", True) is not False)


def _speculators(raw: dict, rope_theta: float | None, num_layers: int, vocab: int, where: str) -> HeadConfig:
    """vLLM's speculators config: the layer in ``transformer_layer_config``; configured layer ids name the inputs
    of those decoder layers (vLLM's numbering), which are hidden_states entries as they are."""
    kind = raw["speculators_model_type"]
    if kind != "eagle3":
        raise GraftError(f"{where}: a speculators '{kind}' model, not an EAGLE-3 head")
    layer = raw["transformer_layer_config"]
    if not isinstance(layer, dict):
        raise ValueError("transformer_layer_config must be an object")
    if int(layer.get("num_hidden_layers") or 1) != 1:
        raise GraftError(f"{where}: a head of {layer['num_hidden_layers']} decoder layers; graft runs one-layer heads")
    if (layer.get("layer_types") or ["full_attention"])[0] != "full_attention":
        raise GraftError(f"{where}: a head whose layer attends through a sliding window is not supported")
    own_vocab = int(layer.get("vocab_size") or vocab)
    return HeadConfig(**_layer(layer, rope_theta), vocab=own_vocab,
                      draft_vocab=int(raw.get("draft_vocab_size") or own_vocab),
                      layers=_layer_ids(raw.get("eagle_aux_hidden_state_layer_ids"), num_layers, shift=0),
                      target_hidden=_optional_int(raw, "target_hidden_size"), fc_norm=bool(raw.get("fc_norm")),
                      input_norm=bool(raw.get("norm_before_fc")), qk_norm=layer.get("model_type") == "qwen3",
                      norm_before_residual=raw.get("norm_before_residual", True) is not False,
                      feed_normed=bool(raw.get("norm_output")))


def _layer(d: dict, rope_theta: float | None) -> dict:
    """The fields of one decoder layer's config, as both layouts spell them."""
    hidden, heads = int(d["hidden_size"]), int(d["num_attention_heads"])
    theta, scaling = rope_config(d, rope_theta)
    return dict(hidden=hidden, heads=heads, kv_heads=int(d.get("num_key_value_heads") or heads),
                head_dim=int(d.get("head_dim") or hidden // heads), intermediate=int(d["intermediate_size"]),
                rope_theta=theta, eps=float(d.get("rms_norm_eps") or 1e-6), act=str(d.get("hidden_act") or "silu"),
                rope_scaling=scaling, attention_bias=bool(d.get("attention_bias")), mlp_bias=bool(d.get("mlp_bias")))


def _optional_int(d: dict, key: str) -> int | None:
    return None if d.get(key) is None else int(d[key])


def rope_config(raw: dict, rope_theta: float | None) -> tuple[float, dict | None]:
    """The RoPE base and scaling from a config: transformers-5 ``rope_parameters`` or the older top-level
    ``rope_theta`` + ``rope_scaling``; ``rope_theta`` (an option) overrides the base."""
    params = raw.get("rope_parameters")
    scaling = dict(params) if isinstance(params, dict) else raw.get("rope_scaling")
    base = (params or {}).get("rope_theta") if isinstance(params, dict) else None
    theta = float(rope_theta or base or raw.get("rope_theta") or 10000.0)
    if scaling is not None:
        if not isinstance(scaling, dict):
            raise ValueError("rope_scaling must be an object")
        scaling = dict(scaling)
        scaling.pop("rope_theta", None)
        kind = scaling.get("rope_type", scaling.get("type", "default"))
        needs = {"default": (), "linear": ("factor",),
                 "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")}
        if kind not in needs:
            raise ValueError(f"unsupported RoPE scaling '{kind}' (default, linear or llama3)")
        missing = [k for k in needs[kind] if scaling.get(k) is None]
        if missing:
            raise ValueError(f"{kind} RoPE scaling lacks {', '.join(missing)}")
        if kind == "default":
            scaling = None
    return theta, scaling


def _layer_ids(ids: object, num_layers: int, shift: int) -> tuple[int, ...] | None:
    """Configured decoder-layer ids as hidden_states indices (``shift`` 1: ids of layer outputs, 0: of inputs)."""
    if ids is None:
        return None
    if not isinstance(ids, list) or not ids or not all(isinstance(i, int) and 0 <= i < num_layers for i in ids):
        raise ValueError(f"eagle_aux_hidden_state_layer_ids must be layer ids in 0..{num_layers - 1}, got {ids}")
    return tuple(i + shift for i in ids)


def canonical_weights(weights: dict[str, torch.Tensor], where: str) -> dict[str, torch.Tensor]:
    """Tensor names as graft reads them: no ``model.`` prefix, the one decoder layer as ``midlayer.`` (speculators
    and vLLM call it ``layers.0.``). A head of more layers is refused: graft runs one-layer heads."""
    out, deeper = {}, set()
    for name, tensor in weights.items():
        key = name.removeprefix("model.")
        match = LAYER_PREFIX.match(key)
        if match:
            deeper.add(int(match[1]))
            key = "midlayer." + key[match.end():]
        out[key] = tensor
    if deeper - {0}:
        raise GraftError(f"{where}: a head of {max(deeper) + 1} decoder layers; graft runs one-layer heads")
    return out


def check_target(cfg: HeadConfig, weights: dict[str, torch.Tensor], target: torch.nn.Module, where: str) -> None:
    """Refuse a head made for another target, naming the number that differs: the target's hidden size (from
    ``target_hidden_size``, else the width ``fc`` reads) and its vocabulary (``vocab_size``, ``t2d``,
    ``embed_tokens``)."""
    hidden = target.config.hidden_size
    vocab = target.get_input_embeddings().weight.shape[0]
    n = feature_count(cfg)
    fc = weights.get("fc.weight")
    made_for = cfg.target_hidden
    if made_for is None and fc is not None and fc.dim() == 2 and fc.shape[1] % n == 0:
        made_for = fc.shape[1] // n
    if made_for is not None and made_for != hidden:
        raise GraftError(f"{where}: made for a target of hidden size {made_for}, but this target's hidden size is "
                         f"{hidden}")
    counts = {"vocab_size": cfg.vocab}
    if "t2d" in weights:
        counts["t2d"] = weights["t2d"].shape[0]
    if "embed_tokens.weight" in weights:
        counts["embed_tokens"] = weights["embed_tokens.weight"].shape[0]
    for source, count in counts.items():
        if count != vocab:
            raise GraftError(f"{where}: made for a vocabulary of {count} tokens ({source}), but this target's has "
                             f"{vocab}")
