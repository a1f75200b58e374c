"""Attention whose result for a row does not depend on the rows beside it: a low-precision tree's rows get the
bits plain decoding gets at the same positions, so bf16 graft is token-identical to bf16 ``ar``, not only up to
floating-point ties.

Why the plain batched attention is not: a tree row sees the cache and its ancestors, which sit among the tree's
other (masked) keys, while plain decoding sees the same keys packed one after another. The GEMMs and the softmax
give a row the same bits whatever other rows travel with it and whatever masked (zero) keys trail it, but not when
zeros sit *between* its keys: the bf16 dot-product instructions add keys in pairs, and a gap moves a key into
another pair. So each row's keys are laid out canonically, by position (the cache's, then its ancestors' in depth
order, then zeros), and the probabilities meet the values in fixed blocks of ``BLOCK`` positions, one GEMM per
block, summed block by block in position order: every row then runs, block for block, the arithmetic plain
decoding runs for its position. It serves a CPU's few low-precision rows (a step, a tree), where torch's flash
kernel is slow anyway (one bf16 row over 4,000 keys: 3.9 ms a layer against 0.3 as GEMMs); a prompt's chunks go
to SDPA. tests/test_invariant.py checks the bits; docs/models.md gives the cost.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

BLOCK = 64  # positions per values GEMM
FEW_ROWS = 64  # rows up to which a forward takes this path


@dataclass(frozen=True)
class Layout:
    """Where each row's keys sit, worked out once per forward for every layer: every row sees the first
    ``shared`` keys; then either the rows are the keys' last, each seeing those before it (``columns`` None: the
    keys' own order is canonical, ``causal`` masks what a row does not see, None for one row), or each row sees
    the key columns ``columns[row]`` where ``valid`` (its ancestors by depth, then itself)."""

    shared: int
    causal: torch.Tensor | None = None
    columns: torch.Tensor | None = None
    valid: torch.Tensor | None = None


def layout_for(x: torch.Tensor, mask: torch.Tensor | None, visible: int | None, past: int) -> Layout | None:
    """The layout of a forward of ``x [batch, rows, width]`` after ``past`` cached keys, or None where this path
    does not serve it (fp32, a GPU, a prompt's chunk, a batch)."""
    batch, rows = x.shape[:2]
    if x.dtype == torch.float32 or x.device.type != "cpu" or rows > FEW_ROWS or batch != 1:
        return None
    if mask is None:
        keys = past + rows
        causal = None if rows == 1 else ~torch.ones(rows, keys, dtype=torch.bool).tril(past)
        return Layout(past, causal)
    keys = mask.shape[-1]
    seen = mask.reshape(rows, keys)
    seen = seen if seen.dtype == torch.bool else seen == 0
    unseen = (~seen.all(0)).nonzero()
    shared = visible if visible is not None else int(unseen[0]) if len(unseen) else keys
    tail = seen[:, shared:]
    width = int(tail.sum(1).max())
    order = torch.argsort((~tail).to(torch.int8), dim=1, stable=True)[:, :width]  # seen columns first, in order
    valid = torch.arange(width)[None, :] < tail.sum(1, keepdim=True)
    return Layout(shared, columns=order + shared, valid=valid)


def invariant_rows(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, layout: Layout,
                   scaling: float) -> torch.Tensor:
    """Grouped-query attention of ``[1, heads, rows, dim]`` queries over ``[1, kv_heads, keys, dim]`` keys and
    values as ``layout`` says each row sees them; the softmax in fp32, as transformers' eager attention. Returns
    ``[1, heads, rows, dim]``."""
    _, heads, rows, dim = query.shape
    kv_heads, shared = key.shape[1], layout.shared
    groups = heads // kv_heads
    # the cache's keys sit in a block whose head stride is its capacity; a batched GEMM over such keys takes a slow
    # path (at 4,000 keys 0.58 ms a layer), a contiguous copy of them and the GEMM 0.13 ms
    scores = torch.bmm(query.reshape(kv_heads, groups * rows, dim), key[0].contiguous().transpose(1, 2))
    scores = scores.view(kv_heads, groups, rows, -1)
    if layout.columns is None:
        canon = scores.float().mul_(scaling)
        if layout.causal is not None:
            canon.masked_fill_(layout.causal, float("-inf"))
    else:
        width = layout.columns.shape[1]
        tail = scores.gather(-1, layout.columns.expand(kv_heads, groups, rows, width))
        canon = torch.cat([scores[..., :shared], tail], dim=-1).float().mul_(scaling)
        canon[..., shared:].masked_fill_(~layout.valid, float("-inf"))
    probs = torch.softmax(canon, dim=-1).to(query.dtype)  # [kv_heads, groups, rows, canonical keys]
    if layout.columns is None:  # the keys' own order: every row's values are the same
        blocks = blocks_times(probs, value[0])
    else:
        blocks = tree_blocks(probs, value[0], layout)
    # block by block in position order (cumsum adds in sequence; trailing zero blocks add nothing)
    out = blocks.float().cumsum(dim=3)[..., -1, :]
    return out.to(query.dtype).reshape(1, heads, rows, dim)


def tree_blocks(probs: torch.Tensor, values: torch.Tensor, layout: Layout) -> torch.Tensor:
    """A tree's canonical ``probs [kv_heads, groups, rows, keys]`` times its values ``[kv_heads, keys, dim]``,
    block by block: the shared keys' whole blocks with one set of values for every row, then each row's own
    values (the shared keys' last part, then its tail's, zero-padded). ``[kv_heads, groups, rows, blocks, dim]``."""
    kv_heads, groups, rows, _ = probs.shape
    shared, dim = layout.shared, values.shape[-1]
    full = shared // BLOCK * BLOCK
    parts = [blocks_times(probs[..., :full], values[:, :full])] if full else []
    own = values[:, layout.columns.flatten()].view(kv_heads, rows, -1, dim) * layout.valid[None, :, :, None]
    own = torch.cat([values[:, full:shared, None].expand(-1, -1, rows, -1).transpose(1, 2), own], dim=2)
    pad = -own.shape[2] % BLOCK
    own = F.pad(own, (0, 0, 0, pad)).view(kv_heads, rows, -1, BLOCK, dim)
    p = F.pad(probs[..., full:], (0, pad)).view(kv_heads, groups, rows, -1, BLOCK).permute(0, 2, 3, 1, 4)
    return torch.cat([*parts, torch.matmul(p, own).permute(0, 3, 1, 2, 4)], dim=3)


def blocks_times(probs: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """``probs [kv_heads, groups, rows, keys]`` times the values ``[kv_heads, keys, dim]`` that every row shares,
    one GEMM per block of ``BLOCK`` keys (zero-padded): ``[kv_heads, groups, rows, blocks, dim]``."""
    kv_heads, groups, rows, keys = probs.shape
    pad = -keys % BLOCK
    if pad:
        probs, values = F.pad(probs, (0, pad)), F.pad(values, (0, 0, 0, pad))
    p = probs.reshape(kv_heads, groups * rows, -1, BLOCK).transpose(1, 2)
    v = values.view(kv_heads, -1, BLOCK, values.shape[-1])
    out = torch.matmul(p, v)  # [kv_heads, blocks, groups * rows, dim]
    return out.view(kv_heads, -1, groups, rows, out.shape[-1]).permute(0, 2, 3, 1, 4)
