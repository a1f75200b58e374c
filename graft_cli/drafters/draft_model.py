"""A small causal LM that shares the target's tokenizer, drafting EAGLE-2 trees over its own KV cache.

The cache is the target's :class:`~graft_cli.target.Target` machinery (prefill, tree-masked forwards, in-place
compaction to the accepted path) driven one level at a time: it holds the accepted context, then the tree rows of
the current draft. After verification the rows of accepted nodes the drafter fed stay (their keys and values are
exactly what a causal pass would give), the rest are cut, and the next draft feeds only what is still missing
(usually the bonus token): the context is never prefilled twice.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch

from graft_cli.drafters import TreeDrafter
from graft_cli.errors import GraftError
from graft_cli.prune import PruneSchedule
from graft_cli.target import Target
from plugins.base import Step


def check_vocab(target_tokenizer: Any, draft_tokenizer: Any, spec: str) -> None:
    """The draft must spell every token as the target does, or its proposals mean other words."""
    if target_tokenizer is None or draft_tokenizer is None:
        return
    ours, theirs = target_tokenizer.get_vocab(), draft_tokenizer.get_vocab()
    if ours != theirs:
        differ = len(set(ours.items()) ^ set(theirs.items()))
        raise GraftError(
            f"draft '{spec}' does not share the target's tokenizer ({len(theirs)} vs {len(ours)} tokens, "
            f"{differ} entries differ): pick a draft from the target's model family"
        )


class DraftCache(Target):
    """The target's KV-cache mechanics for a draft model, plus forwards of tree levels under a mask."""

    @torch.inference_mode()
    def feed(self, tokens: torch.Tensor, positions: torch.Tensor, tree_mask: torch.Tensor | None,
             tree_rows: int, last_only: bool = False) -> torch.Tensor:
        """Feed ``tokens`` at ``positions``; without ``tree_mask`` they are causal context (no tree rows may be
        cached), with it row i sees the context and the tree rows ``tree_mask[i]`` allows. Returns logits."""
        past = self.length
        mask = None
        if tree_mask is not None:
            allowed = tree_mask.to(self.device)
            block = torch.zeros(allowed.shape, dtype=self.dtype, device=self.device)
            block.masked_fill_(~allowed, torch.finfo(self.dtype).min)
            prefix = torch.zeros((allowed.shape[0], past - tree_rows), dtype=self.dtype, device=self.device)
            mask = torch.cat([prefix, block], dim=1)[None, None]
        out = self.model(
            input_ids=tokens.to(self.device)[None],
            position_ids=positions.to(self.device)[None],
            attention_mask=mask,
            cache=self.cache,
            use_cache=True,
            logits_to_keep=1 if last_only else 0,
        )
        self.length = past + tokens.shape[0]
        return out.logits[0]


class DraftModelDrafter(TreeDrafter):
    def __init__(self, model: torch.nn.Module, vocab_size: int, depth: int = 6, top_k: int = 4,
                 prune: PruneSchedule | None = None, chain: bool = False) -> None:
        super().__init__(depth, top_k, prune, chain)
        self.cache = DraftCache(model)
        self.vocab_size = vocab_size  # the target's: draft logits past it are never proposed
        self.root_position = 0

    def start(self, prompt: Sequence[int], prefill: Step) -> None:
        super().start(prompt, prefill)
        self.cache.prefill(list(prompt))

    def _logp(self, logits: torch.Tensor) -> torch.Tensor:
        return torch.log_softmax(logits[..., : self.vocab_size].float(), dim=-1)

    def _root(self, context: Sequence[int]) -> tuple[torch.Tensor, Any]:
        done = self.cache.length
        pending = torch.tensor(list(context[done:]), dtype=torch.long)
        if not len(pending):  # the root is already cached (cannot happen in the loop: the bonus token is new)
            raise RuntimeError("draft cache is ahead of the context")
        positions = torch.arange(done, done + len(pending))
        logits = self.cache.feed(pending, positions, None, 0, last_only=True)
        self.root_position = len(context) - 1
        return self._logp(logits[-1]), None

    def _grow(self, tokens: torch.Tensor, states: Any, depth: int, mask: torch.Tensor) -> tuple[torch.Tensor, Any]:
        positions = torch.full((tokens.shape[0],), self.root_position + depth, dtype=torch.long)
        logits = self.cache.feed(tokens, positions, mask, self.tree_rows)
        return self._logp(logits), None

    def _drop_tree(self, keep_rows: list[int]) -> None:
        if self.tree_rows:
            self.cache.keep(keep_rows, self.tree_rows)
        self.tree_rows = 0
