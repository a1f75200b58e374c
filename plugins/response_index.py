"""The response cache's index: earlier responses as tokens, every position filed under the n-gram that ends there,
read backwards, so that the occurrences of any context suffix of up to ``width`` tokens are one sorted range.

Why this shape. A lookup must cost a few binary searches however large the cache is, adding a response must not
rebuild the index, and dropping the oldest responses must be cheap. So:

* A :class:`Run` holds SEP-separated token sequences and one fixed-width key per position: the tokens at
  ``p, p-1, ..., p-width+1`` (ids + 1, big-endian; 0 from the first separator on, so no key reads into another
  response), kept sorted. Byte order is token order, so the keys of the positions that end with a given suffix of
  ``n`` tokens lie between the suffix padded with 0x00 bytes and the suffix padded with 0xFF bytes: all ``width``
  lengths of a context cost ONE ``np.searchsorted`` per run. New keys are merged in by position
  (``searchsorted`` again), never re-sorted with the old ones.
* :class:`ResponseIndex` keeps two runs, like a two-level LSM tree: ``recent`` takes each new response (a copy of
  the small run), and is merged into ``main`` when it reaches an eighth of it, so a token is copied a bounded
  number of times and a lookup reads two runs.
* Eviction is a watermark: responses sit in the runs oldest first, so past the token budget the oldest are
  dropped by moving ``alive_from`` (a global token offset) past them; lookups skip positions below it. A run is
  compacted (its dead prefix cut off: a filter, the order is kept) once a quarter of it is dead, so memory stays
  within 1.25 times the budget plus the keys (``4 * width + 12`` bytes a token).
"""

from __future__ import annotations

from collections import deque
from typing import Sequence

import numpy as np

from datastores.tokenize import SEP

RECENT_MIN = 1 << 14  # tokens the recent run may hold before merging, however small main is


class Run:
    """Token sequences (``SEP seq SEP seq ...``) and the sorted backward keys of their positions. ``base`` is
    the global offset of ``tokens[0]``, so that eviction can name positions across runs and compactions."""

    def __init__(self, width: int, base: int = 0) -> None:
        self.width, self.base = width, base
        self.tokens = np.full(1, SEP, dtype=np.uint32)
        self.keys = np.empty(0, dtype=f"S{4 * width}")
        self.pos = np.empty(0, dtype=np.int64)
        self.filed = 1  # positions before it were filed (or skipped); the last token waits for its successor

    def __len__(self) -> int:
        return int(self.tokens.size)

    @property
    def end(self) -> int:
        """The global offset just past this run's last token."""
        return self.base + len(self)

    def extend(self, new: Sequence[int] | np.ndarray) -> None:
        """Append tokens (SEP ends a sequence) and file the positions whose successor is now known: a position
        with nothing after it (the live response's last token, a response's end) has nothing to propose, and
        would only make a lookup try a longer match in vain."""
        self.tokens = np.concatenate([self.tokens, np.asarray(new, dtype=np.uint32)])
        keys, pos = backward_keys(self.tokens, self.filed, len(self) - 1, self.width)
        self.filed = max(self.filed, len(self) - 1)
        order = np.argsort(keys, kind="stable")
        self._insert(keys[order], pos[order])

    def merge(self, other: "Run") -> None:
        """Append ``other`` (whose sequences are all closed): its keys do not change, only their positions."""
        offset = len(self) - 1  # other's leading SEP falls on our closing one
        self.tokens = np.concatenate([self.tokens, other.tokens[1:]])
        self._insert(other.keys, other.pos + offset)
        self.filed = offset + other.filed

    def _insert(self, keys: np.ndarray, pos: np.ndarray) -> None:
        """Merge sorted ``keys`` (and their positions) into ours; on equal keys the new come after the old."""
        if not keys.size:
            return
        if not self.keys.size:
            self.keys, self.pos = keys, pos
            return
        at = np.searchsorted(self.keys, keys, side="right") + np.arange(keys.size)
        old = np.ones(self.keys.size + keys.size, dtype=bool)
        old[at] = False
        merged_keys, merged_pos = np.empty(old.size, dtype=self.keys.dtype), np.empty(old.size, dtype=np.int64)
        merged_keys[at], merged_keys[old] = keys, self.keys
        merged_pos[at], merged_pos[old] = pos, self.pos
        self.keys, self.pos = merged_keys, merged_pos

    def drop_before(self, cut: int) -> None:
        """Forget the sequences before local position ``cut`` (a sequence's first token): a filter of the
        sorted keys (their order stands) and a slice of the tokens."""
        keep = self.pos >= cut
        self.keys, self.pos = self.keys[keep], self.pos[keep] - (cut - 1)
        self.tokens = self.tokens[cut - 1 :].copy()
        self.base += cut - 1
        self.filed -= cut - 1

    def ranges(self, bounds: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """For query bounds from :func:`query_bounds`: the key ranges ``[lo[n-1], hi[n-1])`` of each length n."""
        return np.searchsorted(self.keys, bounds[0::2], "left"), np.searchsorted(self.keys, bounds[1::2], "right")

    def rows(self, lo: int, hi: int, take: int, length: int, cut: int = 1) -> np.ndarray:
        """Continuations of ``take`` evenly spaced occurrences of the range (those at or after ``cut``), as a
        ``[rows, length]`` array padded with SEP."""
        count = hi - lo
        pick = np.arange(lo, hi) if take >= count else lo + (np.arange(take, dtype=np.int64) * count) // take
        pos = self.pos[pick]
        pos = pos[pos >= cut]
        idx = pos[:, None] + np.arange(1, length + 1)
        out = np.full(idx.shape, SEP, dtype=np.uint32)
        inside = idx < len(self)
        out[inside] = self.tokens[idx[inside]]
        return out


def backward_keys(tokens: np.ndarray, start: int, stop: int, width: int) -> tuple[np.ndarray, np.ndarray]:
    """The keys (``S{4 * width}``) and positions of ``tokens[start:stop]`` that are followed by a token
    (separators, and what comes right before one, left out)."""
    lo = max(0, start - width + 1)
    window = tokens[lo:stop]
    codes = np.zeros(width - 1 + window.size, dtype=">u4")  # zeros in front: nothing before the run
    codes[width - 1 :] = np.where(window == SEP, 0, window.astype(np.int64) + 1)
    n, first = max(0, stop - start), start - lo + width - 1
    cols = np.empty((n, width), dtype=">u4")
    for j in range(width):
        cols[:, j] = codes[first - j : first - j + n]
    cols[np.cumprod(cols != 0, axis=1) == 0] = 0  # from the first separator on, nothing
    real = (cols[:, 0] != 0) & (tokens[start + 1 : stop + 1] != SEP)
    return cols[real].view(f"S{4 * width}").ravel(), np.arange(start, start + n, dtype=np.int64)[real]


def query_bounds(context: Sequence[int], width: int) -> np.ndarray:
    """For each n up to ``width`` (and the context's length): the lowest and highest key a position ending with
    the context's last n tokens can have, interleaved (``[low_1, high_1, low_2, ...]``)."""
    tail = np.asarray(context[-width:], dtype=np.int64)[::-1] + 1
    k = tail.size
    ours = np.arange(width) < np.arange(1, k + 1)[:, None]  # row n - 1: the first n columns are the context's
    padded = np.zeros(width, dtype=np.int64)
    padded[:k] = tail
    grid = np.empty((k, 2, width), dtype=">u4")
    grid[:, 0] = np.where(ours, padded, 0)
    grid[:, 1] = np.where(ours, padded, 0xFFFFFFFF)
    return grid.reshape(2 * k, width).view(f"S{4 * width}").ravel()


class ResponseIndex:
    """Responses by age under a token budget: ``main`` and ``recent`` runs, and the spans (global start, end) of
    the responses still alive, oldest first."""

    def __init__(self, max_tokens: int, width: int = 8) -> None:
        if max_tokens < 0 or width < 1:
            raise ValueError("responses needs max_tokens >= 0 and max_match >= 1")
        self.max_tokens, self.width = max_tokens, width
        self.main = Run(width)
        self.recent = Run(width, base=self.main.end - 1)
        self.spans: deque[tuple[int, int]] = deque()
        self.size = 0  # tokens of the responses alive
        self.alive_from = 1  # global offset: positions before it belong to evicted responses

    def __len__(self) -> int:
        return len(self.spans)

    def add(self, sequences: Sequence[Sequence[int] | np.ndarray]) -> None:
        """Add responses (oldest first), then evict past the budget."""
        sequences = [s for s in sequences if len(s)]
        if not sequences:
            return
        start = self.recent.end
        joined = np.concatenate([np.append(np.asarray(s, dtype=np.uint32), SEP) for s in sequences])
        self.recent.extend(joined)
        for s in sequences:
            self.spans.append((start, start + len(s)))
            start += len(s) + 1
            self.size += len(s)
        if len(self.recent) > max(RECENT_MIN, len(self.main) // 8):
            self.main.merge(self.recent)
            self.recent = Run(self.width, base=self.main.end - 1)
        self._evict()

    def _evict(self) -> None:
        """Drop the oldest responses past the budget (move the watermark), then compact a run a quarter dead."""
        while self.size > self.max_tokens and self.spans:
            start, end = self.spans.popleft()
            self.size -= end - start
            self.alive_from = self.spans[0][0] if self.spans else end + 1
        for name in ("main", "recent"):
            run: Run = getattr(self, name)
            cut = self.alive_from - run.base
            if cut >= len(run):
                setattr(self, name, Run(self.width, base=run.end - 1))
            elif cut > 1 and (cut - 1) * 4 > len(run):
                run.drop_before(cut)

    def runs(self) -> list[tuple[Run, int]]:
        """Each run with its local cut (positions before it are evicted)."""
        return [(run, max(1, self.alive_from - run.base)) for run in (self.recent, self.main)]

    def sequences(self) -> tuple[np.ndarray, np.ndarray]:
        """The responses alive, oldest first, as their tokens joined and ``len + 1`` offsets."""
        text = np.concatenate([run.tokens[cut:] for run, cut in reversed(self.runs())])
        ends = np.flatnonzero(text == SEP)
        lengths = np.diff(np.concatenate([[-1], ends])) - 1
        return text[text != SEP], np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)


def lookup(runs: Sequence[tuple[Run, int]], context: Sequence[int], width: int, min_match: int, max_matches: int,
           length: int) -> tuple[int, np.ndarray]:
    """The longest suffix of ``context`` (``min_match`` to ``width`` tokens) that some run holds with a
    continuation, and the continuations of at most ``max_matches`` of its occurrences (each run's share by its
    count, evenly spaced in its range): ``(n, rows)``, ``(0, empty)`` when nothing matches."""
    bounds = query_bounds(context, width)
    if not bounds.size:
        return 0, np.empty((0, length), dtype=np.uint32)
    found = [(run, cut, *run.ranges(bounds)) for run, cut in runs if run.keys.size]
    counts = sum((hi - lo for _, _, lo, hi in found), np.zeros(bounds.size // 2, dtype=np.int64))
    for n in range(counts.size, min_match - 1, -1):
        total = int(counts[n - 1])
        if not total:
            continue
        parts = [run.rows(int(lo[n - 1]), int(hi[n - 1]), _share(int(hi[n - 1] - lo[n - 1]), total, max_matches),
                          length, cut) for run, cut, lo, hi in found if hi[n - 1] > lo[n - 1]]
        rows = np.concatenate(parts)
        if rows.size:
            return n, rows
    return 0, np.empty((0, length), dtype=np.uint32)


def _share(count: int, total: int, most: int) -> int:
    """How many of a run's ``count`` occurrences to read when all runs hold ``total`` and ``most`` are read."""
    return count if total <= most else max(1, round(most * count / total))
