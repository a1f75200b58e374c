"""Lossless acceptance of a verified tree.

Every node is a deterministic proposal, so the rule is the same whoever proposed it (a drafter or a retriever):
greedy accepts the child equal to the target's argmax; sampling tries children in order, accepts child ``x`` with
probability ``p(x)``, and on rejection zeroes ``p(x)`` and renormalises; when no child is accepted the bonus token
is drawn from what is left. That keeps the output distribution exactly the target's ``p``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from graft_cli.sampling import Sampling, draw, probabilities
from graft_cli.tree import ROOT, Tree


@dataclass
class Accepted:
    nodes: list[int]  # accepted tree nodes, root to leaf
    bonus: int  # the target's own next token after the last accepted node

    def rows(self) -> list[int]:
        """Rows of the verified block to keep in the KV cache: the root and the accepted nodes."""
        return [0] + [i + 1 for i in self.nodes]


def accept(tree: Tree, logits: torch.Tensor, sampling: Sampling, generator: torch.Generator | None) -> Accepted:
    """Walk the tree from the root; ``logits[0]`` is the root's row, ``logits[i + 1]`` node i's."""
    if sampling.greedy:
        return _greedy(tree, logits)
    children: dict[int, list[int]] = {}
    for i, node in enumerate(tree.nodes):
        children.setdefault(node.parent, []).append(i)
    path, node = [], ROOT
    while True:
        p = probabilities(logits[node + 1], sampling)
        for child in children.get(node, []):
            token = tree.nodes[child].token
            if torch.rand((), generator=generator, device=p.device) < p[token]:
                path.append(child)
                node = child
                break
            p[token] = 0.0
            p = p / p.sum()
        else:
            return Accepted(path, draw(p, generator))


def _greedy(tree: Tree, logits: torch.Tensor) -> Accepted:
    """The longest path whose every token is the target's argmax after its parent: the argmax of every row is
    read in ONE device-to-host copy, then the walk is dictionary lookups."""
    best = logits.argmax(dim=-1).tolist()
    path, node = [], ROOT
    while (child := tree.child(node, best[node + 1])) is not None:
        path.append(child)
        node = child
    return Accepted(path, best[node + 1])
