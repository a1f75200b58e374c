"""EAGLE-3 draft heads: one decoder layer that drafts from the target's own hidden states.

The head reads the target's hidden states at the inputs of decoder layers ``2, N//2, N-3`` (indices of
transformers' ``hidden_states`` tuple), concatenated low | mid | high and fused by ``fc`` to its width. Row ``t``
of the head pairs the target's features at position ``t`` with the token at ``t + 1`` (so draft positions are
target positions minus one) and predicts the token at ``t + 2``; deeper tree levels feed the head's own output
instead of fused target features. Its logits cover a reduced draft vocabulary; ``d2t`` maps draft id ``d`` to
target id ``d + d2t[d]``.

:func:`load_head` reads a head directory (``config.json`` + ``model.safetensors`` or ``pytorch_model.bin``, in the
layouts of the EAGLE authors, SpecForge and vLLM's speculators: ``layouts.py``) and checks it against the target
before anything runs.
"""

from __future__ import annotations

import math
from pathlib import Path

import torch
import torch.nn.functional as F

from graft_cli.core import GraftError
from graft_cli.heads.layouts import (ACTIVATIONS, HeadConfig, bias_shapes, canonical_weights, check_target,
                                     expected_shapes, feature_count, head_config, read_config)
from graft_cli.heads.names import resolve_head
from graft_cli.runtime.attention_kernels import attention_kernels
from graft_cli.runtime.kv_cache import PositionCache
from graft_cli.runtime.target import on

WEIGHT_FILES = ("model.safetensors", "pytorch_model.bin")


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

    def reset(self, capacity: int = 0, keep: int = 0) -> None:
        """A new request of up to ``capacity`` rows, its first ``keep`` those held now: the cache is reserved once
        (position-addressed, as the target's), so a forward writes only its own rows and no step copies the
        context's keys."""
        self.cache.reserve(capacity, keep)

    @property
    def length(self) -> int:
        return self.cache.layers[0].filled

    def crop(self, length: int) -> None:
        self.cache.layers[0].crop(length - self.length)

    def fuse(self, features: torch.Tensor) -> torch.Tensor:
        """Concatenated target features ``[T, n·Ht]`` to the head's width, through the head's norms of them first
        where it has them (speculators' ``input_norm`` of the whole, ``fc_norm`` of each feature)."""
        x = features.to(self.dtype)
        if self.cfg.input_norm:
            x = self._norm(x, "input_norm.weight")
        if self.cfg.fc_norm:
            chunks = x.chunk(feature_count(self.cfg), dim=-1)
            x = torch.cat([self._norm(chunk, f"fc_norm.{i}.weight") for i, chunk in enumerate(chunks)], dim=-1)
        return F.linear(x, self.w["fc.weight"], self.w.get("fc.bias"))

    def _linear(self, x: torch.Tensor, name: str) -> torch.Tensor:
        """One of the layer's projections (``midlayer.NAME``), with its bias where the head has one."""
        return F.linear(x, self.w[f"midlayer.{name}.weight"], self.w.get(f"midlayer.{name}.bias"))

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
        row attends to. Appends their keys and values to the cache; returns the layer's outputs ``[T, H]``, the
        state deeper draft levels read (normed by ``norm`` where the head was trained to feed that back)."""
        return self.rows(tokens, hidden, positions, allowed)

    def rows(self, tokens: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor,
             allowed: torch.Tensor) -> torch.Tensor:
        """:meth:`forward` for a caller already in inference mode: a compiled level (graft_cli/runtime/compiled.py),
        where entering it again inside the compiled region leaves torch's dispatcher state broken after it."""
        c = self.cfg
        t = tokens.shape[0]
        emb = self.embed[on(tokens, self.device)].to(self.dtype)
        normed = self._norm(hidden, "midlayer.hidden_norm.weight")
        x = torch.cat([self._norm(emb, "midlayer.input_layernorm.weight"), normed], dim=-1)
        q = self._linear(x, "self_attn.q_proj").view(t, c.heads, c.head_dim)
        k = self._linear(x, "self_attn.k_proj").view(t, c.kv_heads, c.head_dim)
        v = self._linear(x, "self_attn.v_proj").view(t, c.kv_heads, c.head_dim).transpose(0, 1)
        if c.qk_norm:  # qwen3's layer: every query and key head normalised before RoPE
            q, k = self._norm(q, "midlayer.self_attn.q_norm.weight"), self._norm(k, "midlayer.self_attn.k_norm.weight")
        q, k = self._rope(q.transpose(0, 1), positions), self._rope(k.transpose(0, 1), positions)
        keys, values = self.cache.layers[0].update(k[None], v[None])
        bias = torch.zeros(allowed.shape, dtype=self.dtype, device=self.device)
        bias.masked_fill_(~on(allowed, self.device), torch.finfo(self.dtype).min)
        with self.kernels:
            attn = F.scaled_dot_product_attention(q[None], keys, values, attn_mask=bias[None, None],
                                                  enable_gqa=True)[0]
        residual = normed if c.norm_before_residual else hidden
        h = residual + self._linear(attn.transpose(0, 1).reshape(t, c.heads * c.head_dim), "self_attn.o_proj")
        y = self._norm(h, "midlayer.post_attention_layernorm.weight")
        out = h + self._linear(self.act(self._linear(y, "mlp.gate_proj")) * self._linear(y, "mlp.up_proj"),
                               "mlp.down_proj")
        return self._norm(out, "norm.weight") if c.feed_normed else out

    def logp(self, out: torch.Tensor) -> torch.Tensor:
        """Log-probabilities over the draft vocabulary: ``lm_head`` over ``norm(out)``, or over ``out`` itself where
        it is normed already or the head was trained without (SpecForge's ``norm_output: false``)."""
        if self.cfg.norm_logits and not self.cfg.feed_normed:
            out = self._norm(out, "norm.weight")
        return torch.log_softmax(F.linear(out, self.w["lm_head.weight"]).float(), dim=-1)

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
    cfg = head_config(read_config(root, where), target, rope_theta, where)
    weights = canonical_weights(_read_weights(root, where), where)
    check_target(cfg, weights, target, where)
    shapes = expected_shapes(cfg, target.config.hidden_size)
    shapes |= {name: shape for name, shape in bias_shapes(cfg).items() if name in weights and name not in shapes}
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
