"""Attention whose result for a row does not depend on the rows beside it: in low precision on a CPU every row,
whether a step's, a tree's or a prompt chunk's, gets the bits plain decoding gets at its position. So bf16 graft
is token-identical to bf16 ``ar``, not only up to floating-point ties, and a prompt gives the same rows however it
is split: across ``--prefill-chunk`` values and between a prefix-cache hit and a cold request.

Where graft's C++ kernel is built (graft_cli/models/native.py: a CPU with AVX512-BF16 and a C++ compiler), it serves
every bf16 row (:func:`native_rows`): a few rows with the query heads of their key head, start to end in one thread,
each row's keys in canonical order (the cache's, then a tree row's ancestors by depth, then itself), scores and
softmax in fp32: several times closer to fp32 attention than the torch path. Elsewhere the torch operations below
serve; the two round differently, and a process takes one of them for all its rows, so either keeps the contract.

Why torch's own kernels are not invariant: the flash kernel tiles a chunk's rows and its last partial tile rounds
otherwise (a prompt split at another token changes the rows just before the split), and a tree row sees the cache
and its ancestors among the tree's other (masked) keys, where plain decoding sees them packed. GEMMs and the softmax
give a row the same bits whatever rows travel with it and whatever masked keys trail it, but not when zeros sit
*between* its keys: the bf16 dot-product instructions add keys in pairs, and a gap moves a key into another pair. So
each row's keys are laid out canonically, by position (the cache's, then its ancestors' in depth order, then -inf up
to a whole block), its scaled scores go through one softmax, and the probabilities meet the values in fixed blocks
of ``BLOCK`` positions, one GEMM per block, summed in position order in fp64. A tree of more than ``FEW_ROWS`` rows
goes to SDPA, and its tokens are then plain decoding's up to floating-point ties.

What the torch path costs, measured (docs/models.md, "Precision on a CPU"): a step's attention over 4,000 keys takes
0.5 ms a layer against 3.9 through the flash kernel; a bf16 prompt's prefill 0.84x to 0.92x of the flash kernel's
time at 500 to 4,000 tokens; the C++ kernel's, docs/cpu.md. tests/test_invariant.py checks the bits of both.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from functools import cache, partial
from typing import Callable

import torch
import torch.nn.functional as F

from graft_cli.core.threads import PARALLEL_ROWS, fanned, spread
from graft_cli.models import native

BLOCK = 64  # positions per values GEMM
FEW_ROWS = 64  # a tree's rows up to which a forward takes this path
PIECE = 64  # a prompt chunk's rows that attend at once (measured: see causal_rows)
PIECE_SPAN = 64 * 4096  # at most rows x keys a piece's scores span (at 30,000 keys: 1.5x the flash kernel, not 2.5x)
LOOP_FROM = 2048  # elements a block from which :func:`in_order` adds block by block (measured)


@dataclass(frozen=True)
class Layout:
    """Where each row's keys sit, worked out once per forward for every layer: every row sees the first
    ``shared`` keys; then either the rows are the keys' last, each seeing those before it (``columns`` None: the
    keys' own order is canonical), or each row sees the key columns ``columns[row]`` where ``valid`` (its
    ancestors by depth, then itself)."""

    shared: int
    columns: torch.Tensor | None = None
    valid: torch.Tensor | None = None


def layout_for(x: torch.Tensor, mask: torch.Tensor | None, visible: int | None, past: int) -> Layout | None:
    """The layout of a forward of ``x [batch, rows, width]`` after ``past`` cached keys, or None where this path
    does not serve it (fp32, a GPU, a batch, a tree of more than ``FEW_ROWS`` rows)."""
    batch, rows = x.shape[:2]
    if x.dtype == torch.float32 or x.device.type != "cpu" or batch != 1:
        return None
    if mask is None:  # a step or a prompt's chunk, of any length
        return Layout(past)
    if rows > FEW_ROWS:
        return None
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
    values as ``layout`` says each row sees them. The queries are scaled before the product; the softmax runs over
    whole blocks, the padding at -inf. torch's bf16 softmax computes in fp32 vector by vector and gives a row
    the bits of the fp32 softmax rounded, whatever -inf trails it, but only over whole vectors (a shorter tail
    goes through a scalar exp): whole blocks are, and it takes a third of the time of converting to fp32 and
    back (tests/test_invariant.py holds torch to it). Returns ``[1, heads, rows, dim]``."""
    served = native_rows(query, key, value, layout, scaling)
    if served is not None:
        return served
    if layout.columns is None:
        return causal_rows(query, key, value, scaling)
    _, heads, rows, dim = query.shape
    kv_heads, shared = key.shape[1], layout.shared
    groups = heads // kv_heads
    # the cache's keys sit in a block whose head stride is its capacity; a batched GEMM over such keys takes a slow
    # path (at 4,000 keys 0.58 ms a layer), a contiguous copy of them and the GEMM 0.13 ms
    scores = torch.bmm((query * scaling).reshape(kv_heads, groups * rows, dim), key[0].contiguous().transpose(1, 2))
    scores = scores.view(kv_heads, groups, rows, -1)
    width = layout.columns.shape[1]
    canon = scores.new_full((kv_heads, groups, rows, shared + width + -(shared + width) % BLOCK), float("-inf"))
    canon[..., :shared] = scores[..., :shared]
    canon[..., shared : shared + width] = scores.gather(-1, layout.columns.expand(kv_heads, groups, rows, width))
    canon[..., shared : shared + width].masked_fill_(~layout.valid, float("-inf"))
    probs = torch.softmax(canon, dim=-1)  # [kv_heads, groups, rows, canonical keys]
    blocks = tree_blocks(probs, value[0], layout)  # [kv_heads, groups, rows, blocks, dim]
    return in_order(blocks, 3).to(query.dtype).reshape(1, heads, rows, dim)


def native_rows(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, layout: Layout,
                scaling: float) -> torch.Tensor | None:
    """:func:`invariant_rows` through graft's C++ kernel (graft_cli/models/kernels/attention.cpp): each row in
    its keys' canonical order, in one thread, the rows spread over every thread the forward has; or None where
    the kernel does not serve (not bf16, no kernel built here, a head size or grouping it has no code for), and
    then torch's path serves every row of the process alike."""
    kernel = attention_kernel() if query.dtype == torch.bfloat16 else None
    if kernel is None:
        return None
    _, heads, rows, dim = query.shape
    if layout.columns is None:  # row i sees every key up to its own
        shared = torch.arange(key.shape[2] - rows + 1, key.shape[2] + 1)
        own, counts = torch.zeros(rows, 1, dtype=torch.int64), torch.zeros(rows, dtype=torch.int64)
    else:
        shared = torch.full((rows,), layout.shared, dtype=torch.int64)
        own, counts = layout.columns.contiguous(), layout.valid.sum(1)
    q, out = query[0].contiguous(), torch.empty(heads, rows, dim, dtype=query.dtype)
    # each key's values side by side, as the cache keeps them (a forward without a cache: copied so)
    k, v = (t[0] if t.stride(-1) == 1 and t.stride(-2) == dim else t[0].contiguous() for t in (key, value))
    with fanned(rows >= PARALLEL_ROWS):  # crowded, many rows still take every thread (core/threads.py)
        failed = kernel(q.data_ptr(), q.stride(0), q.stride(1), k.data_ptr(), k.stride(0), v.data_ptr(),
                        v.stride(0), shared.data_ptr(), own.data_ptr(), own.shape[1], counts.data_ptr(), k.shape[0],
                        rows, heads // k.shape[0], dim, scaling, out.data_ptr(), torch.get_num_threads())
    return None if failed else out[None]


@cache
def attention_kernel() -> Callable[..., int] | None:
    """The kernel's entry point, its C signature declared (attention.cpp's ``graft_attend``), or None."""
    library = native.library("attention")
    if library is None:
        return None
    kernel = library.graft_attend
    pointer, size = ctypes.c_void_p, ctypes.c_int64
    kernel.argtypes = [pointer, size, size, pointer, size, pointer, size, pointer, pointer, size, pointer, size,
                       size, size, size, ctypes.c_float, pointer, ctypes.c_int]
    kernel.restype = ctypes.c_int
    return kernel


def causal_rows(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scaling: float) -> torch.Tensor:
    """The rows are the keys' last, each seeing every key up to its own (a step, a prompt's chunk): ``PIECE`` rows
    at a time, fewer past 4,096 keys (rows times keys within ``PIECE_SPAN``), each piece over the keys up to its
    last row. Why pieces: a 512-row chunk's scores at 4,000 keys are tens of megabytes a tensor, fresh pages every
    layer; 64 rows' stay in cache, and a bf16 prefill then took 0.9x the flash kernel's time instead of 1.4x
    (docs/models.md). A row's bits do not depend on its piece's size."""
    rows, past = query.shape[2], key.shape[2] - query.shape[2]
    piece = max(8, min(PIECE, PIECE_SPAN // key.shape[2] // 8 * 8))
    if rows <= piece:
        return causal_piece(query, key, value, scaling)
    ends = [(start, past + min(rows, start + piece)) for start in range(0, rows, piece)]
    pieces = [partial(causal_piece, query[:, :, start : start + piece], key[:, :, :end], value[:, :, :end], scaling)
              for start, end in ends]
    return torch.cat(spread(pieces), dim=2)  # side by side on the threads a forward has (core/threads.py)


def causal_piece(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scaling: float) -> torch.Tensor:
    """:func:`causal_rows` for up to ``PIECE`` rows. The keys are padded to whole blocks first (their scores then
    -inf: zero probabilities, which change no row's bits), so the probabilities need no padded copy."""
    _, heads, rows, dim = query.shape
    kv_heads, keys = key.shape[1], key.shape[2]
    groups, pad = heads // kv_heads, -keys % BLOCK
    padded = F.pad(key[0], (0, 0, 0, pad))  # contiguous too: see invariant_rows
    scores = torch.bmm((query * scaling).reshape(kv_heads, groups * rows, dim), padded.transpose(1, 2))
    scores = scores.view(kv_heads, groups, rows, keys + pad)
    scores[..., keys:] = float("-inf")
    if rows > 1:
        scores[..., keys - rows : keys].masked_fill_(torch.ones(rows, rows, dtype=torch.bool).triu(1), float("-inf"))
    probs = torch.softmax(scores, dim=-1).view(kv_heads, groups * rows, -1, BLOCK)
    probs = probs.transpose(1, 2)
    values = F.pad(value[0], (0, 0, 0, pad)).view(kv_heads, -1, BLOCK, dim)
    blocks = torch.matmul(probs, values)  # [kv_heads, blocks, groups * rows, dim]
    return in_order(blocks, 1).to(query.dtype).view(1, heads, rows, dim)


def in_order(blocks: torch.Tensor, dim: int) -> torch.Tensor:
    """The sum of ``blocks`` along ``dim`` in position order, accumulated in fp64 (as ``cumsum`` accumulates:
    trailing zero blocks add nothing). Few elements a block: one ``cumsum``, whose scalar loop is then cheapest;
    many (a long chunk): one vectorised add per block, the same sums in the same order."""
    if blocks.numel() // blocks.shape[dim] < LOOP_FROM:
        return blocks.float().cumsum(dim).select(dim, -1)
    total = blocks.select(dim, 0).double()
    for i in range(1, blocks.shape[dim]):
        total += blocks.select(dim, i)
    return total.float()


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
    p = probs[..., full:]
    own = F.pad(own, (0, 0, 0, p.shape[-1] - own.shape[2])).view(kv_heads, rows, -1, BLOCK, dim)
    p = p.reshape(kv_heads, groups, rows, -1, BLOCK).permute(0, 2, 3, 1, 4)
    return torch.cat([*parts, torch.matmul(p, own).permute(0, 3, 1, 2, 4)], dim=3)


def blocks_times(probs: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """``probs [kv_heads, groups, rows, keys]`` times the values ``[kv_heads, keys, dim]`` that every row shares,
    one GEMM per block of ``BLOCK`` keys (whole blocks): ``[kv_heads, groups, rows, blocks, dim]``."""
    kv_heads, groups, rows, _ = probs.shape
    p = probs.reshape(kv_heads, groups * rows, -1, BLOCK).transpose(1, 2)
    v = values.view(kv_heads, -1, BLOCK, values.shape[-1])
    out = torch.matmul(p, v)  # [kv_heads, blocks, groups * rows, dim]
    return out.view(kv_heads, -1, groups, rows, out.shape[-1]).permute(0, 2, 3, 1, 4)
