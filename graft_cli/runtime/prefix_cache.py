"""Requests that begin alike share the work: the KV rows of earlier requests, the target's and the drafter's own,
kept in a radix tree over token ids, so a request that begins with tokens the tree holds feeds only the rest.

Why a radix tree and not fixed blocks: a block cache (hashing every 16 tokens, say) matches only whole blocks, so
a hit loses up to a block of its tail, and under speculation a drafter's state whose rows lag the target's by one
(an EAGLE-3 head's pair reads the next token) loses a block more. The tree matches to the token, stores a shared
beginning (an agent's policy, a chat's history) once however many requests branch from it, and its nodes are the
units eviction drops: the least recently used leaf first, until the rows kept fit the memory budget.

Each node is a run of tokens ``[start, end)`` of the key and, for each *part* (the target, then the drafter when
it keeps a cache of its own), a copy of that part's rows for those positions (``PositionCache.take``). A part
whose row ``r`` depends on the tokens up to ``r + lag`` stores it at key position ``r + lag``, so a branch that
differs at the token after a row never reuses it. A part's rows run from position 0 without a gap, up to where a
node holds fewer than its tokens (a request whose drafter read less than the target).

Nothing here decides a token: a restored row is the row a forward over the same tokens computes (the prefill's
split differs, which moves fp32 logits by about 1e-6: docs/serve.md, "Prefix cache").
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence

import torch

from graft_cli.core import GraftError
from graft_cli.core.defaults import PREFIX_CACHE_MIB
from graft_cli.runtime.kv_cache import PositionCache, Rows

MIB = 2**20


@dataclass
class Part:
    """One party of a request's state: its cache, how many leading rows of the context it holds, its lag."""

    cache: PositionCache
    rows: int
    lag: int = 0

    def covers(self, length: int) -> int:
        """Key positions it covers when ``length`` key tokens are stored."""
        return min(self.rows + self.lag, length)


@dataclass
class Segment:
    """A part's rows for the key positions ``[node.start, end)`` (those below its lag have none)."""

    rows: Rows | None
    end: int

    @property
    def bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.rows or () if t is not None)


@dataclass(eq=False)
class Node:
    tokens: list[int]
    start: int
    parent: Node | None = None
    children: dict[int, Node] = field(default_factory=dict)
    segments: list[Segment | None] = field(default_factory=list)
    tick: int = 0

    @property
    def end(self) -> int:
        return self.start + len(self.tokens)

    @property
    def bytes(self) -> int:
        return sum(s.bytes for s in self.segments if s is not None)


@dataclass
class Totals:
    """What the cache did over its life (``/metrics``, ``Generator.prefix_stats``)."""

    lookups: int = 0
    hits: int = 0  # lookups that restored at least one target row
    cached_tokens: int = 0  # prompt tokens not fed again, all lookups together
    evicted: int = 0  # nodes dropped to stay within the budget

    def as_dict(self) -> dict:
        return dict(lookups=self.lookups, hits=self.hits, cached_tokens=self.cached_tokens, evicted=self.evicted)


class PrefixCache:
    """The rows of earlier requests of one target and its drafter, within ``budget`` bytes."""

    def __init__(self, budget: int, target: Any, drafter: Any = None) -> None:
        self.budget, self.target = budget, target
        self.drafter = drafter if drafter is not None and drafter.state(()) is not None else None
        self.root = Node([], 0)
        self.bytes = 0
        self.ticks = 0
        self.totals = Totals()

    @property
    def nodes(self) -> int:
        return sum(1 for _ in _walk(self.root)) - 1

    def figures(self) -> dict:
        """Its totals, the bytes it holds and its nodes (a server's ``/metrics``)."""
        return {**self.totals.as_dict(), "bytes": self.bytes, "nodes": self.nodes}

    def _parts(self, context: Sequence[int]) -> list[Part]:
        """The target's part, then the drafter's where it keeps one."""
        parts = [Part(self.target.cache, self.target.length)]
        if self.drafter is not None:
            cache, rows = self.drafter.state(context)
            parts.append(Part(cache, rows, self.drafter.lag))
        return parts

    # --- a request's start ------------------------------------------------------------------------------------
    @torch.inference_mode()
    def resume(self, prompt: Sequence[int], capacity: int) -> int:
        """Write what the tree holds of ``prompt`` into the target's cache (and the drafter's) for a request of up
        to ``capacity`` positions; returns the target's rows written (at most all but the prompt's last token,
        whose forward gives the first token). A drafter that reads the target's states from where it resumes (an
        EAGLE-3 head) resumes exactly there."""
        self.ticks += 1
        path, matched = self._match(prompt)
        target = min(self._usable(path, matched, 0, 0), len(prompt) - 1)
        drafted = 0
        if self.drafter is not None:
            drafted = min(self._usable(path, matched, 1, self.drafter.lag), len(prompt) - 1)
            if self.drafter.needs.hidden:
                target = drafted = min(target, drafted)
        if target > 0:
            self.target.cache.load(self._pieces(path, 0, 0, target), capacity)
        if self.drafter is not None:
            if drafted > 0:
                cache, _ = self.drafter.state(())
                cache.load(self._pieces(path, 1, self.drafter.lag, drafted), capacity)
            self.drafter.resume(drafted)
        self.totals.lookups += 1
        self.totals.hits += target > 0
        self.totals.cached_tokens += target
        return target

    def _match(self, key: Sequence[int]) -> tuple[list[tuple[Node, int]], int]:
        """The nodes ``key`` runs through, each with how many of its tokens match, and the matched length."""
        node, at, path = self.root, 0, []
        while at < len(key):
            child = node.children.get(key[at])
            if child is None:
                break
            n = _common(child.tokens, key[at : at + len(child.tokens)])
            child.tick = self.ticks
            path.append((child, n))
            at += n
            if n < len(child.tokens):
                break
            node = child
        return path, at

    @staticmethod
    def _usable(path: list[tuple[Node, int]], matched: int, part: int, lag: int) -> int:
        """Rows of ``part`` the matched tokens determine: its gapless run from position 0, minus its lag."""
        covered = 0
        for node, n in path:
            segment = node.segments[part] if part < len(node.segments) else None
            if segment is None:
                break
            covered = min(segment.end, node.start + n)
            if segment.end < node.end:
                break
        return max(0, min(covered, matched) - lag)

    @staticmethod
    def _pieces(path: list[tuple[Node, int]], part: int, lag: int, rows: int) -> list[Rows]:
        """The first ``rows`` rows of ``part`` along ``path``, as runs in position order."""
        pieces, done = [], 0
        for node, _ in path:
            segment = node.segments[part]
            if done >= rows:
                break
            if segment.rows is None:
                continue
            length = next(t for t in segment.rows if t is not None).shape[-2]
            take = min(length, rows - done)
            pieces.append([None if t is None else t[..., :take, :] for t in segment.rows])
            done += take
        return pieces

    # --- a request's end --------------------------------------------------------------------------------------
    @torch.inference_mode()
    def store(self, context: Sequence[int]) -> None:
        """Keep what the target and the drafter hold of ``context`` (the target: every token but the last, which
        the next step would feed), copying only the rows the tree lacks; then evict to the budget."""
        parts = self._parts(context)
        key = list(context[: parts[0].rows])
        if not key:
            return
        self.ticks += 1
        node, at = self.root, 0
        while at < len(key):
            child = node.children.get(key[at])
            if child is None:
                child = Node(key[at:], at, node)
                node.children[key[at]] = child
            n = _common(child.tokens, key[at : at + len(child.tokens)])
            if n < len(child.tokens):
                self._split(child, n)
            self._fill(child, parts, len(key))
            child.tick = self.ticks
            node, at = child, at + n
        self._evict()

    def _fill(self, node: Node, parts: list[Part], length: int) -> None:
        """Give ``node`` each part's rows where it holds fewer than the part now covers."""
        while len(node.segments) < len(parts):
            node.segments.append(None)
        for i, part in enumerate(parts):
            held = node.segments[i]
            end = min(node.end, part.covers(length))
            if end <= node.start or (held is not None and held.end >= end):
                continue
            low, high = max(node.start, part.lag) - part.lag, end - part.lag
            rows = part.cache.take(low, high) if high > low else None
            self.bytes -= held.bytes if held is not None else 0
            node.segments[i] = Segment(rows, end)
            self.bytes += node.segments[i].bytes

    def _split(self, node: Node, n: int) -> None:
        """Cut ``node`` after its first ``n`` tokens: the rest becomes its only child, with the rows past there."""
        lower = Node(node.tokens[n:], node.start + n, node, node.children, [], node.tick)
        for child in lower.children.values():
            child.parent = lower
        cut = node.start + n
        for i, segment in enumerate(node.segments):
            upper_segment, lower_segment = _cut(segment, node.start, cut, self._lag(i))
            node.segments[i] = upper_segment
            lower.segments.append(lower_segment)
        node.tokens, node.children = node.tokens[:n], {lower.tokens[0]: lower}

    def _lag(self, part: int) -> int:
        return 0 if part == 0 or self.drafter is None else self.drafter.lag

    def _evict(self) -> None:
        """Drop the least recently used leaves until the rows kept fit the budget."""
        while self.bytes > self.budget:
            leaf = min((n for n in _walk(self.root) if not n.children and n is not self.root), key=lambda n: n.tick,
                       default=None)
            if leaf is None:
                return
            self.bytes -= leaf.bytes
            del leaf.parent.children[leaf.tokens[0]]
            self.totals.evicted += 1


def _cut(segment: Segment | None, start: int, cut: int, lag: int) -> tuple[Segment | None, Segment | None]:
    """A segment of a node starting at ``start``, split at key position ``cut``: the rows before it and after."""
    if segment is None:
        return None, None
    if segment.end <= cut:
        return segment, None
    if segment.rows is None:  # positions below the lag only
        return Segment(None, cut), Segment(None, segment.end)
    k = max(0, cut - max(start, lag))
    upper = [None if t is None else t[..., :k, :].clone() for t in segment.rows] if k else None
    lower = [None if t is None else t[..., k:, :].clone() for t in segment.rows]
    return Segment(upper, cut), Segment(lower, segment.end)


def _walk(node: Node):
    yield node
    for child in node.children.values():
        yield from _walk(child)


def _common(held: Sequence[int], key: Sequence[int]) -> int:
    """How many leading tokens ``held`` and ``key`` share."""
    n = 0
    for a, b in zip(held, key):
        if a != b:
            break
        n += 1
    return n



def prefix_cache_for(mib: float, target: Any, drafter: Any = None) -> PrefixCache | None:
    """A prefix cache of ``mib`` MiB for ``target`` and its drafter; None for 0 (off)."""
    if mib < 0:
        raise GraftError(f"the prefix cache's budget must be 0 (off) or more MiB, got {mib}")
    return PrefixCache(int(mib * MIB), target, drafter) if mib else None
