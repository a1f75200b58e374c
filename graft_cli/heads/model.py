"""The trainable EAGLE-3 head: the same tensors as a SpecForge ``LlamaForCausalLMEagle3`` (so the files it writes
load there with a strict state dict), and the training-time test (TTT) unrolled over K steps.

TTT: step 0 reads the fused target features; step k reads the head's own output of step k-1 at the same row,
paired with the token k places further on, at position ``t + k``. A row of step k attends to step 0's rows of
its own document up to itself (the committed context) and to its own rows of steps 1..k (its chain), exactly
the keys the drafter's tree node at depth k sees at decoding time.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from graft_cli.heads.head import ACTIVATIONS, HeadConfig, rope_frequencies
from graft_cli.models.decoder import RMSNorm


def _linear(n_in: int, n_out: int) -> nn.Linear:
    return nn.Linear(n_in, n_out, bias=False)


class Attention(nn.Module):
    def __init__(self, c: HeadConfig) -> None:
        super().__init__()
        self.q_proj = _linear(2 * c.hidden, c.heads * c.head_dim)
        self.k_proj = _linear(2 * c.hidden, c.kv_heads * c.head_dim)
        self.v_proj = _linear(2 * c.hidden, c.kv_heads * c.head_dim)
        self.o_proj = _linear(c.heads * c.head_dim, c.hidden)


class MLP(nn.Module):
    def __init__(self, c: HeadConfig) -> None:
        super().__init__()
        self.gate_proj = _linear(c.hidden, c.intermediate)
        self.up_proj = _linear(c.hidden, c.intermediate)
        self.down_proj = _linear(c.intermediate, c.hidden)


class MidLayer(nn.Module):
    def __init__(self, c: HeadConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(c.hidden, c.eps)
        self.hidden_norm = RMSNorm(c.hidden, c.eps)
        self.post_attention_layernorm = RMSNorm(c.hidden, c.eps)
        self.self_attn = Attention(c)
        self.mlp = MLP(c)


@dataclass
class StepInputs:
    """One TTT step's view of a batch (rows ``t`` of ``[B, L]``)."""

    tokens: torch.Tensor  # [B, L] token t + 1 + k
    positions: torch.Tensor  # [B, L] document positions of row t, plus k
    context: torch.Tensor  # [B, 1, L, L] additive mask over step 0's rows (causal, same document)


class TrainableHead(nn.Module):
    """fc + one decoder layer + norm + lm_head over the draft vocabulary; ``d2t``/``t2d`` as buffers. The token
    embeddings are the target's (frozen, passed in, never stored)."""

    def __init__(self, cfg: HeadConfig, target_hidden: int, embed: torch.Tensor) -> None:
        super().__init__()
        self.cfg = cfg
        self.fc = _linear(3 * target_hidden, cfg.hidden)
        self.midlayer = MidLayer(cfg)
        self.norm = RMSNorm(cfg.hidden, cfg.eps)
        self.lm_head = _linear(cfg.hidden, cfg.draft_vocab)
        self.register_buffer("d2t", torch.zeros(cfg.draft_vocab, dtype=torch.long))
        self.register_buffer("t2d", torch.zeros(cfg.vocab, dtype=torch.bool))
        self.embed = embed.detach()  # a plain attribute: not a parameter, not in the state dict
        self.register_buffer("inv_freq", rope_frequencies(cfg, embed.device), persistent=False)
        self.act = ACTIVATIONS[cfg.act]

    def set_vocab(self, draft_ids: torch.Tensor) -> None:
        """``draft_ids``: the target ids of the draft vocabulary, ascending."""
        ids = draft_ids.to(self.d2t.device)
        self.d2t.copy_(ids - torch.arange(len(ids), device=ids.device))
        self.t2d.zero_()
        self.t2d[ids] = True

    def draft_ids(self) -> torch.Tensor:
        return torch.arange(self.cfg.draft_vocab, device=self.d2t.device) + self.d2t

    def _rope(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """``x`` [B, heads, L, D] rotated at ``positions`` [B, L]."""
        freqs = positions.float()[..., None] * self.inv_freq
        emb = torch.cat([freqs, freqs], dim=-1)[:, None]
        cos, sin = emb.cos().to(x.dtype), emb.sin().to(x.dtype)
        half = x.shape[-1] // 2
        return x * cos + torch.cat([-x[..., half:], x[..., :half]], dim=-1) * sin

    def step(self, hidden: torch.Tensor, s: StepInputs, cache: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        """One TTT step: ``hidden`` [B, L, H] (fused features or the previous step's output) with ``s.tokens``.
        ``cache`` holds the (keys, values) of the earlier steps and gets this step's; returns the layer output."""
        c, m = self.cfg, self.midlayer
        b, n, _ = hidden.shape
        emb = self.embed[s.tokens].to(hidden.dtype)
        x = torch.cat([m.input_layernorm(emb), m.hidden_norm(hidden)], dim=-1)
        a = m.self_attn
        q = a.q_proj(x).view(b, n, c.heads, c.head_dim).transpose(1, 2)
        k = a.k_proj(x).view(b, n, c.kv_heads, c.head_dim).transpose(1, 2)
        v = a.v_proj(x).view(b, n, c.kv_heads, c.head_dim).transpose(1, 2)
        q, k = self._rope(q, s.positions), self._rope(k, s.positions)
        groups = c.heads // c.kv_heads
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
        cache.append((k, v))
        scale = 1.0 / math.sqrt(c.head_dim)
        k0, v0 = cache[0]
        scores = [torch.matmul(q, k0.transpose(-1, -2)) * scale + s.context]  # [B, h, L, L]
        scores += [((q * kj).sum(-1) * scale)[..., None] for kj, _ in cache[1:]]  # the chain: own rows only
        p = torch.softmax(torch.cat(scores, dim=-1).float(), dim=-1).to(q.dtype)
        out = torch.matmul(p[..., :n], v0)
        for j, (_, vj) in enumerate(cache[1:]):
            out = out + p[..., n + j, None] * vj
        h = hidden + a.o_proj(out.transpose(1, 2).reshape(b, n, c.heads * c.head_dim))
        y = m.post_attention_layernorm(h)
        return h + m.mlp.down_proj(self.act(m.mlp.gate_proj(y)) * m.mlp.up_proj(y))

    def logits(self, out: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.norm(out))

    def unroll(self, features: torch.Tensor, steps: list[StepInputs]) -> list[torch.Tensor]:
        """Draft logits ``[B, L, Vd]`` of every TTT step."""
        hidden = self.fc(features.to(self.fc.weight.dtype))
        cache: list[tuple[torch.Tensor, torch.Tensor]] = []
        logits = []
        for s in steps:
            hidden = self.step(hidden, s, cache)
            logits.append(self.logits(hidden))
        return logits


def step_inputs(tokens: torch.Tensor, positions: torch.Tensor, k: int, context: torch.Tensor) -> StepInputs:
    """Step ``k``'s view of a packed batch: ``tokens`` and ``positions`` are ``[B, L]`` of the sequence itself
    (row t of the head pairs features at t with token t + 1 + k)."""
    return StepInputs(shift(tokens, 1 + k), positions + k, context)


def shift(x: torch.Tensor, by: int) -> torch.Tensor:
    """``x[:, t + by]`` at row t, zero past the end."""
    if by == 0:
        return x
    pad = torch.zeros_like(x[:, :by])
    return torch.cat([x[:, by:], pad], dim=1)


def context_mask(docs: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Additive ``[B, 1, L, L]``: row t sees rows s <= t of its own document."""
    n = docs.shape[1]
    causal = torch.ones((n, n), dtype=torch.bool, device=docs.device).tril()
    allowed = causal & (docs[:, :, None] == docs[:, None, :])
    mask = torch.zeros(allowed.shape, dtype=dtype, device=docs.device)
    return mask.masked_fill_(~allowed, torch.finfo(dtype).min)[:, None]
