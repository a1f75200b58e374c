"""Lossless acceptance of a verified tree.

Every node is a deterministic proposal, so the rule is the same whoever proposed it (a drafter or a retriever):
at every verified row the target's own token is computed -- the argmax when greedy, ``argmax(log p + G)`` with the
position's fixed Gumbel noise when sampling (graft_cli/runtime/sampling.py) -- and the child equal to it is accepted;
where no child is, that token is the bonus. So the accepted text is exactly the text plain decoding produces with
the same seed, whatever the tree holds, and its distribution is the target's ``p``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from graft_cli.runtime.sampling import Noise, Sampling, sample
from graft_cli.core import ROOT, Tree


@dataclass
class Accepted:
    nodes: list[int]  # accepted tree nodes, root to leaf
    bonus: int  # the target's own next token after the last accepted node

    def rows(self) -> list[int]:
        """Rows of the verified block to keep in the KV cache: the root and the accepted nodes."""
        return [0] + [i + 1 for i in self.nodes]


def accept(tree: Tree, logits: torch.Tensor, sampling: Sampling, noise: Noise | None = None, position: int = 0) -> Accepted:
    """Walk the tree from the root; ``logits[0]`` is the root's row, ``logits[i + 1]`` node i's. ``position``: the
    generated-token index the root's row chooses (sampling keys its noise by it)."""
    if sampling.greedy:
        best = logits.argmax(dim=-1).tolist()
    else:
        if noise is None:
            raise ValueError("sampling needs noise: a seed")
        best = sample(logits, sampling, noise, position, tree.depths()).tolist()
    path, node = [], ROOT
    while (child := tree.child(node, best[node + 1])) is not None:
        path.append(child)
        node = child
    return Accepted(path, best[node + 1])
