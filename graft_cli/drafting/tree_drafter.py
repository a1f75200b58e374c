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
the draft and nothing is read until the end (graft_cli/drafting/objective.py, ``Objective.replan``). On the
fixed-shape path such a draft is queued ahead (:meth:`TreeDrafter.queue`): grown from the step's result
before the host reads it, and read with it, so that a step with a draft reads the device once.

The subclasses only say how to run one forward (:meth:`TreeDrafter._root` for the context, :meth:`_grow` for a
level of the tree); the expansion, the pruning checkpoints, the chain mode and the bookkeeping of which tree
rows sit in the drafter's KV cache live here.
"""

from __future__ import annotations

import math
from functools import partial
from typing import Any, Callable, Sequence

import torch


from graft_cli.drafting.fixed_levels import FixedLevels
from graft_cli.drafting.objective import Objective
from graft_cli.drafting.pool import Frontier, Pool, best_nodes
from graft_cli.drafting.stop import ChainThreshold, Checkpoints, PerLevel, Planned, StopPolicy
from graft_cli.core import Checkpoint, DrafterDefaults, DrafterEnv, Outcome, PruneSchedule, ROOT, Step, Tree
from graft_cli.runtime.graphs import Capture

SOURCE = "draft"
Columns = tuple[list[int], list[int], list[float]]  # a draft's selected nodes: tokens, parents, scores
Parsed = tuple[Columns, list[float]]  # ... and the rest of its read
Landing = Callable[[Sequence[float]], Tree]  # a queued draft's read -> its tree


class TreeDrafter(DrafterDefaults):
    """EAGLE-2 expansion with optional dynamic-depth pruning; ``chain=True`` drafts one path (top_k = 1). The
    declarations it shares with every drafter (needs, recorder, what the last draft cost) come from
    :class:`DrafterDefaults`."""

    before_read = True  # on the fixed-shape path, draft before the step's read where it can (_root_queued)

    def __init__(self, depth: int = 6, top_k: int = 4, prune: PruneSchedule | None = None, chain: bool = False) -> None:
        if depth < 1 or top_k < 1:
            raise ValueError("a drafter needs depth >= 1 and top_k >= 1")
        super().__init__()
        self.depth, self.top_k, self.prune, self.chain = depth, (1 if chain else top_k), prune, chain
        self.fed: dict[int, int] = {}  # pool node -> its row in the tree block of the drafter's cache
        self.tree_rows = 0  # rows of the last draft's tree block still in the drafter's cache
        self.stopped_at: Checkpoint | None = None  # the checkpoint that stopped the last draft
        self.forward_rows: list[int] = []  # rows fed by each forward of the last draft (what it cost)
        self._candidates: Pool | None = None  # the last draft's pool, on the device
        self._pool: Tree | None = None  # ... as a Tree, read back only when asked for
        self._fed_children: dict[tuple[int, int], int] = {}  # (parent, token) -> fed pool node
        self.fixed: FixedLevels | None = None  # set: every tree level runs at a fixed shape (fixed_levels.py)
        self._landing: Landing | None = None  # a draft queued ahead, until the step's read brings it back
        self._landed: Tree | None = None  # ... made a tree, until draft() hands it over
        self.base: torch.Tensor | None = None  # ... a step's: the drafter's context rows after it, on the device
        self.most = 0  # ... and the most they may be (what the cache must hold)

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

    def _root_queued(self, outcome: Outcome, context: Sequence[int], budget: int) -> tuple[torch.Tensor, Any] | None:
        """:meth:`_root` from a step's result still on the device (:meth:`queue`): the root's log-probabilities
        and state, or None where this drafter cannot or need not (it then reads the step's tokens after the read,
        as usual)."""
        return None

    def _count_fed(self, rows: int) -> None:
        """The step fed before its read kept ``rows`` rows (the root's included): now the host knows, count them."""

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

    def fix_levels(self, capture: Capture | None) -> bool:
        """Run every tree level at a fixed shape, captured by ``capture`` (graft_cli/drafting/fixed_levels.py);
        whether this drafter can (a subclass that can says so)."""
        return False

    def following(self, env: DrafterEnv) -> TreeDrafter:
        """This drafter with its levels at fixed shapes when the target's steps are (``env.shapes``), captured the
        way the target's are: what a plugin factory returns."""
        if env.shapes is not None:
            self.fix_levels(env.shapes.capture)
        return self

    # --- the protocol -------------------------------------------------------------------------------------------
    def start(self, prompt: Sequence[int], prefill: Step, capacity: int) -> None:
        if self.queued_at == "start":  # started at the prefill, before its read: the first draft came with it
            self.queued_at = None
            self._land(prefill)
            return
        self._reset()

    def _reset(self) -> None:
        """Forget the last request's draft, queued ahead or not."""
        self.queued_at, self._landing, self._landed, self.base = None, None, None, None
        self._forget()
        self.tree_rows = 0

    @property
    def landed(self) -> bool:
        """Whether a draft queued ahead came back with the last read (the next draft() hands it over)."""
        return self._landed is not None

    def observe(self, step: Step) -> None:
        if self.queued_at == "step":  # fed already, and the next draft queued, before the step's read
            self.queued_at, self.base = None, None
            self._count_fed(len(step.kept))
            self._land(step)
            return
        self._drop_tree(self._accepted_rows(step.accepted[:-1]))

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
    def draft(self, context: Sequence[int], budget: int, chain: Sequence[int] = (),
              objective: Objective | None = None) -> Tree:
        """The expansion loop: a level of the tree per forward, each frontier node seeing its ancestors' rows, until
        the stop policy ends the draft; then the kept nodes, read in one transfer. A draft queued ahead
        (:meth:`queue`) came back with the last step's read: it is handed over as it is."""
        if self._landed is not None:
            tree, self._landed = self._landed, None
            self._count(self.queue_s)
            return tree
        clock = self.recorder.clock()
        if self.tree_rows:  # observe() was not called after the last draft
            self._drop_tree([])
        self._forget()
        self.stopped_at, self.levels, self.forward_rows, self.catch_up_s = None, 0, [], 0.0
        if budget <= 0:
            return Tree()
        read, land = self._queue(budget, objective, clock, lambda pool: self._first_level(pool, context, list(chain)))
        tree = land(read.tolist())
        self._count(self.recorder.clock() - clock)
        return tree

    def _count(self, seconds: float) -> None:
        """The last draft's forwards and ``seconds`` into the request's stats."""
        self.recorder.stats.draft_forwards += len(self.forward_rows)
        self.recorder.add("draft", seconds)

    def queue(self, outcome: Outcome, context: Sequence[int], budget: int,
                    objective: Objective | None) -> torch.Tensor | None:
        """Queue the next step's draft before this step's result is read (the fixed-shape path): feed what
        ``outcome`` holds on the device (the tokens after ``context``, the context before the step) and, with a
        ``budget``, grow the draft from them. Returns what the step's one read must bring back for
        :meth:`observe` to make the tree of (None: no draft). Only a planned objective drafts ahead: any other
        rule reads the device between levels."""
        clock = self.recorder.clock()
        self._landing = None
        if not self.queues(objective):
            return None
        if self.tree_rows:  # the verified draft's rows: the accepted ones are fed again, with the target's states
            self._drop_tree([])
        self._forget()
        self.stopped_at, self.levels, self.forward_rows, self.catch_up_s = None, 0, [1], 0.0
        root = self._root_queued(outcome, context, budget)
        if root is None:
            return None
        self.queued_at = "start" if outcome.start else "step"
        if budget <= 0:
            return None
        read, self._landing = self._queue(budget, objective, clock,
                                          lambda pool: (self._children(pool, None, root[0]), root[1], []))
        self.queue_s = self.recorder.clock() - clock
        return read

    def queues(self, objective: Objective | None) -> bool:
        """Whether :meth:`queue` drafts for ``objective``: on fixed-shape levels, planned, not a chain."""
        planned = objective is not None and objective.planned
        return self.before_read and self.fixed is not None and planned and not self.chain

    def _land(self, step: Step) -> None:
        """The draft queued ahead, made a tree from what ``step``'s read brought back (the next draft() hands it
        over)."""
        landing, self._landing = self._landing, None
        self._landed = landing(step.queued) if landing is not None and step.queued is not None else None

    def _queue(self, budget: int, objective: Objective | None, clock: float,
               first_level: Callable[[Pool], tuple[Frontier, Any, list]]) -> tuple[torch.Tensor, Landing]:
        """Grow a draft on the device from ``first_level``'s frontier: what its one read brings back, and how
        the tree is made of that."""
        policy = self._stop_policy(budget, objective, lambda: self.recorder.clock() - clock - self.catch_up_s)
        pool = self._candidates = Pool()
        frontier, state_rows, fed = first_level(pool)
        ancestors = self._ancestors(policy.cap, frontier.cum.device)
        self.levels = 1
        while (frontier := policy.level(self.levels - 1, frontier, pool)) is not None:
            # one batched forward for the whole frontier, each node seeing its parent's rows and itself
            start, end = self.tree_rows, self.tree_rows + len(frontier)
            mask = ancestors[start:end, :end]
            mask |= ancestors[frontier.parent_rows, :end]
            logp, state_rows = self._grow(frontier.tokens, _gather(state_rows, frontier.state), frontier.depth, mask)
            self.forward_rows.append(len(frontier))
            self.tree_rows, self.levels = end, self.levels + 1
            fed.append(frontier.nodes)
            frontier = self._children(pool, frontier, logp, start)
        self.stopped_at = policy.stopped_at
        read, parse = self._finish(pool, fed, policy.keep, policy.final_reads(pool))

        def land(values: Sequence[float]) -> Tree:
            columns, more = parse(values)
            count = policy.count(len(columns[0]), more, self.forward_rows)
            return Tree.from_arrays(*best_nodes(*columns, count), SOURCE)
        return read, land

    def _stop_policy(self, budget: int, objective: Objective | None, elapsed: Callable[[], float]) -> StopPolicy:
        """The rule of this draft: the objective's, planned before the draft where reads are dear (a chain is
        judged level by level), else the fixed depth with its checkpoints, or a chain's threshold."""
        if objective is None:
            rule = ChainThreshold if self.chain else Checkpoints
            return rule(self.depth, budget, self.prune)
        if objective.planned and not self.chain:
            return Planned(objective, budget)
        return PerLevel(objective, budget, self.prune, self.chain, elapsed, self.forward_rows)

    def _ancestors(self, cap: int, device: torch.device) -> torch.Tensor:
        """Row r: the tree rows that the node fed at row r sees (itself from the start, its ancestors once fed);
        the extra last row, index -1, stays empty: the root's, so the root's children look it up like every other."""
        rows = self.tree_rows + (cap - 1) * self.top_k
        ancestors = torch.eye(rows + 1, rows, dtype=torch.bool, device=device)
        if self.tree_rows:  # a checked chain: each row sees those before
            ancestors[: self.tree_rows, : self.tree_rows].fill_(True).tril_()
        return ancestors

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
                more: Sequence[torch.Tensor] = ()) -> tuple[torch.Tensor, Callable[[Sequence[float]], Parsed]]:
        """The draft's last read, unread: the selected nodes (tokens, parents among them, scores), the fed nodes'
        (pool index, parent, token), then ``more``; and how to take it apart once read."""
        tokens, parents, cum = pool.arrays()
        chosen = pool.select(cum, keep)
        up = parents[chosen]
        inside = torch.searchsorted(chosen, up.clamp(min=0))  # a parent's place among the chosen (it always is)
        fed_nodes = torch.cat(fed) if fed else chosen[:0]
        ids = torch.cat([tokens[chosen], torch.where(up < 0, up, inside),
                         fed_nodes, parents[fed_nodes], tokens[fed_nodes]])
        read = torch.cat([ids.double(), cum[chosen].double(), *(column.double() for column in more)])
        return read, partial(self._parse, chosen.shape[0], fed_nodes.shape[0])

    def _parse(self, n: int, m: int, read: Sequence[float]) -> Parsed:
        """:meth:`_finish`'s read of ``n`` selected and ``m`` fed nodes: the selected nodes' columns (the fed
        ones are remembered: which cache row holds which node), and the rest of the read."""
        columns = ([int(t) for t in read[:n]], [int(p) for p in read[n : 2 * n]],
                   [_prob(c) for c in read[2 * n + 3 * m : 3 * n + 3 * m]])
        nodes, ups, fed_tokens = (read[2 * n + i * m : 2 * n + (i + 1) * m] for i in range(3))
        self.fed = {int(node): row for row, node in enumerate(nodes)}
        self._fed_children = {(int(up), int(token)): int(node) for node, up, token in zip(nodes, ups, fed_tokens)}
        return columns, list(read[3 * n + 3 * m :])

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

