"""Attention for a block of queries that all see a long prefix of the keys: the prefix without a mask, the rest
under the mask, joined by their log-sum-exps.

A verification step feeds the root and a tree: every row sees the whole cached context, and only the last few
keys (the tree's own) need a mask. A prefill chunk is the same shape: it sees all earlier chunks, and a causal
mask covers its own keys. SDPA given the full mask ``[rows, context + rows]`` reads it at every key, and
transformers copies each layer's keys and values once per query head (``repeat_kv``) because a masked grouped
attention has no kernel on a CPU. Here the visible prefix runs through the flash kernel with no mask, the query
heads of a key group folded into its query rows (the keys are read once, the GEMMs are taller); only the masked
tail, a few rows of keys, is expanded per head. At 4K tokens on SmolLM2 one layer's 17-row verification takes about
3.6 ms against 4.7.

The caller says how many keys every row sees by passing ``visible=N`` to the model's forward (transformers hands
forward keyword arguments to the attention function). Without it, on short prefixes, off the CPU, and for one-row
queries, this is transformers' SDPA attention, unchanged, so the model can be shared with transformers' own
``generate`` (the mask function registered with it is SDPA's).
"""

from __future__ import annotations

import torch

from graft_cli.models.attention import split, splittable
from graft_cli.runtime.limits import limits

NAME = "graft_split"


def split_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                    attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                    visible: int | None = None, **kwargs) -> tuple[torch.Tensor, None]:
    """transformers' attention-function signature; ``[batch, heads, rows, dim]`` in, ``[batch, rows, heads, dim]``
    out. ``visible``: how many leading keys every query row sees (the mask's first ``visible`` columns are all
    zero)."""
    if not splittable(query, visible) or dropout or kwargs.get("softcap") is not None:
        from transformers.integrations.sdpa_attention import sdpa_attention_forward  # lazy: as below

        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout, scaling, **kwargs)
    return split(query, key, value, attention_mask, visible, scaling).transpose(1, 2).contiguous(), None


def use_split_attention(model: torch.nn.Module) -> bool:
    """Switch a CPU model from SDPA to :func:`split_attention` (registered with transformers under ``NAME``, its
    masks made as SDPA's); False (and nothing changed) for a model on another attention implementation or one
    with sliding or chunked attention windows (their masks hide part of the prefix)."""
    if model.config._attn_implementation != "sdpa" or limits(model.config).window is not None:
        return False
    # lazy: importing transformers' model machinery costs seconds, and graft's own forward never needs it
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    if NAME not in AttentionInterface._global_mapping:
        AttentionInterface.register(NAME, split_attention)
        AttentionMaskInterface.register(NAME, sdpa_mask)
    model.set_attn_implementation(NAME)
    return True
