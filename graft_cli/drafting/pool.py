"""A draft's candidates on the device: the pool of every node it proposed, the frontier the next level expands, the
positions its nodes are fed at, and the best of them chosen before any Tree is built.

Both stay on the drafter's device for the whole draft, so a level costs the host a few kernel launches, not
Python per node; the stop policy (stop.py) reads from them only what its rule needs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import Sequence

import torch

from graft_cli.core import best_first


class Pool:
    """Every candidate of one draft, on the device, one block per level in insertion order (a level's nodes by
    frontier node, each one's children best first), so a pool index is a Tree index: parents precede children,
    and of two equal scores the earlier, never deeper, node ranks first."""

    def __init__(self) -> None:
        self.blocks: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []  # (tokens, parents, cum log-probs)
        self.size = 0
        self.earlier = 0  # nodes in every block but the newest
        self._joined: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None  # the blocks, concatenated

    def add(self, tokens: torch.Tensor, parents: torch.Tensor, cum: torch.Tensor) -> int:
        """Append one level's candidates; return the pool index of the first."""
        base = self.size
        self.blocks.append((tokens, parents, cum))
        self.earlier, self.size, self._joined = base, base + tokens.shape[0], None
        return base

    def arrays(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Tokens, parents and cumulative log-probs of the whole pool (concatenated once per level added)."""
        if self._joined is None:
            self._joined = tuple(torch.cat(column) for column in zip(*self.blocks))  # type: ignore[assignment]
        return self._joined  # type: ignore[return-value]

    def best(self, n: int) -> torch.Tensor:
        """The ``n`` best cumulative log-probs of the pool, best first (float64, for one read)."""
        return torch.topk(self.arrays()[2].double(), n).values

    def best_at(self, sizes: Sequence[int], n: int) -> torch.Tensor:
        """``[len(sizes), n]``: for each earlier size of the pool, the ``n`` best cumulative log-probs of its
        nodes then (-inf past them), best first: a planned draft's levels, in one call."""
        cum = self.arrays()[2].double()
        then = torch.arange(cum.shape[0], device=cum.device)[None] < torch.tensor(sizes, device=cum.device)[:, None]
        return torch.topk(torch.where(then, cum[None], -math.inf), n, dim=1).values

    def settled(self, keep: int, best: torch.Tensor) -> torch.Tensor:
        """Whether ``keep`` nodes already outscore ``best`` (a deeper node's bound), as a device bool. Scores
        are compared as Tree holds them, ``exp`` in float64 (equal when both underflow)."""
        scores = self.arrays()[2].double().exp()
        return torch.topk(scores, keep).values[-1] > best.double().exp()

    def select(self, cum: torch.Tensor, keep: int) -> torch.Tensor:
        """Pool indices of the best ``keep`` nodes by ``cum`` (the pool's), ascending: what Tree.select keeps."""
        if keep >= self.size:
            return torch.arange(self.size, device=cum.device)
        order = torch.sort(cum.double().exp(), descending=True, stable=True).indices[: max(keep, 0)]
        return order.sort().values


@dataclass
class Frontier:
    """The nodes the next level expands, best first, on the device."""

    nodes: torch.Tensor  # pool indices
    cum: torch.Tensor  # cumulative log-probs (float32)
    tokens: torch.Tensor  # target ids
    state: torch.Tensor  # row of the last forward's states each one is fed with
    parent_rows: torch.Tensor  # tree row its parent was fed at (-1: the root)
    depth: torch.Tensor | int  # its depth in the tree (1: a child of the root); one for all when they share it

    def __len__(self) -> int:
        return self.nodes.shape[0]

    def head(self, n: int) -> Frontier:
        values = (getattr(self, f.name) for f in fields(self))
        return Frontier(*(value if isinstance(value, int) else value[:n] for value in values))


def best_nodes(tokens: list[int], parents: list[int], scores: list[float],
          count: int) -> tuple[list[int], list[int], list[float]]:
    """Of nodes in topological order (``parents``: earlier positions, negative for the root's children), the best
    ``count`` as :meth:`Tree.select` ranks them (score, then depth, then position), before any Tree is built."""
    if count >= len(tokens):
        return tokens, parents, scores
    depth: list[int] = []
    for up in parents:
        depth.append(1 if up < 0 else depth[up] + 1)
    kept = sorted(best_first(scores, depth)[: max(count, 0)])
    where = {old: new for new, old in enumerate(kept)}
    return ([tokens[i] for i in kept], [where[parents[i]] if parents[i] >= 0 else -1 for i in kept],
            [scores[i] for i in kept])


def positions(base: int | torch.Tensor, depth: int | torch.Tensor, n: int, device: torch.device) -> torch.Tensor:
    """Position ids of ``n`` tree nodes at ``depth`` (one for all, or a tensor of one per node) below ``base`` (a
    host int, or a device ``[1]`` for a draft queued before the step's read)."""
    if isinstance(depth, torch.Tensor):
        return base + depth
    if isinstance(base, torch.Tensor):
        return (base + depth).expand(n)
    return torch.full((n,), base + depth, dtype=torch.long, device=device)
