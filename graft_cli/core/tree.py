"""The candidate tree that proposers grow and the target verifies in one forward pass.

Node 0 is implicit: the root is the last accepted token, which is not stored here. A node's ``score`` is the
proposer's estimate that the target accepts the whole path to it; scores never increase along a path, so
keeping the best ``k`` nodes by score is always prefix-closed (a parent outranks its children).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Sequence

import numpy as np

ROOT = -1  # the parent of the root's children
ROOM = 256  # positions a request reserves past its last new token: room for the tree verified at its end


def best_first(scores: Sequence[float], depths: Sequence[int]) -> list[int]:
    """Node indices by score, best first; ties go to the shallower node, then to the earlier one: the order every
    selection of a tree's best nodes keeps (a parent before its children)."""
    order = sorted([(-score, depth, i) for i, (score, depth) in enumerate(zip(scores, depths))])
    return [i for _, _, i in order]


@dataclass(slots=True)  # slots: hundreds are made every step
class Node:
    token: int
    parent: int  # index of the parent node, or ROOT
    depth: int  # 1 for the root's children
    source: str  # "draft" or the name of the retriever that proposed it
    score: float
    raw: float = float("nan")  # the source's own conditional estimate before calibration (NaN: not calibrated)


class Tree:
    """Topologically ordered, prefix-closed token tree without duplicate siblings (duplicates merge).

    ``nodes`` is the public record; the index (parent -> token -> node, children in insertion order) makes
    ``add``/``child`` O(1) and ``children`` O(children), and whole-tree
    operations (masks, selection, copies, cuts) work on arrays or rebuild in one pass instead of node by node.
    """

    def __init__(self) -> None:
        self.nodes: list[Node] = []
        self._index: dict[int, dict[int, int]] = {}  # parent -> token -> node index

    def __len__(self) -> int:
        return len(self.nodes)

    def add(self, parent: int, token: int, source: str, score: float, raw: float = float("nan")) -> int:
        """Add a child of ``parent`` (or merge into the existing sibling with the same token); return its index."""
        nodes = self.nodes
        if parent == ROOT:
            depth = 1
        elif 0 <= parent < len(nodes):
            up = nodes[parent]
            depth = up.depth + 1
            if score > up.score:
                score = up.score
        else:
            raise IndexError(f"parent {parent} is not in the tree")
        token = int(token)
        kids = self._index.get(parent)
        if kids is None:
            kids = self._index[parent] = {}
        found = kids.get(token)
        if found is not None:
            node = nodes[found]
            if score > node.score:
                node.score, node.source, node.raw = score, source, raw
            return found
        kids[token] = len(nodes)
        nodes.append(Node(token, parent, depth, source, float(score), raw))
        return len(nodes) - 1

    def add_path(self, tokens: Sequence[int], scores: Sequence[float], source: str, parent: int = ROOT) -> list[int]:
        """Add a chain under ``parent``; ``scores[i]`` is the path score up to ``tokens[i]``."""
        out = []
        for token, score in zip(tokens, scores):
            parent = self.add(parent, token, source, score)
            out.append(parent)
        return out

    def child(self, parent: int, token: int) -> int | None:
        kids = self._index.get(parent)
        return kids.get(int(token)) if kids else None

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
        return list(self._index.get(parent, {}).values())

    def merge(self, other: Tree, parent_map: dict[int, int] | None = None) -> None:
        """Graft every node of ``other`` into this tree; shared prefixes continue under the existing nodes."""
        if parent_map is None and not self.nodes:  # into an empty tree: a copy
            copied = other.copy()
            self.nodes, self._index = copied.nodes, copied._index
            return
        mapping = {ROOT: ROOT} if parent_map is None else dict(parent_map)
        for i, node in enumerate(other.nodes):
            mapping[i] = self.add(mapping[node.parent], node.token, node.source, node.score, node.raw)

    def graft(self, other: Tree, budget: int) -> None:
        """Add ``other``'s nodes best-first until this tree holds ``budget`` nodes; a path that begins like one
        already here continues under it (merged nodes cost nothing)."""
        mapping = {ROOT: ROOT}
        nodes = other.nodes
        for i in other.ranked():
            node = nodes[i]
            parent = mapping.get(node.parent)
            if parent is None:  # its parent did not fit
                continue
            if len(self.nodes) >= budget and self.child(parent, node.token) is None:
                continue
            mapping[i] = self.add(parent, node.token, node.source, node.score, node.raw)

    def ranked(self) -> list[int]:
        """Node indices best first; a parent always precedes its children (scores never rise along a path)."""
        return best_first([n.score for n in self.nodes], [n.depth for n in self.nodes])

    def select(self, budget: int) -> Tree:
        """The best ``budget`` nodes by score, as a new prefix-closed tree (ties go to shallower nodes)."""
        if budget >= len(self.nodes):
            return self
        return self.subtree(sorted(self.ranked()[: max(budget, 0)]))

    def subtree(self, keep: Sequence[int]) -> Tree:
        """A new tree of the nodes ``keep`` (increasing indices, closed under parents), in one pass."""
        new = Tree()
        where = {ROOT: ROOT}
        for i in keep:
            node = self.nodes[i]
            parent = where[node.parent]
            where[i] = len(new.nodes)
            new._index.setdefault(parent, {})[node.token] = len(new.nodes)
            new.nodes.append(Node(node.token, parent, node.depth, node.source, node.score, node.raw))
        return new

    def copy(self) -> Tree:
        return self.rescored([n.score for n in self.nodes], [n.raw for n in self.nodes])

    def rescored(self, scores: Sequence[float], raws: Sequence[float]) -> Tree:
        """A copy with new node scores (the caller keeps them never above the parent's) and raw estimates: the
        same shape, built in one pass."""
        new = Tree()
        new._index = {parent: dict(kids) for parent, kids in self._index.items()}
        new.nodes = [Node(n.token, n.parent, n.depth, n.source, s, r) for n, s, r in zip(self.nodes, scores, raws)]
        return new

    def truncate(self, n: int) -> None:
        """Keep only the first ``n`` nodes (prefix-closed because nodes are topologically ordered)."""
        if n < len(self.nodes):
            del self.nodes[n:]
            self._index = {parent: {token: i for token, i in kids.items() if i < n}
                           for parent, kids in self._index.items() if parent < n}

    def within(self, vocab: int) -> Tree:
        """This tree without nodes whose token is not an id of a ``vocab``-token vocabulary, nor their subtrees
        (a plugin's bad ids must never reach the model's embedding)."""
        tokens = self.tokens()
        if not tokens or (min(tokens) >= 0 and max(tokens) < vocab):
            return self
        kept: set[int] = {ROOT}
        for i, node in enumerate(self.nodes):
            if node.parent in kept and 0 <= node.token < vocab:
                kept.add(i)
        kept.discard(ROOT)
        return self.subtree(sorted(kept))

    # --- what verification needs -------------------------------------------------------------------------
    def tokens(self) -> list[int]:
        return [n.token for n in self.nodes]

    def parents(self) -> np.ndarray:
        """Parent of each node as a row of the verified block (the root is row 0, node i is row i + 1)."""
        return np.fromiter((n.parent + 1 for n in self.nodes), dtype=np.int64, count=len(self.nodes))

    def depths(self) -> np.ndarray:
        """Depth of each verified position, the root (depth 0) first."""
        depths = np.zeros(len(self.nodes) + 1, dtype=np.int64)
        depths[1:] = np.fromiter((n.depth for n in self.nodes), dtype=np.int64, count=len(self.nodes))
        return depths

    def ancestor_mask(self) -> np.ndarray:
        """Boolean ``[N+1, N+1]``: row i may attend to column j (j is i, or an ancestor of i; the root is 0).
        Built by doubling: each row starts with itself and its parent, then takes in the rows of its 2^k-th
        ancestor, covering twice as many levels each time: log2(depth) array steps."""
        n = len(self.nodes) + 1
        up = np.zeros(n, dtype=np.int64)  # the root is its own parent, so jumps past it stay there
        up[1:] = self.parents()
        mask = np.zeros((n, n), dtype=bool)
        rows = np.arange(n)
        mask[rows, rows] = True
        mask[rows, up] = True
        jump = up  # each row's 2^k-th ancestor; the mask covers 2^k levels up
        while jump.any():
            mask |= mask[jump]
            jump = jump[jump]
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
    def from_arrays(cls, tokens: Sequence[int], parents: Sequence[int], scores: Sequence[float], source: str) -> Tree:
        """The tree of nodes given in topological order (``parents[i]``: an earlier position, or negative for the
        root's child), each added as :meth:`add` adds it (a score capped by its parent's, a duplicate sibling
        merged): how retrievers' and drafters' array results become a Tree."""
        tree, where = cls(), []
        for token, parent, score in zip(tokens, parents, scores):
            where.append(tree.add(ROOT if parent < 0 else where[parent], token, source, score))
        return tree

    @classmethod
    def from_paths(cls, paths: Iterable[Sequence[int]], source: str, score: float = 1.0) -> Tree:
        tree = cls()
        for path in paths:
            tree.add_path(path, [score] * len(path), source)
        return tree
