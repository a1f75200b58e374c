"""EAGLE-3 draft heads: one decoder layer that drafts from the target's own hidden states.

The head reads the target's hidden states at the inputs of decoder layers ``2, N//2, N-3`` (indices of
transformers' ``hidden_states`` tuple), concatenated low | mid | high and fused by ``fc`` to its width. Row ``t``
of the head pairs the target's features at position ``t`` with the token at ``t + 1`` (so draft positions are
target positions minus one) and predicts the token at ``t + 2``; deeper tree levels feed the head's own output
instead of fused target features. Its logits cover a reduced draft vocabulary; ``d2t`` maps draft id ``d`` to
target id ``d + d2t[d]``.

:func:`load_head` reads a head directory (``config.json`` + ``model.safetensors`` or ``pytorch_model.bin``, the
keys of SpecForge's and the EAGLE authors' heads) and checks it against the target before anything runs.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from graft_cli.core import GraftError
from graft_cli.heads.names import resolve_head
from graft_cli.runtime.attention_kernels import attention_kernels
from graft_cli.runtime.kv_cache import PositionCache
from graft_cli.runtime.target import on

WEIGHT_FILES = ("model.safetensors", "pytorch_model.bin")
ACTIVATIONS = {"silu": F.silu, "gelu": F.gelu, "relu": F.relu}


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


def layer_indices(num_layers: int) -> tuple[int, int, int]:
    """Which entries of the target's ``hidden_states`` tuple (inputs of decoder layers) the head fuses."""
    return 2, num_layers // 2, num_layers - 3


def head_layers(cfg: HeadConfig, num_layers: int) -> tuple[int, ...]:
    return cfg.layers if cfg.layers is not None else layer_indices(num_layers)


def rope_frequencies(cfg: HeadConfig, device: torch.device | str) -> torch.Tensor:
    """RoPE inverse frequencies, with the scaling a head was trained with (Llama-3.1 heads use ``llama3``)."""
    half = torch.arange(0, cfg.head_dim, 2, dtype=torch.float32, device=device) / cfg.head_dim
    inv_freq = 1.0 / (cfg.rope_theta**half)
    scaling = cfg.rope_scaling or {}
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "linear":
        return inv_freq / float(scaling["factor"])
    if kind == "llama3":
        factor, low, high = float(scaling["factor"]), float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
        original = float(scaling["original_max_position_embeddings"])
        wavelen = 2 * math.pi / inv_freq
        smooth = (original / wavelen - low) / (high - low) if high != low else torch.zeros_like(inv_freq)
        mid = (1 - smooth) * inv_freq / factor + smooth * inv_freq
        return torch.where(wavelen < original / high, inv_freq, torch.where(wavelen > original / low, inv_freq / factor, mid))
    return inv_freq


def _rope_config(raw: dict, rope_theta: float | None) -> tuple[float, dict | None]:
    """The RoPE base and scaling from a head's config: transformers-5 ``rope_parameters`` or the older
    top-level ``rope_theta`` + ``rope_scaling``; ``rope_theta`` (an option) overrides the base."""
    params = raw.get("rope_parameters")
    scaling = dict(params) if isinstance(params, dict) else raw.get("rope_scaling")
    base = (params or {}).get("rope_theta") if isinstance(params, dict) else None
    theta = float(rope_theta or base or raw.get("rope_theta") or 10000.0)
    if scaling is not None:
        if not isinstance(scaling, dict):
            raise ValueError("rope_scaling must be an object")
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


def _aux_layers(raw: dict, num_layers: int) -> tuple[int, ...] | None:
    """``eagle_aux_hidden_state_layer_ids`` (outputs of those decoder layers) as hidden_states indices."""
    ids = raw.get("eagle_aux_hidden_state_layer_ids")
    if ids is None:
        ids = (raw.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    if ids is None:
        return None
    if not isinstance(ids, list) or len(ids) != 3 or not all(isinstance(i, int) and 0 <= i < num_layers for i in ids):
        raise ValueError(f"eagle_aux_hidden_state_layer_ids must be 3 layer ids in 0..{num_layers - 1}, got {ids}")
    return tuple(i + 1 for i in ids)


def expected_shapes(cfg: HeadConfig, target_hidden: int) -> dict[str, tuple[int, ...]]:
    h, q, kv, i = cfg.hidden, cfg.heads * cfg.head_dim, cfg.kv_heads * cfg.head_dim, cfg.intermediate
    return {
        "fc.weight": (h, 3 * target_hidden),
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


class Eagle3Head:
    """The head's weights and one forward over its own KV cache (plain tensors; nothing here trains)."""

    def __init__(self, cfg: HeadConfig, weights: dict[str, torch.Tensor], embed: torch.Tensor, d2t: torch.Tensor) -> None:
        self.cfg, self.w, self.embed, self.d2t = cfg, weights, embed, d2t
        self.t2d: torch.Tensor | None = None
        device = embed.device
        self.inv_freq = rope_frequencies(cfg, device)
        self.act = ACTIVATIONS[cfg.act]
        self.cache = PositionCache(1)
        self.kernels = attention_kernels(device)  # no per-shape attention plans (graft_cli/runtime/attention_kernels.py)
        self.reset()

    @property
    def device(self) -> torch.device:
        return self.embed.device

    @property
    def dtype(self) -> torch.dtype:
        return self.w["fc.weight"].dtype

    def reset(self, capacity: int = 0) -> None:
        """A new request of up to ``capacity`` rows: the cache is reserved once (position-addressed, as the
        target's), so a forward writes only its own rows and no step copies the context's keys."""
        self.cache.reserve(capacity)

    @property
    def length(self) -> int:
        return self.cache.layers[0].filled

    def crop(self, length: int) -> None:
        self.cache.layers[0].crop(length - self.length)

    def fuse(self, features: torch.Tensor) -> torch.Tensor:
        """Concatenated target features ``[T, 3·Ht]`` to the head's width."""
        return F.linear(features.to(self.dtype), self.w["fc.weight"])

    def _norm(self, x: torch.Tensor, name: str) -> torch.Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.cfg.eps)
        return self.w[name] * x32.to(x.dtype)

    def _rope(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        freqs = positions.to(self.device, torch.float32)[:, None] * self.inv_freq[None]
        emb = torch.cat([freqs, freqs], dim=-1)
        cos, sin = emb.cos().to(x.dtype), emb.sin().to(x.dtype)
        half = x.shape[-1] // 2
        rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
        return x * cos + rotated * sin

    @torch.inference_mode()
    def forward(self, tokens: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor,
                allowed: torch.Tensor) -> torch.Tensor:
        """Rows ``(hidden[i], tokens[i])`` at ``positions``; ``allowed`` ``[T, cache + T]`` (bool) says what each
        row attends to. Appends their keys and values to the cache; returns the layer's outputs ``[T, H]``."""
        c, w = self.cfg, self.w
        t = tokens.shape[0]
        emb = self.embed[on(tokens, self.device)].to(self.dtype)
        x = torch.cat([self._norm(emb, "midlayer.input_layernorm.weight"),
                       self._norm(hidden, "midlayer.hidden_norm.weight")], dim=-1)
        q = F.linear(x, w["midlayer.self_attn.q_proj.weight"]).view(t, c.heads, c.head_dim).transpose(0, 1)
        k = F.linear(x, w["midlayer.self_attn.k_proj.weight"]).view(t, c.kv_heads, c.head_dim).transpose(0, 1)
        v = F.linear(x, w["midlayer.self_attn.v_proj.weight"]).view(t, c.kv_heads, c.head_dim).transpose(0, 1)
        q, k = self._rope(q, positions), self._rope(k, positions)
        keys, values = self.cache.layers[0].update(k[None], v[None])
        bias = torch.zeros(allowed.shape, dtype=self.dtype, device=self.device)
        bias.masked_fill_(~on(allowed, self.device), torch.finfo(self.dtype).min)
        with self.kernels:
            attn = F.scaled_dot_product_attention(q[None], keys, values, attn_mask=bias[None, None],
                                                  enable_gqa=True)[0]
        h = hidden + F.linear(attn.transpose(0, 1).reshape(t, c.heads * c.head_dim), w["midlayer.self_attn.o_proj.weight"])
        y = self._norm(h, "midlayer.post_attention_layernorm.weight")
        mlp = self.act(F.linear(y, w["midlayer.mlp.gate_proj.weight"])) * F.linear(y, w["midlayer.mlp.up_proj.weight"])
        return h + F.linear(mlp, w["midlayer.mlp.down_proj.weight"])

    def logp(self, out: torch.Tensor) -> torch.Tensor:
        """Log-probabilities over the draft vocabulary."""
        logits = F.linear(self._norm(out, "norm.weight"), self.w["lm_head.weight"])
        return torch.log_softmax(logits.float(), dim=-1)

    def to_target(self, ids: torch.Tensor) -> torch.Tensor:
        return ids + self.d2t[ids]

    def from_target(self, ids: torch.Tensor) -> torch.Tensor:
        """Target ids to draft ids, -1 for one outside the draft vocabulary (the table is built on first use)."""
        if self.t2d is None:
            drafted = torch.arange(self.d2t.shape[0], device=self.d2t.device)
            self.t2d = torch.full((self.embed.shape[0],), -1, dtype=torch.long, device=self.d2t.device)
            self.t2d[drafted + self.d2t] = drafted
        return self.t2d[ids]


def load_head(path: str, target: torch.nn.Module, rope_theta: float | None = None) -> Eagle3Head:
    """Read an EAGLE-3 head directory for ``target``. Every problem is one line of GraftError naming the
    directory: a head that does not fit its target must fail before a token is drafted."""
    root = resolve_head(path)
    where = f"eagle3 head {path}"
    raw = _read_config(root, where)
    cfg = _head_config(raw, target, rope_theta, where)
    weights = {k.removeprefix("model."): v for k, v in _read_weights(root, where).items()}
    shapes = expected_shapes(cfg, target.config.hidden_size)
    for name, shape in shapes.items():
        if name not in weights:
            raise GraftError(f"{where}: missing tensor '{name}'")
        if tuple(weights[name].shape) != shape:
            raise GraftError(f"{where}: tensor '{name}' has shape {list(weights[name].shape)}, expected {list(shape)}")
    embed_target = target.get_input_embeddings().weight
    embed = _embedding(weights, cfg, embed_target, where)
    d2t = _draft_map(weights, cfg, embed_target.shape[0], where)
    keep = {name: weights[name].to(embed_target.device, embed_target.dtype) for name in shapes}
    return Eagle3Head(cfg, keep, embed, d2t.to(embed_target.device))


def _read_config(root: Path, where: str) -> dict:
    try:
        raw = json.loads((root / "config.json").read_text())
    except FileNotFoundError:
        raise GraftError(f"{where}: no config.json") from None
    except (OSError, ValueError) as e:
        raise GraftError(f"{where}: config.json is unreadable ({str(e).splitlines()[0]})") from None
    if not isinstance(raw, dict):
        raise GraftError(f"{where}: config.json is not a JSON object")
    if raw.get("fc_norm"):
        raise GraftError(f"{where}: heads with fc_norm are not supported")
    return raw


def _head_config(raw: dict, target: torch.nn.Module, rope_theta: float | None, where: str) -> HeadConfig:
    """The head's shape from its config.json, the target's vocabulary filling what a head leaves out."""
    tconf = target.config
    vocab = target.get_input_embeddings().weight.shape[0]
    try:
        hidden, heads = int(raw["hidden_size"]), int(raw["num_attention_heads"])
        theta, scaling = _rope_config(raw, rope_theta)
        cfg = HeadConfig(
            hidden=hidden,
            heads=heads,
            kv_heads=int(raw.get("num_key_value_heads") or heads),
            head_dim=int(raw.get("head_dim") or hidden // heads),
            intermediate=int(raw["intermediate_size"]),
            vocab=int(raw.get("vocab_size") or vocab),
            draft_vocab=int(raw.get("draft_vocab_size") or raw.get("vocab_size") or vocab),
            rope_theta=theta,
            eps=float(raw.get("rms_norm_eps") or 1e-6),
            act=str(raw.get("hidden_act") or "silu"),
            rope_scaling=scaling,
            layers=_aux_layers(raw, tconf.num_hidden_layers),
        )
    except KeyError as e:
        raise GraftError(f"{where}: config.json lacks {e.args[0]}") from None
    except (TypeError, ValueError) as e:
        raise GraftError(f"{where}: config.json has a bad value ({e})") from None
    if cfg.heads % cfg.kv_heads:
        raise GraftError(f"{where}: {cfg.heads} attention heads do not split into {cfg.kv_heads} key/value heads")
    if cfg.act not in ACTIVATIONS:
        raise GraftError(f"{where}: unsupported hidden_act '{cfg.act}'")
    if tconf.num_hidden_layers < 3:
        raise GraftError(f"{where}: the target has {tconf.num_hidden_layers} layers; EAGLE-3 needs at least 3")
    return cfg


def _embedding(weights: dict[str, torch.Tensor], cfg: HeadConfig, embed_target: torch.Tensor,
               where: str) -> torch.Tensor:
    """The head's own token embedding, or the target's when the head shares it (as most heads do)."""
    if "embed_tokens.weight" in weights:
        embed = weights.pop("embed_tokens.weight")
        if tuple(embed.shape) != (cfg.vocab, cfg.hidden):
            raise GraftError(f"{where}: tensor 'embed_tokens.weight' has shape {list(embed.shape)}, "
                             f"expected {[cfg.vocab, cfg.hidden]}")
        return embed.to(embed_target.device, embed_target.dtype)
    if embed_target.shape[1] == cfg.hidden:
        return embed_target
    raise GraftError(f"{where}: no 'embed_tokens.weight' and the target's embeddings are {embed_target.shape[1]} "
                     f"wide, not the head's {cfg.hidden}")


def _draft_map(weights: dict[str, torch.Tensor], cfg: HeadConfig, vocab: int, where: str) -> torch.Tensor:
    """``d2t`` (draft id to target id offsets), checked on the host: a bad id must never reach an embedding."""
    if "d2t" in weights:
        d2t = weights.pop("d2t")
        if tuple(d2t.shape) != (cfg.draft_vocab,) or d2t.dtype.is_floating_point:
            raise GraftError(f"{where}: 'd2t' must be {cfg.draft_vocab} integers, got {d2t.dtype} {list(d2t.shape)}")
    elif cfg.draft_vocab <= vocab:
        d2t = torch.zeros(cfg.draft_vocab, dtype=torch.long)
    else:
        raise GraftError(f"{where}: missing tensor 'd2t' (the draft vocabulary is larger than the target's)")
    d2t = d2t.long()
    mapped = torch.arange(cfg.draft_vocab) + d2t
    if int(mapped.min()) < 0 or int(mapped.max()) >= min(vocab, cfg.vocab):
        raise GraftError(f"{where}: 'd2t' maps draft ids outside the target vocabulary of {min(vocab, cfg.vocab)}")
    return d2t


def _read_weights(root: Path, where: str) -> dict[str, torch.Tensor]:
    for name in WEIGHT_FILES:
        file = root / name
        if not file.exists():
            continue
        try:
            if name.endswith(".safetensors"):
                from safetensors.torch import load_file

                return load_file(str(file))
            state = torch.load(str(file), map_location="cpu", weights_only=True)
        except Exception as e:  # truncated files, pickles with code in them, ...
            raise GraftError(f"{where}: cannot read {name} ({str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__})") from None
        if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
            raise GraftError(f"{where}: {name} does not hold a dictionary of tensors")
        return state
    raise GraftError(f"{where}: no weights ({' or '.join(WEIGHT_FILES)})")
