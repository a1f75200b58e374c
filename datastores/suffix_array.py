"""The suffix-array store: exact longest-suffix matching over a token corpus, with counted continuations.

Files of one shard (all little-endian, memory-mapped for queries):

``tokens.u32``
    The shard's text ``T``: ``SEP doc SEP doc ... SEP`` followed by :data:`PAD` more ``SEP`` so that reading a
    continuation never runs off the end. ``SEP`` (0xFFFFFFFF) is never a token and never in a query, so no match
    crosses two documents.
``sa.u32``
    The suffix array of the *reversed* text, stored as positions in ``T``: entry ``P`` stands for the string
    that ends at ``T[P-1]`` and reads backwards (``T[P-1], T[P-2], ...``); its continuation starts at ``T[P]``.
    Entries are sorted by that backwards string, so the occurrences of a context suffix of length ``k`` form
    one contiguous range, and growing the suffix by one token to the left only narrows the range (binary search
    on ``T[P-k-1]`` inside it). Entries that start or end at a separator are dropped (they can never match or
    never continue).
``first.u32``
    ``V + 1`` offsets: the range of entries whose last matched token is ``t`` is ``first[t]:first[t+1]``, so
    the first step of every lookup costs nothing.

Construction sorts the reversed text with libdivsufsort (through pydivsufsort) on a big-endian byte packing of
the token ids (2 bytes per token for vocabularies up to 65,535, 3 bytes up to 16M): for fixed-width big-endian
codes, byte order at aligned positions is token order, so the aligned byte suffixes are the token suffixes.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Sequence

import numpy as np

from datastores.errors import DatastoreError
from datastores.tokenize import SEP

PAD = 64  # SEPs after the text: the deepest continuation a lookup may read
MAX_SHARD_TOKENS = 2**32 - 2 * PAD - 2  # positions are uint32

DEFAULTS = {
    "max_match": 16,  # longest context suffix tried
    "min_match": 2,  # shortest context suffix accepted
    "depth": 8,  # longest continuation read (tokens)
    "max_occurrences": 512,  # occurrences counted per lookup (evenly spaced over the matched range)
    "prior": 1.0,  # score = count / (occurrences + prior): one occurrence is not certainty
    "budget": 64,
}


# --- construction ---------------------------------------------------------------------------------------------


def _pack_reversed(tokens: np.ndarray, vocab_size: int) -> tuple[np.ndarray, int]:
    """The reversed text as fixed-width big-endian codes (SEP -> ``vocab_size``, above every token)."""
    top = vocab_size  # code of SEP
    width = max(1, math.ceil(top.bit_length() / 8))
    rev = tokens[::-1]
    n = rev.size
    packed = np.empty((n, width), dtype=np.uint8)
    step = 1 << 20  # in blocks: temporaries stay a few MB whatever the shard size
    for lo in range(0, n, step):
        codes = rev[lo : lo + step]
        codes = np.where(codes == SEP, np.uint32(top), codes)
        if codes.size and int(codes.max()) > top:
            raise DatastoreError(f"token id {int(codes.max())} is outside the vocabulary ({vocab_size})")
        for b in range(width):
            packed[lo : lo + step, b] = (codes >> np.uint32(8 * (width - 1 - b))) & np.uint32(0xFF)
    return packed.reshape(-1), width


def build_suffix_array(tokens: np.ndarray, vocab_size: int, progress: Callable[[str], None] | None = None) -> tuple[np.ndarray, np.ndarray]:
    """``(sa, first)`` for a text ``tokens`` that starts and ends with SEP (see the module docstring)."""
    from pydivsufsort import divsufsort

    n = int(tokens.size)
    if n < 2 or tokens[0] != SEP or tokens[-1] != SEP:
        raise ValueError("the text must start and end with SEP")
    if n > MAX_SHARD_TOKENS:
        raise DatastoreError(f"a shard holds at most {MAX_SHARD_TOKENS:,} tokens; this one has {n:,} (use --shard)")
    packed, width = _pack_reversed(tokens, vocab_size)
    if progress:
        progress("sort")
    byte_sa = divsufsort(packed)  # int32 (or int64 past 2 GiB) positions of byte suffixes
    del packed
    if progress:
        progress("filter")
    # keep aligned suffixes; q (a position in the reversed text) stands for P = n - q in T. Entries that start
    # or end at a separator are dropped (P = n only occurs for q = 0, where T[P-1] is the final SEP).
    out = np.empty(n, dtype=np.uint32)
    m = 0
    step = 1 << 20  # in blocks: temporaries stay a few MB whatever the shard size
    for lo in range(0, byte_sa.size, step):
        chunk = byte_sa[lo : lo + step]
        if width > 1:
            chunk = chunk[chunk % width == 0] // width
        pos = n - chunk.astype(np.int64)
        keep = (tokens[pos - 1] != SEP) & (tokens[np.minimum(pos, n - 1)] != SEP)
        pos = pos[keep]
        out[m : m + pos.size] = pos
        m += pos.size
    del byte_sa
    sa = out[:m]
    # first[t]: entries are sorted by their last matched token T[P-1]; count them chunk by chunk
    counts = np.zeros(vocab_size + 1, dtype=np.int64)
    for lo in range(0, m, step):
        counts[1:] += np.bincount(tokens[sa[lo : lo + step].astype(np.int64) - 1], minlength=vocab_size)[:vocab_size]
    first = np.cumsum(counts).astype(np.uint32)
    return sa, first


def write_shard_files(directory: Path, tokens_path: Path, vocab_size: int, progress: Callable[[str], None] | None = None) -> dict:
    """Build ``sa.u32`` and ``first.u32`` next to ``tokens_path`` (which gains its padding); return timings."""
    t0 = time.perf_counter()
    tokens = np.fromfile(tokens_path, dtype=np.uint32)
    t_load = time.perf_counter()
    sa, first = build_suffix_array(tokens, vocab_size, progress)
    t_sort = time.perf_counter()
    n = int(tokens.size)
    del tokens
    if progress:
        progress("write")
    sa.tofile(directory / "sa.u32")
    first.tofile(directory / "first.u32")
    with open(tokens_path, "ab") as f:
        np.full(PAD, SEP, dtype=np.uint32).tofile(f)
    t_end = time.perf_counter()
    return {
        "text_tokens": n,
        "entries": int(sa.size),
        "load_s": round(t_load - t0, 3),
        "sort_s": round(t_sort - t_load, 3),
        "write_s": round(t_end - t_sort, 3),
    }


# --- queries --------------------------------------------------------------------------------------------------


@dataclass(slots=True)  # slots: a lookup makes dozens
class Continuation:
    token: int
    parent: int  # index into Lookup.nodes, or -1 for a child of the root
    depth: int
    count: int
    score: float


@dataclass
class Lookup:
    """What a store has for a context: the longest matched suffix and the counted continuation trie."""

    match_len: int = 0
    occurrences: int = 0  # occurrences of the matched suffix (with a continuation), all shards
    counted: int = 0  # occurrences whose continuations were read (evenly spaced, at most max_occurrences)
    nodes: list[Continuation] = field(default_factory=list)  # best first; a parent always before its children
    neighbours: list[tuple[float, list[int]]] = field(default_factory=list)  # ngram stores: (similarity, context)

    def paths(self) -> list[tuple[list[int], float, int]]:
        """Root-to-node token paths of every node, best first: ``(tokens, score, count)``."""
        out = []
        prefix: list[list[int]] = []
        for node in self.nodes:
            toks = (prefix[node.parent] if node.parent >= 0 else []) + [node.token]
            prefix.append(toks)
            out.append((toks, node.score, node.count))
        return out


class _Shard:
    def __init__(self, directory: Path, manifest: dict) -> None:
        import mmap

        self.dir = directory
        self.manifest = manifest
        self.n = int(manifest["index"]["text_tokens"])
        self._maps = []

        def open_u32(name: str) -> tuple[np.ndarray, memoryview]:
            with open(directory / name, "rb") as f:
                size = f.seek(0, 2)
                if size == 0:
                    return np.empty(0, dtype=np.uint32), memoryview(b"").cast("I")
                mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
            self._maps.append(mm)
            return np.frombuffer(mm, dtype=np.uint32), memoryview(mm).cast("I")

        self.T, self.Tv = open_u32("tokens.u32")
        self.P, self.Pv = open_u32("sa.u32")
        self.first = np.fromfile(directory / "first.u32", dtype=np.uint32)
        self.Fv = memoryview(self.first).cast("B").cast("I")
        self.vocab = self.first.size - 1
        if self.T.size != self.n + PAD or int(self.first[-1]) != self.P.size:
            raise DatastoreError(f"datastore shard {directory} is inconsistent (rebuild it)")

    def ranges(self, rev: Sequence[int]) -> list[tuple[int, int]]:
        """``ranges[k-1]`` = the entry range matching the last ``k`` context tokens, while non-empty."""
        t = rev[0]
        if not 0 <= t < self.vocab:
            return []
        Fv, Tv, Pv = self.Fv, self.Tv, self.Pv
        lo, hi = Fv[t], Fv[t + 1]
        if lo == hi:
            return []
        out = [(lo, hi)]
        for k in range(2, len(rev) + 1):
            t = rev[k - 1]
            if hi - lo <= 16:
                # small range: gather the k-th tokens and bisect them in numpy
                keys = self.T[self.P[lo:hi].astype(np.int64) - k]
                a = lo + int(np.searchsorted(keys, t, "left"))
                b = lo + int(np.searchsorted(keys, t, "right"))
            else:
                # scalar bisection on memoryviews (Python ints, no numpy call per step)
                a, b = lo, hi
                while a < b:
                    mid = (a + b) >> 1
                    if Tv[Pv[mid] - k] < t:
                        a = mid + 1
                    else:
                        b = mid
                if a == hi or Tv[Pv[a] - k] != t:
                    break
                b = hi
                c = a + 1
                while c < b:
                    mid = (c + b) >> 1
                    if Tv[Pv[mid] - k] <= t:
                        c = mid + 1
                    else:
                        b = mid
                b = c
            if a >= b:
                break
            lo, hi = a, b
            out.append((lo, hi))
        return out

    def rows(self, lo: int, hi: int, take: int, depth: int) -> np.ndarray:
        """Continuations (``take`` evenly spaced occurrences of the range) as a ``[take, depth]`` array."""
        count = hi - lo
        if take >= count:
            pos = self.P[lo:hi]
        else:
            pos = self.P[lo + (np.arange(take, dtype=np.int64) * count) // take]
        idx = pos.astype(np.int64)[:, None] + np.arange(depth, dtype=np.int64)
        return self.T[idx]

    def close(self) -> None:
        self.T = self.P = None  # type: ignore[assignment]
        self.Tv.release()
        self.Pv.release()
        for mm in self._maps:
            try:
                mm.close()
            except BufferError:
                pass


def _best(counts: np.ndarray, depths: np.ndarray, k: int) -> np.ndarray:
    """Indices of the ``k`` best nodes by count, shallower first on ties, best first.

    Linear time (a count histogram finds the threshold, a depth histogram splits the ties) instead of a
    partition over thousands of nodes. A parent has at least its child's count and a smaller depth, so the
    result is prefix-closed."""
    n = counts.size
    if k < n:
        hist = np.bincount(counts)
        at_least = np.cumsum(hist[::-1])[::-1]  # at_least[c] = nodes with count >= c
        c_k = int(np.flatnonzero(at_least >= k)[-1])
        sure = np.flatnonzero(counts > c_k)
        tie = np.flatnonzero(counts == c_k)
        need = k - sure.size
        if need < tie.size:
            td = depths[tie]
            d_k = int(np.searchsorted(np.cumsum(np.bincount(td)), need))
            tie = np.concatenate([tie[td < d_k], tie[td == d_k][: need - int((td < d_k).sum())]])
        idx = np.concatenate([sure, tie])
    else:
        idx = np.arange(n)
    top = int(depths.max()) + 2 if n else 1
    return idx[np.argsort(-(counts[idx] * top) + depths[idx], kind="stable")]


def continuation_trie(rows: np.ndarray, budget: int, prior: float = 1.0, total: int | None = None) -> list[Continuation]:
    """The best ``budget`` nodes of the trie of ``rows`` (one continuation per row, SEP-terminated).

    A node's count is the number of rows through it; its score is ``count / (rows + prior)`` -- the product of
    child/parent count ratios along its path (they telescope), shrunk by ``prior`` so that a single occurrence
    is not taken for certainty. Scores never grow along a path and ties go to the shallower node, so the
    selection is prefix-closed; nodes come best first, each after its parent.
    """
    m, depth = rows.shape if rows.ndim == 2 else (0, 0)
    if m == 0 or depth == 0 or budget <= 0:
        return []
    # a separator ends a continuation: everything from the first one on becomes SEP
    is_sep = rows == SEP
    if is_sep.any():
        first_sep = np.where(is_sep.any(axis=1), is_sep.argmax(axis=1), depth)
        rows = np.where(np.arange(depth) >= first_sep[:, None], SEP, rows)
    # sort rows lexicographically: big-endian bytes compare like the token sequences (memcmp order)
    order = np.argsort(np.ascontiguousarray(rows.astype(">u4")).view(f"S{4 * depth}").ravel(), kind="stable")
    s = rows[order]
    # the first column where each row differs from the previous one (depth when equal): from that depth on,
    # the row opens a new group (a distinct prefix)
    diff = np.ones((m - 1, depth + 1), dtype=bool)
    np.not_equal(s[1:], s[:-1], out=diff[:, :depth])
    first_diff = diff.argmax(axis=1)
    # group starts, depth-major (d * (m + 1) + row), with a closing start after the last row of each depth
    flat = np.ones((depth, m + 1), dtype=bool)
    np.less_equal(first_diff[None, :], np.arange(depth)[:, None], out=flat[:, 1:m])
    nz = np.flatnonzero(flat)
    lengths = np.diff(nz)  # group sizes: the distance to the next group start at the same depth
    starts = nz[:-1]
    # the token of each group (depth-major like ``flat``; the closing starts read SEP): separators are where
    # continuations end, not nodes
    cells = np.full((depth, m + 1), SEP, dtype=np.uint32)
    cells[:, :m] = s.T
    tok_of = cells.ravel()[starts]
    ok = tok_of != SEP
    starts, counts, tok_of = starts[ok], lengths[ok], tok_of[ok]
    d_of, row_of = np.divmod(starts, m + 1)
    if counts.size == 0:
        return []
    tot = float(total if total is not None else m)
    pick = _best(counts, d_of, budget)
    # the parent of the group at (row r, depth d) is the last group start <= r at depth d - 1
    prow = nz[np.searchsorted(nz, starts[pick] - (m + 1), side="right") - 1] % (m + 1)
    index: dict[tuple[int, int], int] = {}
    out: list[Continuation] = []
    tokens = tok_of[pick].tolist()
    for d, r, pr, c, tok in zip(d_of[pick].tolist(), row_of[pick].tolist(), prow.tolist(), counts[pick].tolist(), tokens):
        parent = -1
        if d > 0:
            parent = index.get((d - 1, pr), -2)
            if parent == -2:  # cannot happen: the selection is prefix-closed
                continue
        index[(d, r)] = len(out)
        out.append(Continuation(tok, parent, d + 1, c, c / (tot + prior)))
    return out


class SuffixArrayIndex:
    """The shards of one suffix-array store, queried together (see :meth:`lookup`)."""

    kind = "suffix-array"

    def __init__(self, shards: Sequence[tuple[Path, dict]]) -> None:
        self.shards = [_Shard(d, m) for d, m in shards]

    def close(self) -> None:
        for s in self.shards:
            s.close()

    def match(self, context: Sequence[int], max_match: int = 16) -> tuple[int, list[tuple[_Shard, int, int]]]:
        """The longest suffix of ``context`` (at most ``max_match`` tokens) found in any shard, and the entry
        range of every shard that holds it."""
        rev = [int(t) for t in context[-max_match:][::-1]] if max_match > 0 else []
        if not rev:
            return 0, []
        best = 0
        found: list[tuple[_Shard, list[tuple[int, int]]]] = []
        for shard in self.shards:
            r = shard.ranges(rev)
            if r:
                found.append((shard, r))
                best = max(best, len(r))
        return best, [(shard, *r[best - 1]) for shard, r in found if len(r) >= best]

    def lookup(
        self,
        context: Sequence[int],
        *,
        max_match: int = DEFAULTS["max_match"],
        min_match: int = DEFAULTS["min_match"],
        depth: int = DEFAULTS["depth"],
        max_occurrences: int = DEFAULTS["max_occurrences"],
        budget: int = DEFAULTS["budget"],
        prior: float = DEFAULTS["prior"],
    ) -> Lookup:
        depth = max(1, min(int(depth), PAD))
        k, hits = self.match(context, max_match)
        if k < max(min_match, 1) or not hits:
            return Lookup(match_len=k if k >= max(min_match, 1) else 0)
        total = sum(hi - lo for _, lo, hi in hits)
        take_all = total <= max_occurrences
        parts = []
        for shard, lo, hi in hits:
            n = hi - lo
            take = n if take_all else max(1, round(max_occurrences * n / total))
            parts.append(shard.rows(lo, hi, take, depth))
        rows = parts[0] if len(parts) == 1 else np.concatenate(parts)
        nodes = continuation_trie(rows, budget, prior)
        return Lookup(match_len=k, occurrences=total, counted=int(rows.shape[0]), nodes=nodes)
