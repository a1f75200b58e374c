"""Attention over a KV cache for graft's own forward, and the split of a block of queries that all see a long
prefix of the keys (the prefix through the flash kernel without a mask, the rest under the mask, joined by their
log-sum-exps: graft_cli/runtime/attention.py says why and what it saves).

Kept free of transformers so that a forward that owns its modules imports none of transformers' models.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

SPLIT_FROM = 1024  # visible keys below which the split's extra kernels cost more than they save (measured)
_flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu


def splittable(query: torch.Tensor, visible: int | None) -> bool:
    """Whether :func:`split` serves ``query`` (several fp32 rows on a CPU, a long prefix that every row sees)."""
    return (visible is not None and visible >= SPLIT_FROM and query.shape[2] > 1 and query.device.type == "cpu"
            and query.dtype == torch.float32)


def split(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor | None, visible: int,
          scaling: float | None) -> torch.Tensor:
    """``[batch, heads, rows, dim]`` queries over grouped keys ``[batch, kv_heads, keys, dim]``; every row sees the
    first ``visible`` keys, the rest under ``mask`` (its last rows and columns past ``visible`` are read; None:
    causal, the rows being the tail's own positions). Returns ``[batch, heads, rows, dim]``."""
    batch, heads, rows, dim = query.shape
    groups = heads // key.shape[1]
    folded = query.reshape(batch, key.shape[1], groups * rows, dim)  # head h = group h // groups, row-major
    seen, seen_lse = _flash(folded, key[:, :, :visible], value[:, :, :visible], scale=scaling)
    seen, seen_lse = seen.reshape(batch, heads, rows, dim), seen_lse.reshape(batch, heads, rows)
    if visible == key.shape[2]:
        return seen
    tail_keys = key[:, :, visible:].repeat_interleave(groups, dim=1)
    tail_values = value[:, :, visible:].repeat_interleave(groups, dim=1)
    if mask is None:
        tail, tail_lse = _flash(query, tail_keys, tail_values, is_causal=True, scale=scaling)
    else:
        mask = mask[..., -rows:, visible:]
        if mask.dtype == torch.bool:
            mask = torch.zeros(mask.shape, dtype=query.dtype).masked_fill_(~mask, torch.finfo(query.dtype).min)
        tail, tail_lse = _flash(query, tail_keys, tail_values, attn_mask=mask, scale=scaling)
    total = torch.logaddexp(seen_lse, tail_lse)
    return seen * (seen_lse - total).exp().unsqueeze(-1) + tail * (tail_lse - total).exp().unsqueeze(-1)


def attend(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor | None,
           visible: int | None, scaling: float) -> torch.Tensor:
    """Grouped-query attention of ``[batch, heads, rows, dim]`` queries over the cache's keys and values (the
    rows' own last): under ``mask`` (additive or bool, ``[batch, 1, rows, keys]``) when given, else causal, each
    row seeing every key up to its own. ``visible``: leading keys every row sees (the split serves long ones)."""
    rows, keys = query.shape[2], key.shape[2]
    if mask is None:
        if rows == 1 or rows == keys:  # one new row sees every key; a first chunk is plain causal
            return F.scaled_dot_product_attention(query, key, value, is_causal=rows > 1, scale=scaling,
                                                  enable_gqa=True)
        visible = keys - rows  # a chunk after the cache: the cache is seen, its own keys causal
        if not splittable(query, visible):
            mask = torch.ones(rows, keys, dtype=torch.bool, device=query.device).tril(visible)
    if splittable(query, visible):
        return split(query, key, value, mask, visible, scaling)
    return F.scaled_dot_product_attention(query, key, value, attn_mask=mask, scale=scaling, enable_gqa=True)
