"""Model drafters: a tree grown level by level from the drafter's own next-token distributions (EAGLE-2).

At every level the ``top_k`` best frontier nodes (by cumulative log-probability) each propose their ``top_k``
most likely children, all in ONE batched draft forward under a tree mask. Every candidate joins a pool; at the
end the best nodes of the pool by cumulative probability form the draft tree, which is prefix-closed because a
path's probability never rises along it. A node's score is ``exp(cumulative log-prob)``: the drafter's estimate
that the target accepts the whole path, comparable with a retriever's.

The subclasses only say how to run one forward (:meth:`TreeDrafter._root` for the context, :meth:`_grow` for a
level of the tree); the expansion, the pruning checkpoints, the chain mode and the bookkeeping of which tree
rows sit in the drafter's KV cache live here.
"""

from __future__ import annotations

import math
from time import perf_counter
from typing import Any, Sequence

import torch

from graft_cli.prune import Checkpoint, PruneSchedule
from graft_cli.stats import Stats
from graft_cli.tree import ROOT, Tree
from plugins.base import Step

SOURCE = "draft"


class TreeDrafter:
    """EAGLE-2 expansion with optional dynamic-depth pruning; ``chain=True`` drafts one path (top_k = 1)."""

    wants_hidden = False

    def __init__(self, depth: int = 6, top_k: int = 4, prune: PruneSchedule | None = None, chain: bool = False) -> None:
        if depth < 1 or top_k < 1:
            raise ValueError("a drafter needs depth >= 1 and top_k >= 1")
        self.depth, self.top_k, self.prune, self.chain = depth, (1 if chain else top_k), prune, chain
        self.pool = Tree()  # every candidate of the last draft
        self.fed: dict[int, int] = {}  # pool node -> its row in the tree block of the drafter's cache
        self.tree_rows = 0  # rows of the last draft's tree block still in the drafter's cache
        self.stopped_at: Checkpoint | None = None  # the checkpoint that stopped the last draft
        self.levels = 0  # levels the last draft grew

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
        self.pool, self.fed, self.tree_rows = Tree(), {}, 0

    def observe(self, step: Step) -> None:
        self._drop_tree(self._accepted_rows(step.accepted[:-1]))

    def close(self) -> None:
        pass

    @torch.inference_mode()
    def draft(self, context: Sequence[int], budget: int, stats: Stats) -> Tree:
        clock = perf_counter()
        if self.tree_rows:  # observe() was not called after the last draft
            self._drop_tree([])
        pool, fed = Tree(), {}
        self.pool, self.fed, self.stopped_at, self.levels = pool, fed, None, 0
        if budget <= 0:
            return pool
        logp, state = self._root(context)
        stats.draft_forwards += 1
        k = self.top_k
        values, ids = torch.topk(logp.float(), min(k, logp.shape[-1]))
        tokens = self._to_target(ids).tolist()
        cum = values.tolist()
        frontier = [pool.add(ROOT, t, SOURCE, _prob(c)) for t, c in zip(tokens, cum)]
        frontier_cum = cum
        parent_state = [0] * len(frontier)  # the row of state_rows whose output each frontier node is fed with
        state_rows = state
        self.levels = 1
        keep = budget
        while True:
            level = self.levels - 1
            if self.chain:  # keep the confident prefix: the newest node goes when the chain is no longer sure
                threshold = self.prune.chain_threshold(level) if self.prune is not None else 0.0
                if _prob(frontier_cum[0]) < threshold:
                    keep = min(keep, len(pool) - 1)
                    break
            elif self.prune is not None:
                point = self.prune.stops(level, max(frontier_cum))
                if point is not None:
                    self.stopped_at, keep = point, self.prune.keep(point, budget)
                    break
            if self.levels >= self.depth:
                break
            if self.prune is not None and self.prune.floor > 0 and not self.chain:  # not worth a draft row
                floor = math.log(self.prune.floor)
                worth = [i for i, c in enumerate(frontier_cum) if c >= floor]
                frontier = [frontier[i] for i in worth]
                frontier_cum = [frontier_cum[i] for i in worth]
                parent_state = [parent_state[i] for i in worth]
            if not frontier:
                break
            if _settled(pool, keep, max(frontier_cum)):  # no deeper node could make the cut: stop for free
                break
            # one batched forward for the whole frontier, each node seeing only its ancestors in the tree block
            n = len(frontier)
            mask = torch.zeros((n, self.tree_rows + n), dtype=torch.bool)
            for i, node in enumerate(frontier):
                parent = pool.nodes[node].parent
                while parent != ROOT:
                    mask[i, fed[parent]] = True
                    parent = pool.nodes[parent].parent
                mask[i, self.tree_rows + i] = True
            token_ids = torch.tensor([pool.nodes[i].token for i in frontier])
            logp, state_rows = self._grow(token_ids, _gather(state_rows, parent_state), self.levels, mask)
            stats.draft_forwards += 1
            for i, node in enumerate(frontier):
                fed[node] = self.tree_rows + i
            self.tree_rows += n
            self.levels += 1
            values, ids = torch.topk(logp.float(), min(k, logp.shape[-1]), dim=-1)  # [F, k]
            children = self._to_target(ids).tolist()
            total = torch.tensor(frontier_cum)[:, None] + values  # [F, k]
            flat = total.flatten()
            best = torch.topk(flat, min(k, flat.numel())).indices.tolist()
            added = {}
            for i, node in enumerate(frontier):
                for j, token in enumerate(children[i]):
                    added[i * k + j] = pool.add(node, token, SOURCE, _prob(float(total[i, j])))
            totals = flat.tolist()
            frontier = [added[b] for b in best]
            frontier_cum = [totals[b] for b in best]
            parent_state = [b // k for b in best]
        stats.times["draft"] += perf_counter() - clock
        return pool.select(keep)

    def _accepted_rows(self, accepted: Sequence[int]) -> list[int]:
        """Tree-block rows of the accepted path's leading nodes that the drafter fed (their KV is exact)."""
        rows = []
        for node in self.pool.follow(accepted):
            if node not in self.fed:
                break
            rows.append(self.fed[node])
        return rows


def _prob(logp: float) -> float:
    return math.exp(logp)


def _settled(pool: Tree, keep: int, best_frontier: float) -> bool:
    """Whether ``keep`` pool nodes already outscore every node a deeper level could bring."""
    if len(pool) < keep:
        return False
    bound = _prob(best_frontier)
    scores = sorted((n.score for n in pool.nodes), reverse=True)
    return scores[keep - 1] > bound


def _gather(rows: Any, index: list[int]) -> Any:
    if rows is None:
        return None
    return rows[torch.tensor(index, device=rows.device)]


def load_drafter(spec: str, target: Any, depth: int, top_k: int, prune: PruneSchedule | None, chain: bool,
                 rope_theta: float | None = None, vocab: int | None = None) -> TreeDrafter:
    """``--draft`` to a drafter over the loaded target (a graft_cli.loading.Loaded): a model spec, or eagle3:DIR."""
    if spec.startswith("eagle3:"):
        from graft_cli.drafters.eagle3 import Eagle3Drafter, load_head

        head = load_head(spec[len("eagle3:") :], target.model, rope_theta)
        return Eagle3Drafter(head, target.model, depth=depth, top_k=top_k, prune=prune, chain=chain)
    from graft_cli.drafters.draft_model import DraftModelDrafter, check_vocab, draft_vocab
    from graft_cli.loading import load_model

    device = target.device
    dtype = str(next(target.model.parameters()).dtype).replace("torch.", "")
    loaded = load_model(spec, device, dtype)
    check_vocab(target.tokenizer, loaded.tokenizer, spec)
    size = target.model.config.vocab_size
    kept = draft_vocab(target.tokenizer, size, vocab or 0)
    return DraftModelDrafter(loaded.model, size, depth=depth, top_k=top_k, prune=prune, chain=chain, vocab=kept)
