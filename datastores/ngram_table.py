"""The n-gram store's table: every ``n``-token context of the corpus with its most frequent next tokens, counted,
and its rows ordered by a 64-bit hash of the context so that an exact lookup is a binary search.

Files of a shard: ``ctx.u32`` ``[N, n]`` contexts; ``next.u32`` / ``count.u32`` ``[N, top_k]`` best next tokens
(SEP-padded) and their counts; ``total.u32`` ``[N]`` all next-token occurrences of the context; ``hash.u64``
``[N]`` sorted context hashes.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import numpy as np

from datastores.errors import DatastoreError
from datastores.tokenize import SEP

FNV_OFFSET = 0xCBF29CE484222325
FNV_PRIME = 0x100000001B3
MASK64 = (1 << 64) - 1
U32_MAX = 2**32 - 1


def hash_rows(ctx: np.ndarray) -> np.ndarray:
    """64-bit FNV-1a-style hash of each row of token ids (what :func:`hash_context` computes for one)."""
    h = np.full(ctx.shape[0], FNV_OFFSET, dtype=np.uint64)
    prime = np.uint64(FNV_PRIME)
    for j in range(ctx.shape[1]):
        h ^= ctx[:, j].astype(np.uint64)
        h *= prime
    return h


def hash_context(tokens: Sequence[int]) -> int:
    """The hash of one context at query time, equal to its row's in :func:`hash_rows`."""
    h = FNV_OFFSET
    for t in tokens:
        h = ((h ^ (int(t) & 0xFFFFFFFF)) * FNV_PRIME) & MASK64
    return h


@dataclass
class NgramCounts:
    """The unique ``(context, next token)`` pairs of a corpus with their counts, sorted by context then token."""

    ctx: np.ndarray  # [U, n] uint32
    next: np.ndarray  # [U] uint32
    count: np.ndarray  # [U] int64

    @classmethod
    def empty(cls, n: int) -> NgramCounts:
        return cls(np.empty((0, n), np.uint32), np.empty(0, np.uint32), np.empty(0, np.int64))


def count_ngrams(tokens: np.ndarray, n: int, vocab_size: int) -> NgramCounts:
    """Every ``n + 1``-token window that lies inside one document (no SEP in it), counted."""
    is_sep = tokens == SEP
    cs = np.concatenate([[0], np.cumsum(is_sep, dtype=np.int64)])
    last = tokens.size - n - 1
    if last < 0:
        return NgramCounts.empty(n)
    starts = np.flatnonzero(cs[n + 1 : n + 2 + last] - cs[: last + 1] == 0)
    if starts.size == 0:
        return NgramCounts.empty(n)
    bits = max(1, int(vocab_size - 1).bit_length())
    if bits * (n + 1) <= 64:
        return _count_packed(tokens, starts, n, bits)
    return _count_lexsorted(tokens, starts, n)


def _count_packed(tokens: np.ndarray, starts: np.ndarray, n: int, bits: int) -> NgramCounts:
    """Windows that fit in 64 bits counted as packed integer keys: one ``np.unique`` of a flat array."""
    key = np.zeros(starts.size, dtype=np.uint64)
    for j in range(n + 1):
        key = (key << np.uint64(bits)) | tokens[starts + j].astype(np.uint64)
    uk, counts = np.unique(key, return_counts=True)
    mask = np.uint64((1 << bits) - 1)
    nxt = (uk & mask).astype(np.uint32)
    ctx = np.empty((uk.size, n), dtype=np.uint32)
    rest = uk >> np.uint64(bits)
    for j in range(n - 1, -1, -1):
        ctx[:, j] = (rest & mask).astype(np.uint32)
        rest >>= np.uint64(bits)
    return NgramCounts(ctx, nxt, counts.astype(np.int64))


def _count_lexsorted(tokens: np.ndarray, starts: np.ndarray, n: int) -> NgramCounts:
    """Windows too wide to pack counted by sorting them as rows."""
    grams = np.stack([tokens[starts + j] for j in range(n + 1)], axis=1)
    order = np.lexsort(grams.T[::-1])
    g = grams[order]
    new = np.concatenate([[True], np.any(g[1:] != g[:-1], axis=1)])
    first = np.flatnonzero(new)
    counts = np.diff(np.concatenate([first, [g.shape[0]]]))
    return NgramCounts(g[first, :n].copy(), g[first, n].copy(), counts.astype(np.int64))


@dataclass
class NgramRows:
    """The kept contexts, each with its best next tokens (SEP-padded), their counts and its total, in context order."""

    ctx: np.ndarray  # [N, n] uint32
    nexts: np.ndarray  # [N, top_k] uint32
    counts: np.ndarray  # [N, top_k] uint32
    total: np.ndarray  # [N] uint32


@dataclass
class NgramTable(NgramRows):
    """The rows as stored: ordered by context hash, with the sorted hashes beside them."""

    hashes: np.ndarray  # [N] uint64

    def write(self, directory: Path) -> None:
        self.ctx.tofile(directory / "ctx.u32")
        self.nexts.tofile(directory / "next.u32")
        self.counts.tofile(directory / "count.u32")
        self.total.tofile(directory / "total.u32")
        self.hashes.tofile(directory / "hash.u64")


def sort_by_hash(rows: NgramRows) -> NgramTable:
    """The rows ordered by context hash (a stable sort: equal hashes keep context order)."""
    hashes = hash_rows(rows.ctx)
    order = np.argsort(hashes, kind="stable")
    return NgramTable(rows.ctx[order], rows.nexts[order], rows.counts[order], rows.total[order], hashes[order])


@dataclass
class _Groups:
    """The rows of :class:`NgramCounts` grouped by context, and the groups that are kept."""

    start: np.ndarray  # first row of each group
    of_row: np.ndarray  # each row's group
    totals: np.ndarray  # each group's count of all next tokens
    keep: np.ndarray  # the kept groups, ascending


def build_rows(counts: NgramCounts, *, min_count: int, max_contexts: int, top_k: int) -> NgramRows:
    """The contexts seen at least ``min_count`` times (the ``max_contexts`` most frequent of them), each with its
    ``top_k`` most frequent next tokens, in context order."""
    n = counts.ctx.shape[1]
    if counts.ctx.shape[0] == 0:
        raise DatastoreError(f"the corpus has no {n + 1}-token window inside a document (documents are too short)")
    return _kept_rows(counts, _kept_groups(counts, min_count, max_contexts), top_k)


def _kept_groups(counts: NgramCounts, min_count: int, max_contexts: int) -> _Groups:
    """The rows grouped by context; the groups seen ``min_count`` times kept, at most ``max_contexts`` of them."""
    new = np.concatenate([[True], np.any(counts.ctx[1:] != counts.ctx[:-1], axis=1)])
    start = np.flatnonzero(new)
    of_row = np.cumsum(new) - 1
    totals = np.add.reduceat(counts.count, start)
    keep = np.flatnonzero(totals >= min_count)
    if keep.size > max_contexts:
        keep = keep[np.argpartition(-totals[keep], max_contexts - 1)[:max_contexts]]
    if keep.size == 0:
        raise DatastoreError(f"no context occurs at least min_count={min_count} times; lower --min-count")
    keep.sort()
    return _Groups(start, of_row, totals, keep)


def _kept_rows(counts: NgramCounts, groups: _Groups, k: int) -> NgramRows:
    """The kept contexts with their ``k`` most frequent next tokens, most frequent first (SEP and 0 where a
    context has fewer)."""
    gid = groups.of_row
    sel = np.zeros(groups.start.size, dtype=bool)
    sel[groups.keep] = True
    rows = np.flatnonzero(sel[gid])
    order = rows[np.lexsort((-counts.count[rows], gid[rows]))]
    g_sorted = gid[order]
    first_of = np.concatenate([[True], g_sorted[1:] != g_sorted[:-1]])
    rank = np.arange(order.size) - np.maximum.accumulate(np.where(first_of, np.arange(order.size), 0))
    top = rank < k
    row_of_group = np.full(groups.start.size, -1, dtype=np.int64)
    row_of_group[groups.keep] = np.arange(groups.keep.size)
    r = row_of_group[g_sorted[top]]
    nexts = np.full((groups.keep.size, k), SEP, dtype=np.uint32)
    best = np.zeros((groups.keep.size, k), dtype=np.uint32)
    nexts[r, rank[top]] = counts.next[order[top]]
    best[r, rank[top]] = np.minimum(counts.count[order[top]], U32_MAX)
    total = np.minimum(groups.totals[groups.keep], U32_MAX).astype(np.uint32)
    return NgramRows(counts.ctx[groups.start[groups.keep]], nexts, best, total)
