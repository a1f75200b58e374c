"""A small causal LM that shares the target's tokenizer, drafting EAGLE-2 trees over its own KV cache.

The cache is the target's :class:`~graft_cli.target.Target` machinery (prefill, tree-masked forwards, in-place
compaction to the accepted path) driven one level at a time: it holds the accepted context, then the tree rows of
the current draft. After verification the rows of accepted nodes the drafter fed stay (their keys and values are
exactly what a causal pass would give), the rest are cut, and the next draft feeds only what is still missing
(usually the bonus token): the context is never prefilled twice.

With ``--draft-vocab N`` the drafter scores only part of the vocabulary (the N lowest ids, which byte-level BPE
tokenizers give their earliest, most frequent merges, plus the special tokens), as EAGLE-3's heads do: the LM head
is a quarter of a 0.5B Qwen's weights. A token outside it is never drafted; the target still verifies everything,
so output is unchanged. It is off by default: on a coding prompt with the Qwen pair (CPU), N = 32768 cut τ from
6.18 to 5.07 and N = 65536 kept τ but saved only 6% of the draft time.

The draft model reads a request's prompt lazily, at its first draft: graft's cost-aware builder may find that
retrieval alone is faster for this request (a summary copies its article) and never draft, and then the draft
model's prefill (a third of the target's, for Qwen 0.5B beside 1.5B) is never paid. :meth:`unread` tells the
proposer what joining would cost; the seconds it took are ``catch_up_s``, kept apart from the draft's own.

With ``--draft-window N`` a prompt longer than N tokens is read by the draft as its first ``SINK`` tokens (which
attention leans on, wherever the text goes) and its last ``N - SINK``, at positions counted from 0: at 8K tokens on a
CPU the draft model's own prefill of the whole prompt delays the first token by a third of the target's prefill
(docs/benchmarks.md, "Long context"). The retrievers still read all of the prompt, and the target verifies.
"""

from __future__ import annotations

from time import perf_counter
from typing import TYPE_CHECKING, Any, Sequence

import torch
from torch.nn import functional as F

from graft_cli.drafters import TreeDrafter, positions
from graft_cli.errors import GraftError
from graft_cli.prune import PruneSchedule
from graft_cli.target import Target, on
from plugins.base import Step

if TYPE_CHECKING:
    from graft_cli.drafters.registry import DrafterEnv


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


def draft_vocab(tokenizer: Any, vocab_size: int, size: int) -> torch.Tensor | None:
    """The target ids a draft model scores: the ``size`` lowest, and every special or added token (stop tokens
    among them). None (the whole vocabulary) when that is not smaller, or ``size`` is 0."""
    if size <= 0 or size >= vocab_size:
        return None
    special = set(getattr(tokenizer, "all_special_ids", []) or []) | set(getattr(tokenizer, "added_tokens_decoder", {}) or {})
    ids = sorted(set(range(size)) | {i for i in special if 0 <= i < vocab_size})
    return torch.tensor(ids, dtype=torch.long)  # host: built once at load; DraftCache moves it to the model


class DraftCache(Target):
    """The target's KV-cache mechanics for a draft model, plus forwards of tree levels under a mask; logits over
    ``vocab`` only when given (through the decoder and a sliced copy of the LM head)."""

    def __init__(self, model: torch.nn.Module, vocab: torch.Tensor | None = None) -> None:
        super().__init__(model)
        self.head = None
        if vocab is not None:
            lm_head = model.get_output_embeddings()
            bias = getattr(lm_head, "bias", None)
            vocab = vocab.to(self.device)
            self.head = (lm_head.weight[vocab].detach().clone(), None if bias is None else bias[vocab].detach().clone())

    @torch.inference_mode()
    def feed(self, tokens: torch.Tensor, positions: torch.Tensor, tree_mask: torch.Tensor | None,
             tree_rows: int, last: int = 0) -> torch.Tensor:
        """Feed ``tokens`` at ``positions``; without ``tree_mask`` they are causal (no tree rows may be cached
        before them), with it row i sees the context and the tree rows ``tree_mask[i]`` allows. Returns the
        logits of every row, or of the ``last`` rows."""
        past, device = self.length, self.device
        mask = None
        if tree_mask is not None:  # the context is visible to every row; the tree rows as tree_mask says
            mask = torch.zeros((1, 1, tree_mask.shape[0], past + tree_mask.shape[1] - tree_rows), dtype=self.dtype,
                               device=device)
            mask[0, 0, :, past - tree_rows :].masked_fill_(~on(tree_mask, device), torch.finfo(self.dtype).min)
        inputs = dict(input_ids=on(tokens, device)[None], position_ids=on(positions, device)[None],
                      attention_mask=mask, cache=self.cache, use_cache=True, visible=past - tree_rows)
        if self.head is None:
            logits = self.model(**inputs, logits_to_keep=last).logits[0]
        else:
            hidden = self.model.get_decoder()(**inputs).last_hidden_state[0]
            logits = F.linear(hidden[-last:] if last else hidden, *self.head)
        self.length = past + tokens.shape[0]
        return logits


SINK = 4  # leading prompt tokens a windowed draft keeps


class DraftModelDrafter(TreeDrafter):
    def __init__(self, model: torch.nn.Module, vocab_size: int, depth: int = 6, top_k: int = 4,
                 prune: PruneSchedule | None = None, chain: bool = False, vocab: torch.Tensor | None = None,
                 window: int = 0) -> None:
        super().__init__(depth, top_k, prune, chain)
        self.window = window  # prompt tokens the draft reads at most (0: all)
        self.skipped = 0  # context tokens after the sink that the draft never read: its row r >= SINK is r + skipped
        self.cache = DraftCache(model, vocab)
        self.vocab = None if vocab is None else vocab.to(self.cache.device)  # target id of each logit column
        self.vocab_size = vocab_size if vocab is None else len(vocab)  # draft logits past it are never proposed
        self.column = None  # the logit column of each target id (-1: not scored), with a reduced vocabulary
        if self.vocab is not None:
            self.column = torch.full((vocab_size,), -1, dtype=torch.long, device=self.cache.device)
            self.column[self.vocab] = torch.arange(len(self.vocab), device=self.cache.device)
        self.root_position = 0
        self.capacity, self.joined = 0, False  # the request's positions; whether its prompt has been read

    def start(self, prompt: Sequence[int], prefill: Step, capacity: int) -> None:
        super().start(prompt, prefill, capacity)
        self.skipped = len(prompt) - self.window if self.window and len(prompt) > self.window else 0
        self.capacity, self.joined = capacity, False  # the prompt is read at the first draft

    def unread(self, context: Sequence[int]) -> int:
        read = self.cache.length if self.joined else 0
        return len(context) - self.skipped - read

    def _join(self, context: Sequence[int]) -> None:
        """Before a request's first draft: prefill what it has of the context but its last token (the root, fed
        with the draft's first forward), the window's middle left out; timed as ``catch_up_s``."""
        self.catch_up_s = 0.0
        if self.joined:
            return
        t0 = perf_counter()
        ids = list(context[:-1])
        ids = ids[:SINK] + ids[SINK + self.skipped :] if self.skipped else ids
        self.cache.prefill(ids, capacity=self.capacity - self.skipped)
        self.joined, self.catch_up_s = True, perf_counter() - t0

    def _logp(self, logits: torch.Tensor) -> torch.Tensor:
        if logits.shape[-1] != self.vocab_size:  # an LM head padded wider than the vocabulary
            logits = logits[..., : self.vocab_size]
        return torch.log_softmax(logits, dim=-1, dtype=torch.float32)

    def _to_target(self, ids: torch.Tensor) -> torch.Tensor:
        return ids if self.vocab is None else self.vocab[ids]

    def _from_target(self, ids: torch.Tensor) -> torch.Tensor:
        return ids if self.column is None else self.column[ids]

    def _root(self, context: Sequence[int]) -> tuple[torch.Tensor, Any]:
        self._join(context)
        return self._feed(context, [])[0], None

    def _root_and_chain(self, context: Sequence[int], chain: list[int]) -> tuple[torch.Tensor, Any]:
        """One causal forward of what the cache has not seen of ``context`` followed by ``chain``: the chain's
        rows are the first tree rows, with exactly the keys and values a causal pass gives them."""
        self._join(context)
        self.forward_rows.append(len(context) - self.skipped - self.cache.length + len(chain))
        return self._feed(context, chain), None

    def _feed(self, context: Sequence[int], chain: list[int]) -> torch.Tensor:
        done, end = self.cache.length, len(context) - self.skipped  # in the draft's own positions
        if done >= end:  # the root is already cached (cannot happen in the loop: the bonus token is new)
            raise RuntimeError("draft cache is ahead of the context")
        device = self.cache.device
        pending = torch.tensor([*context[done + self.skipped :], *chain], dtype=torch.long, device=device)
        at = torch.arange(done, end + len(chain), device=device)
        logits = self.cache.feed(pending, at, None, 0, last=len(chain) + 1)
        self.root_position = end - 1
        return self._logp(logits)

    def _grow(self, tokens: torch.Tensor, states: Any, depth: int | torch.Tensor,
              mask: torch.Tensor) -> tuple[torch.Tensor, Any]:
        at = positions(self.root_position, depth, tokens.shape[0], tokens.device)
        logits = self.cache.feed(tokens, at, mask, self.tree_rows)
        return self._logp(logits), None

    def _drop_tree(self, keep_rows: list[int]) -> None:
        if self.tree_rows:
            self.cache.keep(keep_rows, self.tree_rows)
        self.tree_rows = 0


def make(env: DrafterEnv) -> DraftModelDrafter:
    """The ``model`` drafter (``--draft NAME``, or ``model:NAME``): a catalog name or path, loaded on the target's
    device in its dtype, refused unless it spells tokens as the target does."""
    from graft_cli.loading import load_model  # looked up per call: graft bench shares one copy of each model

    target = env.target
    dtype = str(next(target.model.parameters()).dtype).replace("torch.", "")
    loaded = load_model(env.spec, target.device, dtype)
    check_vocab(target.tokenizer, loaded.tokenizer, env.spec)
    size = target.model.config.vocab_size
    kept = draft_vocab(target.tokenizer, size, env.draft_vocab or 0)
    return DraftModelDrafter(loaded.model, size, depth=env.depth, top_k=env.top_k, prune=env.prune, chain=env.chain,
                             vocab=kept, window=env.draft_window or 0)
