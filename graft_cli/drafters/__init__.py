"""Model drafters: a tree grown level by level from the drafter's own next-token distributions (EAGLE-2).

At every level the ``top_k`` best frontier nodes (by cumulative log-probability) each propose their ``top_k``
most likely children, all in ONE batched draft forward under a tree mask. Every candidate joins a pool; at the
end the best nodes of the pool by cumulative probability form the draft tree, which is prefix-closed because a
path's probability never rises along it. A node's score is ``exp(cumulative log-prob)``: the drafter's estimate
that the target accepts the whole path, comparable with a retriever's.

The pool, the frontier and the tree masks are tensors on the drafter's device, so a draft costs the host a few
kernel launches per level, not Python per node. The host reads the device once at the end (the selected nodes
and the fed rows, in one transfer), plus once at each level where a stop decision is really open: a pruning
checkpoint, the expansion floor, a pool big enough that it may already be settled, or the cost-aware builder's
choice of depth. With a planned objective (on a GPU, where a read stalls the queue) the depth is chosen before
the draft and nothing is read until the end (graft_cli/objective.py, ``Objective.replan``).

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

import numpy as np

from graft_cli.objective import Objective
from graft_cli.prune import Checkpoint, PruneSchedule
from graft_cli.stats import Stats
from graft_cli.tree import ROOT, Tree, best_first
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
        self.forward_rows: list[int] = []  # rows fed by each forward of the last draft (what it cost)
        self.catch_up_s = 0.0  # seconds the last draft spent first reading a request's prompt (a lazy start)
        self._candidates: Pool | None = None  # the last draft's pool, on the device
        self._pool: Tree | None = None  # ... as a Tree, read back only when asked for
        self._fed_children: dict[tuple[int, int], int] = {}  # (parent, token) -> fed pool node

    # --- what subclasses provide ----------------------------------------------------------------------------
    def _root(self, context: Sequence[int]) -> tuple[torch.Tensor, Any]:
        """Feed what the drafter has not seen of ``context`` (ending with the root); return the root's
        log-probabilities ``[V']`` and the state its children are fed with (or None)."""
        raise NotImplementedError

    def _grow(self, tokens: torch.Tensor, states: Any, depth: int | torch.Tensor,
              mask: torch.Tensor) -> tuple[torch.Tensor, Any]:
        """Feed one level of ``F`` tree nodes (``tokens``: target ids at ``depth``, one for all or one per
        node, 1 = the root's children;
        ``states``: their parents' output rows); ``mask`` ``[F, tree_rows + F]`` says which tree rows of the cache each may see.
        Return their log-probabilities ``[F, V']`` and per-row states."""
        raise NotImplementedError

    def _to_target(self, ids: torch.Tensor) -> torch.Tensor:
        """Draft vocabulary ids to target ids (identity unless the drafter has its own vocabulary)."""
        return ids

    def _from_target(self, ids: torch.Tensor) -> torch.Tensor:
        """Target ids to draft vocabulary ids, -1 for a token outside the drafter's vocabulary."""
        return ids

    def _root_and_chain(self, context: Sequence[int], chain: list[int]) -> tuple[torch.Tensor, Any]:
        """The root's forward, then ``chain`` (a retrieved continuation) as one causal block of tree rows 0..n-1.
        Returns log-probabilities ``[1 + n, V']`` (the root's, then after each chain token) and the output
        states. Each chain row is fed the root's state: the chain's own states do not exist before this
        forward, so for a drafter that reads them (EAGLE) the chain's scores are estimates (the output is
        unaffected: the target verifies). A drafter that reads the context causally does both in one forward."""
        logp, states = self._root(context)
        n, device = len(chain), logp.device
        tokens = torch.tensor(chain, dtype=torch.long, device=device)
        mask = torch.ones((n, n), dtype=torch.bool, device=device).tril()
        depths = torch.arange(1, n + 1, device=device)
        grown, grown_states = self._grow(tokens, _gather(states, torch.zeros_like(depths)), depths, mask)
        self.forward_rows += [1, n]
        return torch.cat([logp[None], grown]), None if states is None else torch.cat([states, grown_states])

    def _drop_tree(self, keep_rows: list[int]) -> None:
        """Remove the tree block from the cache, keeping ``keep_rows`` of it (accepted, in order) as context."""
        raise NotImplementedError

    # --- the protocol -------------------------------------------------------------------------------------------
    def start(self, prompt: Sequence[int], prefill: Step, capacity: int) -> None:
        self._forget()
        self.tree_rows = 0

    def unread(self, context: Sequence[int]) -> int:
        """Context tokens the next draft must read first (0: a drafter that read the prompt at ``start``)."""
        return 0

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
                self._pool = Tree.from_arrays(tokens, parents, [_prob(c) for c in cum], SOURCE)
        return self._pool

    @torch.inference_mode()
    def draft(self, context: Sequence[int], budget: int, stats: Stats, chain: Sequence[int] = (),
              objective: Objective | None = None) -> Tree:
        clock = perf_counter()
        if self.tree_rows:  # observe() was not called after the last draft
            self._drop_tree([])
        self._forget()
        self.stopped_at, self.levels, self.forward_rows, self.catch_up_s = None, 0, [], 0.0
        if budget <= 0:
            return Tree()
        pool = self._candidates = Pool()
        frontier, state_rows, fed = self._first_level(pool, context, list(chain))
        cap = self.depth if objective is None else objective.max_levels
        planned = objective is not None and objective.planned and not self.chain
        # row r: the tree rows that the node fed at row r sees (itself from the start, its ancestors once fed);
        # the extra last row, index -1, stays empty: the root's, so the root's children look it up like every other
        rows = self.tree_rows + (cap - 1) * self.top_k
        ancestors = torch.eye(rows + 1, rows, dtype=torch.bool, device=frontier.cum.device)
        if self.tree_rows:  # a checked chain: each row sees those before
            ancestors[: self.tree_rows, : self.tree_rows].fill_(True).tril_()
        frontier_cum, settled, line = [], False, []  # host copies, at the levels that read them
        levels: list[tuple[torch.Tensor, int]] = []  # planned: each level's frontier (unread) and pool size
        self.levels, keep = 1, budget
        while True:
            level, deeper = self.levels - 1, self.levels < cap
            ranked = min(budget, pool.size) if objective is not None else 0
            if planned:  # the depth was chosen before the draft: nothing is read until the end
                levels.append((frontier.cum, pool.size))
                if not deeper or not len(frontier) or self.levels >= (objective.levels or cap):
                    break
            else:
                chain_threshold = self.prune.chain_threshold(level) if self.chain and self.prune is not None else 0.0
                point = self.prune.at(level) if self.prune is not None and not self.chain and objective is None else None
                floor = self.prune.floor if deeper and self.prune is not None and not self.chain else 0.0
                # only nodes of earlier levels can outscore the newest level's best, so a smaller pool cannot settle
                may_settle = deeper and pool.earlier >= keep and objective is None
                if chain_threshold > 0 or point is not None or floor > 0 or may_settle or ranked:  # this level's read
                    read = [frontier.cum.double()]
                    if may_settle:
                        read.append(pool.settled(keep, frontier.cum[0]).double()[None])
                    if ranked:
                        read.append(pool.best(ranked))
                    host = torch.cat(read).tolist()
                    frontier_cum, settled = host[: len(frontier)], may_settle and host[len(frontier)] > 0
                if chain_threshold > 0 and _prob(frontier_cum[0]) < chain_threshold:
                    keep = min(keep, pool.size - 1)  # keep the confident prefix: the newest node goes
                    break
                if point is not None and self.prune.stops(level, max(frontier_cum)) is not None:
                    self.stopped_at, keep = point, self.prune.keep(point, budget)
                    break
                if floor > 0:  # not worth a draft row; the frontier is sorted, so the worthy nodes lead
                    frontier = frontier.head(sum(1 for c in frontier_cum if c >= math.log(floor)))
                    frontier_cum = frontier_cum[: len(frontier)]
                if objective is not None:  # expected tokens per second decide the depth, and the nodes kept
                    if frontier_cum:
                        if line:
                            objective.observe_confidence(line[-1], frontier_cum[0])
                        line.append(frontier_cum[0])  # the best path's newest node
                    spent = objective.spent(perf_counter() - clock - self.catch_up_s, self.forward_rows)
                    best_path = [_prob(c) for c in line]
                    plan = objective.best(np.exp(np.array(host[len(host) - ranked :])), spent, best_path)
                    keep = plan.count
                    if not deeper or not objective.extend([_prob(c) for c in frontier_cum], plan, spent, best_path):
                        break
                elif not deeper:
                    break
                if not len(frontier):
                    break
                if may_settle and settled:  # no deeper node could make the cut: stop for free
                    break
            # one batched forward for the whole frontier, each node seeing its parent's rows and itself
            start, end = self.tree_rows, self.tree_rows + len(frontier)
            mask = ancestors[start:end, :end]
            mask |= ancestors[frontier.parent_rows, :end]
            logp, state_rows = self._grow(frontier.tokens, _gather(state_rows, frontier.state), frontier.depth, mask)
            self.forward_rows.append(len(frontier))
            self.tree_rows, self.levels = end, self.levels + 1
            fed.append(frontier.nodes)
            frontier = self._children(pool, frontier, logp, start)
        more, ranked = [], min(budget, pool.size)
        if planned:  # per level: the frontier's log-probs, and the pool's best then, in the final read
            more = [torch.cat([f for f, _ in levels]), pool.best_at([n for _, n in levels], ranked).flatten()]
        columns, read = self._finish(pool, fed, keep, more)
        count = len(columns[0])
        if planned:
            widths = np.cumsum([0] + [len(f) for f, _ in levels])
            best = read[widths[-1] :]
            walked = [(read[widths[i] : widths[i + 1]], best[i * ranked : i * ranked + min(ranked, n)])
                      for i, (_, n) in enumerate(levels)]
            count = objective.replan(walked, self.forward_rows)
        tree = Tree.from_arrays(*_best(*columns, count), SOURCE)
        stats.draft_forwards += len(self.forward_rows)
        stats.times["draft"] += perf_counter() - clock
        return tree

    def _first_level(self, pool: Pool, context: Sequence[int], chain: list[int]) -> tuple[Frontier, Any, list]:
        """The root's forward (with ``chain`` checked in it): the pool's first nodes, the first frontier, the
        output states its nodes are fed with, and the pool nodes fed so far (the chain's).

        A checked chain joins the pool as the drafter's own path, scored with the drafter's probabilities; its
        nodes were fed, so their children are candidates like any other: the drafter's alternatives where it
        disagrees with the chain and its continuation past the chain's end. Neither the root's children nor a
        chain node's include the chain's own next token (it is already there)."""
        if not chain:
            logp, state_rows = self._root(context)
            self.forward_rows.append(1)
            return self._children(pool, None, logp), state_rows, []
        logp, state_rows = self._root_and_chain(context, chain)
        device = logp.device
        tokens = torch.tensor(chain, dtype=torch.long, device=device)
        ids = self._from_target(tokens)  # draft ids; -1: a token the drafter cannot say
        said, safe = ids >= 0, ids.clamp(min=0)
        n, nodes = len(chain), torch.arange(-1, len(chain), device=device)  # the root (-1), then the chain's
        others = logp.float().clone()  # the forward's rows: the root's, then one after each chain token
        own = others[nodes[1:], safe]  # each chain token's log-prob after its prefix
        never = torch.full_like(own, -math.inf)
        cum = torch.cumsum(torch.where(said, own, never), 0)
        pool.add(tokens, nodes[:-1], cum)  # pool indices 0..n-1; node 0's parent is ROOT (-1)
        self.tree_rows = n
        others[nodes[1:], safe] = torch.where(said, never, own)  # a row's children leave out the chain's next token
        # the root and every chain node expand together, as one level whose rows are the forward's: row 0 the
        # root's (tree row -1, depth 0, path log-prob 0), row i + 1 chain node i's (tree row i, depth i + 1)
        rows = Frontier(nodes, torch.cat([cum.new_zeros(1), cum]), nodes, nodes, nodes, nodes + 1)
        return self._children(pool, rows, others, -1), state_rows, [nodes[1:]]

    def _children(self, pool: Pool, parents: Frontier | None, logp: torch.Tensor, start: int = 0) -> Frontier:
        """Add each parent's ``top_k`` children (the root's, without ``parents``) to the pool; the best
        ``top_k`` of them are the next frontier. ``start``: the tree row of the parents' first."""
        logp = logp if logp.dtype == torch.float32 else logp.float()
        values, ids = torch.topk(logp, min(self.top_k, logp.shape[-1]), dim=-1)  # [F, k], or [k]
        tokens = self._to_target(ids).view(-1)
        if parents is None:
            first = torch.arange(values.shape[0], device=values.device)
            base = pool.add(tokens, torch.full_like(first, ROOT), values)
            return Frontier(first + base, values, tokens, torch.zeros_like(first), torch.full_like(first, -1), 1)
        per = values.shape[1]
        cum = (values + parents.cum.unsqueeze(1)).view(-1)
        base = pool.add(tokens, parents.nodes.repeat_interleave(per), cum)
        best_cum, best = torch.topk(cum, min(self.top_k, cum.shape[0]))
        which = best.div(per, rounding_mode="floor")
        depth = parents.depth + 1 if isinstance(parents.depth, int) else parents.depth[which] + 1
        return Frontier(best.add(base), best_cum, tokens[best], which, which.add(start), depth)

    def _finish(self, pool: Pool, fed: list[torch.Tensor], keep: int,
                more: Sequence[torch.Tensor] = ()) -> tuple[tuple[list[int], list[int], list[float]], list[float]]:
        """The selected nodes (tokens, parents among them, scores), and the fed nodes' (pool index, parent,
        token): the draft's last read, which also brings ``more`` over (returned as one list)."""
        tokens, parents, cum = pool.arrays()
        chosen = pool.select(cum, keep)
        up = parents[chosen]
        inside = torch.searchsorted(chosen, up.clamp(min=0))  # a parent's place among the chosen (it always is)
        fed_nodes = torch.cat(fed) if fed else chosen[:0]
        ids = torch.cat([tokens[chosen], torch.where(up < 0, up, inside),
                         fed_nodes, parents[fed_nodes], tokens[fed_nodes]])
        read = torch.cat([ids.double(), cum[chosen].double(), *(column.double() for column in more)]).tolist()
        n, m = chosen.shape[0], fed_nodes.shape[0]
        columns = ([int(t) for t in read[:n]], [int(p) for p in read[n : 2 * n]],
                   [_prob(c) for c in read[2 * n + 3 * m : 3 * n + 3 * m]])
        nodes, ups, fed_tokens = (read[2 * n + i * m : 2 * n + (i + 1) * m] for i in range(3))
        self.fed = {int(node): row for row, node in enumerate(nodes)}
        self._fed_children = {(int(up), int(token)): int(node) for node, up, token in zip(nodes, ups, fed_tokens)}
        return columns, read[3 * n + 3 * m :]

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


def _best(tokens: list[int], parents: list[int], scores: list[float],
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


def positions(base: int, depth: int | torch.Tensor, n: int, device: torch.device) -> torch.Tensor:
    """Position ids of ``n`` tree nodes at ``depth`` (one for all, or a tensor of one per node) below ``base``."""
    if isinstance(depth, torch.Tensor):
        return base + depth
    return torch.full((n,), base + depth, dtype=torch.long, device=device)


def _gather(rows: Any, index: torch.Tensor) -> Any:
    return None if rows is None else rows.index_select(0, index)

