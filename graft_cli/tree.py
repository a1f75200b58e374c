"""The candidate tree that proposers grow and the target verifies in one forward pass.

Node 0 is implicit: the root is the last accepted token, which is not stored here. A node's ``score`` is the
proposer's estimate that the target accepts the whole path to it; scores never increase along a path, so
keeping the best ``k`` nodes by score is always prefix-closed (a parent outranks its children).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Sequence

import numpy as np

ROOT = -1


@dataclass
class Node:
    token: int
    parent: int  # index of the parent node, or ROOT
    depth: int  # 1 for the root's children
    source: str  # "draft" or the name of the retriever that proposed it
    score: float
    raw: float = float("nan")  # the source's own conditional estimate before calibration (NaN: not calibrated)


class Tree:
    """Topologically ordered, prefix-closed token tree without duplicate siblings (duplicates merge)."""

    def __init__(self) -> None:
        self.nodes: list[Node] = []
        self._index: dict[tuple[int, int], int] = {}  # (parent, token) -> node index

    def __len__(self) -> int:
        return len(self.nodes)

    def add(self, parent: int, token: int, source: str, score: float, raw: float = float("nan")) -> int:
        """Add a child of ``parent`` (or merge into the existing sibling with the same token); return its index."""
        if parent != ROOT and not 0 <= parent < len(self.nodes):
            raise IndexError(f"parent {parent} is not in the tree")
        if parent != ROOT:
            score = min(score, self.nodes[parent].score)
        key = (parent, int(token))
        found = self._index.get(key)
        if found is not None:
            node = self.nodes[found]
            if score > node.score:
                node.score, node.source, node.raw = score, source, raw
            return found
        depth = 1 if parent == ROOT else self.nodes[parent].depth + 1
        self.nodes.append(Node(int(token), parent, depth, source, float(score), raw))
        self._index[key] = len(self.nodes) - 1
        return len(self.nodes) - 1

    def add_path(self, tokens: Sequence[int], scores: Sequence[float], source: str, parent: int = ROOT) -> list[int]:
        """Add a chain under ``parent``; ``scores[i]`` is the path score up to ``tokens[i]``."""
        out = []
        for token, score in zip(tokens, scores):
            parent = self.add(parent, token, source, score)
            out.append(parent)
        return out

    def child(self, parent: int, token: int) -> int | None:
        return self._index.get((parent, int(token)))

    def follow(self, tokens: Sequence[int]) -> list[int]:
        """The nodes along ``tokens`` from the root, as far as the tree goes (what greedy acceptance would take)."""
        path, node = [], ROOT
        for token in tokens:
            node = self.child(node, token)
            if node is None:
                break
            path.append(node)
        return path

    def children(self, parent: int) -> list[int]:
        """Children of ``parent`` in insertion order (best first when proposers add best first)."""
        return [i for i, n in enumerate(self.nodes) if n.parent == parent]

    def merge(self, other: Tree, parent_map: dict[int, int] | None = None) -> None:
        """Graft every node of ``other`` into this tree; shared prefixes continue under the existing nodes."""
        mapping = {ROOT: ROOT} if parent_map is None else dict(parent_map)
        for i, node in enumerate(other.nodes):
            mapping[i] = self.add(mapping[node.parent], node.token, node.source, node.score, node.raw)

    def graft(self, other: Tree, budget: int) -> None:
        """Add ``other``'s nodes best-first until this tree holds ``budget`` nodes; a path that begins like one
        already here continues under it (merged nodes cost nothing)."""
        mapping = {ROOT: ROOT}
        for i in other.ranked():
            node = other.nodes[i]
            if node.parent not in mapping:  # its parent did not fit
                continue
            if len(self.nodes) >= budget and self.child(mapping[node.parent], node.token) is None:
                continue
            mapping[i] = self.add(mapping[node.parent], node.token, node.source, node.score, node.raw)

    def ranked(self) -> list[int]:
        """Node indices best first; a parent always precedes its children (scores never rise along a path)."""
        return sorted(range(len(self.nodes)), key=lambda i: (-self.nodes[i].score, self.nodes[i].depth, i))

    def select(self, budget: int) -> Tree:
        """The best ``budget`` nodes by score, as a new prefix-closed tree (ties go to shallower nodes)."""
        if budget >= len(self.nodes):
            return self
        keep = sorted(self.ranked()[: max(budget, 0)])
        new = Tree()
        mapping = {ROOT: ROOT}
        for i in keep:
            node = self.nodes[i]
            mapping[i] = new.add(mapping[node.parent], node.token, node.source, node.score, node.raw)
        return new

    # --- what verification needs -------------------------------------------------------------------------
    def tokens(self) -> list[int]:
        return [n.token for n in self.nodes]

    def depths(self) -> np.ndarray:
        """Depth of each verified position, the root (depth 0) first."""
        return np.array([0] + [n.depth for n in self.nodes], dtype=np.int64)

    def ancestor_mask(self) -> np.ndarray:
        """Boolean ``[N+1, N+1]``: row i may attend to column j (j is i, or an ancestor of i; the root is 0)."""
        n = len(self.nodes) + 1
        mask = np.zeros((n, n), dtype=bool)
        mask[0, 0] = True
        for i, node in enumerate(self.nodes, start=1):
            mask[i] = mask[node.parent + 1]
            mask[i, i] = True
        return mask

    def paths(self) -> list[list[int]]:
        """Root-to-leaf paths as lists of node indices."""
        has_child = {n.parent for n in self.nodes}
        out = []
        for i in range(len(self.nodes)):
            if i in has_child:
                continue
            path = [i]
            while self.nodes[path[-1]].parent != ROOT:
                path.append(self.nodes[path[-1]].parent)
            out.append(path[::-1])
        return out

    @classmethod
    def from_paths(cls, paths: Iterable[Sequence[int]], source: str, score: float = 1.0) -> Tree:
        tree = cls()
        for path in paths:
            tree.add_path(path, [score] * len(path), source)
        return tree
