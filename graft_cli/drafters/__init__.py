"""Model drafters: a tree grown level by level from the drafter's own next-token distributions (EAGLE-2).

At every level the ``top_k`` best frontier nodes (by cumulative log-probability) each propose their ``top_k``
most likely children, all in ONE batched draft forward under a tree mask. Every candidate joins a pool; at the
end the best nodes of the pool by cumulative probability form the draft tree, which is prefix-closed because a
path's probability never rises along it. A node's score is ``exp(cumulative log-prob)``: the drafter's estimate
that the target accepts the whole path, comparable with a retriever's.

The pool, the frontier and the tree masks are tensors on the drafter's device, so a draft costs the host a few
kernel launches per level, not Python per node. The host reads the device once at the end (the selected nodes
and the fed rows, in one transfer), plus once at each level where a stop decision is really open: a pruning
checkpoint, the expansion floor, or a pool big enough that it may already be settled.

The subclasses only say how to run one forward (:meth:`TreeDrafter._root` for the context, :meth:`_grow` for a
level of the tree); the expansion, the pruning checkpoints, the chain mode and the bookkeeping of which tree
rows sit in the drafter's KV cache live here.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from time import perf_counter
from typing import Any, Sequence

import torch

from graft_cli.prune import Checkpoint, PruneSchedule
from graft_cli.stats import Stats
from graft_cli.tree import ROOT, Tree
from plugins.base import Step

SOURCE = "draft"


class Pool:
    """Every candidate of one draft, on the device, one block per level in insertion order (a level's nodes by
    frontier node, each one's children best first), so a pool index is a Tree index: parents precede children,
    and of two equal scores the earlier, never deeper, node ranks first."""

    def __init__(self) -> None:
        self.blocks: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []  # (tokens, parents, cum log-probs)
        self.size = 0
        self.earlier = 0  # nodes in every block but the newest

    def add(self, tokens: torch.Tensor, parents: torch.Tensor, cum: torch.Tensor) -> int:
        """Append one level's candidates; return the pool index of the first."""
        base = self.size
        self.blocks.append((tokens, parents, cum))
        self.earlier, self.size = base, base + tokens.shape[0]
        return base

    def arrays(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return tuple(torch.cat(column) for column in zip(*self.blocks))  # type: ignore[return-value]

    def settled(self, keep: int, best: torch.Tensor) -> torch.Tensor:
        """Whether ``keep`` nodes already outscore ``best`` (a deeper node's bound), as a device bool. Scores
        are compared as Tree holds them, ``exp`` in float64 (equal when both underflow)."""
        scores = torch.cat([cum for _, _, cum in self.blocks]).double().exp()
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

    def __len__(self) -> int:
        return self.nodes.shape[0]

    def head(self, n: int) -> Frontier:
        return Frontier(*(getattr(self, f.name)[:n] for f in fields(self)))


class TreeDrafter:
    """EAGLE-2 expansion with optional dynamic-depth pruning; ``chain=True`` drafts one path (top_k = 1)."""

    wants_hidden = False

    def __init__(self, depth: int = 6, top_k: int = 4, prune: PruneSchedule | None = None, chain: bool = False) -> None:
        if depth < 1 or top_k < 1:
            raise ValueError("a drafter needs depth >= 1 and top_k >= 1")
        self.depth, self.top_k, self.prune, self.chain = depth, (1 if chain else top_k), prune, chain
        self.fed: dict[int, int] = {}  # pool node -> its row in the tree block of the drafter's cache
        self.tree_rows = 0  # rows of the last draft's tree block still in the drafter's cache
        self.stopped_at: Checkpoint | None = None  # the checkpoint that stopped the last draft
        self.levels = 0  # levels the last draft grew
        self._candidates: Pool | None = None  # the last draft's pool, on the device
        self._pool: Tree | None = None  # ... as a Tree, read back only when asked for
        self._fed_children: dict[tuple[int, int], int] = {}  # (parent, token) -> fed pool node

    # --- what subclasses provide ----------------------------------------------------------------------------
    def _root(self, context: Sequence[int]) -> tuple[torch.Tensor, Any]:
        """Feed what the drafter has not seen of ``context`` (ending with the root); return the root's
        log-probabilities ``[V']`` and the state its children are fed with (or None)."""
        raise NotImplementedError

    def _grow(self, tokens: torch.Tensor, states: Any, depth: int, mask: torch.Tensor) -> tuple[torch.Tensor, Any]:
        """Feed one level of ``F`` tree nodes (``tokens``: target ids, all at ``depth``, 1 = the root's children;
        ``states``: their parents' output rows); ``mask`` ``[F, tree_rows + F]`` says which tree rows of the cache each may see.
        Return their log-probabilities ``[F, V']`` and per-row states."""
        raise NotImplementedError

    def _to_target(self, ids: torch.Tensor) -> torch.Tensor:
        """Draft vocabulary ids to target ids (identity unless the drafter has its own vocabulary)."""
        return ids

    def _drop_tree(self, keep_rows: list[int]) -> None:
        """Remove the tree block from the cache, keeping ``keep_rows`` of it (accepted, in order) as context."""
        raise NotImplementedError

    # --- the protocol -------------------------------------------------------------------------------------------
    def start(self, prompt: Sequence[int], prefill: Step) -> None:
        self._forget()
        self.tree_rows = 0

    def observe(self, step: Step) -> None:
        self._drop_tree(self._accepted_rows(step.accepted[:-1]))

    def close(self) -> None:
        pass

    @property
    def pool(self) -> Tree:
        """Every candidate of the last draft (node i is pool index i); read from the device on first use."""
        if self._pool is None:
            self._pool = Tree()
            if self._candidates is not None and self._candidates.size:
                tokens, parents, cum = (column.tolist() for column in self._candidates.arrays())
                for token, parent, logp in zip(tokens, parents, cum):
                    self._pool.add(parent, token, SOURCE, _prob(logp))
        return self._pool

    @torch.inference_mode()
    def draft(self, context: Sequence[int], budget: int, stats: Stats) -> Tree:
        clock = perf_counter()
        if self.tree_rows:  # observe() was not called after the last draft
            self._drop_tree([])
        self._forget()
        self.stopped_at, self.levels = None, 0
        if budget <= 0:
            return Tree()
        logp, state_rows = self._root(context)
        stats.draft_forwards += 1
        pool = self._candidates = Pool()
        frontier = self._children(pool, None, logp)
        # row r: the tree rows that the node fed at row r sees (its ancestors and itself); the extra last row,
        # index -1, stays empty: the root's, so the root's children look it up like every other node
        rows = (self.depth - 1) * self.top_k
        ancestors = torch.zeros((rows + 1, rows), dtype=torch.bool, device=logp.device)
        fed: list[torch.Tensor] = []  # pool indices fed, level by level
        frontier_cum, settled = [], False  # the host's copy of frontier.cum, at the levels that read it
        self.levels, keep = 1, budget
        while True:
            level, deeper = self.levels - 1, self.levels < self.depth
            chain_threshold = self.prune.chain_threshold(level) if self.chain and self.prune is not None else 0.0
            point = self.prune.at(level) if self.prune is not None and not self.chain else None
            floor = self.prune.floor if deeper and self.prune is not None and not self.chain else 0.0
            # only nodes of earlier levels can outscore the newest level's best, so a smaller pool cannot settle
            may_settle = deeper and pool.earlier >= keep
            if chain_threshold > 0 or point is not None or floor > 0 or may_settle:  # this level's one read
                read = frontier.cum.double()
                if may_settle:
                    read = torch.cat([read, pool.settled(keep, frontier.cum[0]).double()[None]])
                host = read.tolist()
                frontier_cum, settled = host[: len(frontier)], may_settle and host[-1] > 0
            if chain_threshold > 0 and _prob(frontier_cum[0]) < chain_threshold:
                keep = min(keep, pool.size - 1)  # keep the confident prefix: the newest node goes
                break
            if point is not None and self.prune.stops(level, max(frontier_cum)) is not None:
                self.stopped_at, keep = point, self.prune.keep(point, budget)
                break
            if not deeper:
                break
            if floor > 0:  # not worth a draft row; the frontier is sorted, so the worthy nodes lead
                frontier = frontier.head(sum(1 for c in frontier_cum if c >= math.log(floor)))
            if not len(frontier):
                break
            if may_settle and settled:  # no deeper node could make the cut: stop for free
                break
            # one batched forward for the whole frontier, each node seeing its parent's rows and itself
            start, end = self.tree_rows, self.tree_rows + len(frontier)
            mask = ancestors[frontier.parent_rows, :end]
            mask[:, start:].fill_diagonal_(True)
            ancestors[start:end, :end] = mask
            logp, state_rows = self._grow(frontier.tokens, _gather(state_rows, frontier.state), self.levels, mask)
            stats.draft_forwards += 1
            self.tree_rows, self.levels = end, self.levels + 1
            fed.append(frontier.nodes)
            frontier = self._children(pool, frontier, logp, start)
        tree = self._finish(pool, fed, keep)
        stats.times["draft"] += perf_counter() - clock
        return tree

    def _children(self, pool: Pool, parents: Frontier | None, logp: torch.Tensor, start: int = 0) -> Frontier:
        """Add each parent's ``top_k`` children (the root's, without ``parents``) to the pool; the best
        ``top_k`` of them are the next frontier. ``start``: the tree row of the parents' first."""
        values, ids = torch.topk(logp.float(), min(self.top_k, logp.shape[-1]), dim=-1)  # [F, k], or [k]
        tokens = self._to_target(ids).flatten()
        if parents is None:
            first = torch.arange(values.shape[0], device=values.device)
            pool.add(tokens, torch.full_like(first, ROOT), values)
            return Frontier(first, values, tokens, torch.zeros_like(first), torch.full_like(first, -1))
        per = values.shape[1]
        cum = (parents.cum[:, None] + values).flatten()
        base = pool.add(tokens, parents.nodes.repeat_interleave(per), cum)
        best_cum, best = torch.topk(cum, min(self.top_k, cum.shape[0]))
        state = best // per
        return Frontier(base + best, best_cum, tokens[best], state, start + state)

    def _finish(self, pool: Pool, fed: list[torch.Tensor], keep: int) -> Tree:
        """The selected tree, and the fed nodes' (pool index, parent, token): the draft's last read."""
        tokens, parents, cum = pool.arrays()
        chosen = pool.select(cum, keep)
        up = parents[chosen]
        inside = torch.searchsorted(chosen, up.clamp(min=0))  # a parent's place among the chosen (it always is)
        fed_nodes = torch.cat(fed) if fed else chosen[:0]
        columns = [tokens[chosen], torch.where(up < 0, up, inside), cum[chosen],
                   fed_nodes, parents[fed_nodes], tokens[fed_nodes]]
        read = torch.cat([column.double() for column in columns]).tolist()
        n, m = chosen.shape[0], fed_nodes.shape[0]
        tree, index = Tree(), []
        for token, parent, logp in zip(read[:n], read[n : 2 * n], read[2 * n : 3 * n]):
            index.append(tree.add(ROOT if parent < 0 else index[int(parent)], int(token), SOURCE, _prob(logp)))
        nodes, ups, fed_tokens = read[3 * n : 3 * n + m], read[3 * n + m : 3 * n + 2 * m], read[3 * n + 2 * m :]
        self.fed = {int(node): row for row, node in enumerate(nodes)}
        self._fed_children = {(int(up), int(token)): int(node) for node, up, token in zip(nodes, ups, fed_tokens)}
        return tree

    def _forget(self) -> None:
        self.fed, self._fed_children, self._candidates, self._pool = {}, {}, None, None

    def _accepted_rows(self, accepted: Sequence[int]) -> list[int]:
        """Tree-block rows of the accepted path's leading nodes that the drafter fed (their KV is exact)."""
        rows, node = [], ROOT
        for token in accepted:
            found = self._fed_children.get((node, int(token)))
            if found is None:
                break
            node = found
            rows.append(self.fed[node])
        return rows


def _prob(logp: float) -> float:
    return math.exp(logp)


def _gather(rows: Any, index: torch.Tensor) -> Any:
    return None if rows is None else rows.index_select(0, index)

