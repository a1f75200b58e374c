"""graft's own forward of a decoder-only transformer whose layers are RMSNorm, grouped-query attention with
rotary positions, and a SwiGLU MLP: Llama and Qwen2 (their differences, the projections' biases, are a
:class:`~graft_cli.models.families.Family`'s).

Why own it: on a CPU a one-token step of a small model is mostly Python and dispatch, not arithmetic. transformers'
eager modules make a mask, position embeddings, output recorders and a dozen wrappers per layer per forward; here a
layer is the dozen tensor operations its arithmetic needs. It runs behind the same calls graft makes of a
transformers model (``model(input_ids=..., position_ids=..., attention_mask=..., cache=..., visible=...)``, with
graft's :class:`~graft_cli.runtime.kv_cache.PositionCache`), so every engine path (trees, the fixed-shape path,
the prefix cache, EAGLE-3's hidden states) works unchanged; its parameters carry transformers' names, so a
checkpoint loads as it is (the projections a layer reads of one input stacked into one weight: ``FUSED``) and the
CPU's packed linears (graft_cli/runtime/cpu_linear.py) switch its layers alike.

What it computes is transformers' arithmetic in the same order, so outputs agree within float tolerance (the tests
compare logits); greedy tokens are identical to plain decoding with the same forward, which is graft's contract.
In low precision a CPU's rows (a step, a tree of up to 64 rows, a prompt's chunk) attend through
graft_cli/models/invariant.py instead, whose rows get the bits a one-row step gets, so that contract holds in
bf16 too, tie for tie, however a prompt is split.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from graft_cli.core.threads import PARALLEL_SCORES, SERIAL_ROWS, crowded, serial, wide_only_if
from graft_cli.models.attention import attend
from graft_cli.models.invariant import PIECE, Layout, invariant_rows, layout_for
from graft_cli.models.families import Family


@dataclass
class Output:
    """What graft reads of a forward, under transformers' names: ``logits [batch, rows, vocab]`` and (asked for)
    ``hidden_states``: the embeddings and every layer's input after them, the last one normed (transformers'
    tuple, which EAGLE-3 heads index)."""

    logits: torch.Tensor
    hidden_states: tuple[torch.Tensor, ...] | None = None


@dataclass(frozen=True)
class Shared:
    """What every layer of one forward reads alike, worked out once: the rotary tables ``cos``/``sin``, the
    ``mask`` and the ``visible`` keys every row sees (:meth:`CausalLM.forward`), the low-precision rows'
    ``layout`` (None: torch's kernels), and whether other processes ``crowded`` the cores when it began (its
    small operations then on one thread, a long chunk's attention pieces side by side: core/threads.py)."""

    cos: torch.Tensor
    sin: torch.Tensor
    mask: torch.Tensor | None
    visible: int | None
    layout: Layout | None
    crowded: bool


class RMSNorm(nn.Module):
    """Root-mean-square norm computed in fp32, as transformers' Llama does (then cast back and scaled)."""

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32:  # one fused kernel, the same sums
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


class Rotary:
    """Rotary position tables, grown on demand: a position's cos and sin are those transformers computes (the same
    fp32 products), looked up instead of recomputed every forward."""

    def __init__(self, head_dim: int, theta: float) -> None:
        exponents = torch.arange(0, head_dim, 2, dtype=torch.int64, device="cpu").float() / head_dim
        self.inv_freq = 1.0 / (theta ** exponents)
        self.cos = self.sin = torch.empty(0, head_dim, device="cpu")

    def tables(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """``[batch, 1, rows, head_dim]`` cos and sin at ``positions [batch, rows]``."""
        need = int(positions.max()) + 1 if positions.numel() else 0
        if need > self.cos.shape[0] or self.cos.dtype != dtype or self.cos.device != positions.device:
            size = max(need, 2 * self.cos.shape[0], 256)
            freqs = torch.arange(size, dtype=torch.float32, device="cpu")[:, None] * self.inv_freq[None, :]
            angles = torch.cat((freqs, freqs), dim=-1)
            self.cos, self.sin = (t.to(device=positions.device, dtype=dtype) for t in (angles.cos(), angles.sin()))
        return self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin


FUSED = {  # a projection of this forward: the checkpoint's projections it stacks (their outputs side by side)
    "self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj"),
}


class Attention(nn.Module):
    """Grouped-query attention; the query, key and value projections are one linear (``FUSED``): one weight
    stream and one kernel call instead of three."""

    def __init__(self, config: Any, family: Family) -> None:
        super().__init__()
        self.heads, self.kv_heads = config.num_attention_heads, config.num_key_value_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.heads
        self.scaling = self.head_dim ** -0.5
        width = config.hidden_size
        self.qkv_proj = nn.Linear(width, (self.heads + 2 * self.kv_heads) * self.head_dim, bias=family.qkv_bias(config))
        self.o_proj = nn.Linear(self.heads * self.head_dim, width, bias=family.out_bias(config))

    def forward(self, x: torch.Tensor, shared: Shared, layer: Any) -> torch.Tensor:
        batch, rows, _ = x.shape
        qkv = self.qkv_proj(x).view(batch, rows, self.heads + 2 * self.kv_heads, self.head_dim).transpose(1, 2)
        qk = rotate(qkv[:, : self.heads + self.kv_heads], shared.cos, shared.sin)  # queries and keys together
        q, k, v = qk[:, : self.heads], qk[:, self.heads :], qkv[:, self.heads + self.kv_heads :]
        if layer is not None:  # the cache keeps the rows and hands back every key the rows may see
            k, v = layer.update(k, v)
        if shared.layout is not None:  # a CPU's low-precision rows, each as plain decoding computes it
            # crowded, a chunk's pieces side by side, one thread each; free, each piece on every thread
            with serial(shared.crowded and rows > PIECE):
                out = invariant_rows(q, k, v, shared.layout, self.scaling)
        else:  # torch's kernels, which pay for threads over many scores, and whose bits depend on their count
            with wide_only_if(rows * k.shape[2] >= PARALLEL_SCORES):
                out = attend(q, k, v, shared.mask, shared.visible, self.scaling)
        return self.o_proj(out.transpose(1, 2).reshape(batch, rows, self.heads * self.head_dim))


class MLP(nn.Module):
    """SwiGLU; the gate and up projections are one linear (``FUSED``)."""

    def __init__(self, config: Any, family: Family) -> None:
        super().__init__()
        bias = family.mlp_bias(config)
        self.gate_up_proj = nn.Linear(config.hidden_size, 2 * config.intermediate_size, bias=bias)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, config: Any, family: Family) -> None:
        super().__init__()
        self.self_attn = Attention(config, family)
        self.mlp = MLP(config, family)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, x: torch.Tensor, shared: Shared, layer: Any) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), shared, layer)
        return x + self.mlp(self.post_attention_layernorm(x))


class Decoder(nn.Module):
    """The embeddings, the layers and the final norm (transformers' ``model.model``)."""

    def __init__(self, config: Any, family: Family) -> None:
        super().__init__()
        # a weight given, not drawn: random init on the meta device costs a second the first time, for nothing
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size,
                                         _weight=torch.empty(config.vocab_size, config.hidden_size))
        self.layers = nn.ModuleList(DecoderLayer(config, family) for _ in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class CausalLM(nn.Module):
    """A decoder and its LM head, called as graft calls a transformers causal LM (module docstring).
    ``config``: the model's transformers config, which the rest of graft reads (vocabulary, limits, layers);
    ``generation_config``: its generation config, where its stop tokens are (set by the loader)."""

    generation_config: Any = None

    def __init__(self, config: Any, family: Family) -> None:
        super().__init__()
        self.config = config
        self.model = Decoder(config, family)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        head_dim = self.model.layers[0].self_attn.head_dim
        self.rotary = Rotary(head_dim, family.rope_theta(config))

    def get_input_embeddings(self) -> nn.Embedding:
        return self.model.embed_tokens

    def get_output_embeddings(self) -> nn.Linear:
        return self.lm_head

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor | None = None,
                attention_mask: torch.Tensor | None = None, cache: Any = None, use_cache: bool = True,
                output_hidden_states: bool = False, logits_to_keep: int = 0, visible: int | None = None) -> Output:
        """transformers' keywords, those graft passes: ``attention_mask`` a 4D mask (additive or bool) over every
        key the rows see, or None for causal; ``cache`` a PositionCache (None or ``use_cache`` False: the rows see
        only each other); ``visible``: leading keys every row sees; ``logits_to_keep``: the last rows' logits
        only (0: all). On a CPU its operations run on every thread while the machine is free, and on one but
        for the linear layers that pay while other processes crowd its cores (core/threads.py)."""
        switched = input_ids.device.type == "cpu" and not torch.compiler.is_compiling()  # nothing read there
        crowd = switched and crowded(time.monotonic())
        with serial(crowd and input_ids.shape[1] < SERIAL_ROWS):
            return self._forward(input_ids, position_ids, attention_mask, cache, use_cache, output_hidden_states,
                                 logits_to_keep, visible, crowd)

    def _forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor | None, attention_mask: torch.Tensor | None,
                 cache: Any, use_cache: bool, output_hidden_states: bool, logits_to_keep: int,
                 visible: int | None, crowd: bool) -> Output:
        layers: Sequence[Any] = cache.layers if cache is not None and use_cache else [None] * len(self.model.layers)
        past = layers[0].get_seq_length() if layers[0] is not None else 0
        if position_ids is None:
            position_ids = torch.arange(past, past + input_ids.shape[1], device=input_ids.device)[None]
        x = self.model.embed_tokens(input_ids)
        cos, sin = self.rotary.tables(position_ids, x.dtype)
        shared = Shared(cos, sin, attention_mask, visible, layout_for(x, attention_mask, visible, past), crowd)
        states = [x] if output_hidden_states else None
        for block, layer in zip(self.model.layers, layers):
            x = block(x, shared, layer)
            if states is not None:
                states.append(x)
        x = self.model.norm(x)
        if states is not None:
            states[-1] = x
        kept = x if not logits_to_keep else x[:, -logits_to_keep:]
        return Output(self.lm_head(kept), None if states is None else tuple(states))
