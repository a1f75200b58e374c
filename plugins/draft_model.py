"""A small causal LM that shares the target's tokenizer, drafting EAGLE-2 trees over its own KV cache.

The cache is the target's :class:`~graft_cli.runtime.target.Target` machinery (prefill, tree-masked forwards, in-place
compaction to the accepted path) driven one level at a time: it holds the accepted context, then the tree rows of
the current draft. After verification the rows of accepted nodes the drafter fed stay (their keys and values are
exactly what a causal pass would give), the rest are cut, and the next draft feeds only what is still missing
(usually the bonus token): the context is never prefilled twice.

With a reduced vocabulary the drafter scores only part of the target's (the LM head is a quarter of a 0.5B
Qwen's weights, and a CPU streams all of it every draft forward): the N most frequent tokens of a corpus counted
by ``graft models vocab`` (graft_cli/runtime/token_ranking.py), else the N lowest ids, which byte-level BPE tokenizers
give their earliest merges; the special tokens always. A token outside it is never drafted; the target still
verifies everything, so output is unchanged. On a CPU with a ranking counted, the default keeps the tokens that
cover 99.99% of the corpus: on the Qwen pair's coding and math prompts, two side-by-side probes ran 5.5% and 7.0%
faster than the whole vocabulary (in the issue's 20-question run the gain did not stand out of run-to-run noise).
The lowest ids were the first try and lost: 32,768 of them cut τ from 6.18 to 5.07 on a coding prompt, since
they miss common code tokens that a frequency ranking keeps (98.1% of the coding answers' tokens against 95.7%).

The draft model reads a request's prompt lazily, at its first draft: graft's cost-aware builder may find that
retrieval alone is faster for this request (a summary copies its article) and never draft, and then the draft
model's prefill (a third of the target's, for Qwen 0.5B beside 1.5B) is never paid. :meth:`unread` tells the
proposer what joining would cost; the seconds it took are ``catch_up_s``, kept apart from the draft's own.

What the cache holds of the last request it read stays for the next: a conversation's next turn begins with the
last turn's prompt and answer, so the draft reads only what is new (``kept`` rows; the target reads its whole
prompt as always, so every method's prefill stays the same).

With ``--draft-window N`` a prompt longer than N tokens is read by the draft as its first ``SINK`` tokens (which
attention leans on, wherever the text goes) and its last ``N - SINK``, at positions counted from 0: at 8K tokens on a
CPU the draft model's own prefill of the whole prompt delays the first token by a third of the target's prefill
(docs/benchmarks.md, "Long context"). The retrievers still read all of the prompt, and the target verifies.
"""

from __future__ import annotations

import sys
from functools import partial
from typing import Any, Sequence

import numpy as np
import torch

from graft_cli.plugin import (
    RANKING_COVERAGE, Capture, CpuLinear, DrafterEnv, FixedLevels, GraftError, HalfLinear, Outcome, PruneSchedule,
    Ranking, Step, Target, TreeDrafter, defaults_for, half_available, half_copy, load_model, load_ranking,
    model_catch_up, model_level, on, positions, to_half, use_cpu_linears,
)


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


def draft_vocab(tokenizer: Any, vocab_size: int, size: int,
                ranking: Ranking | None = None) -> torch.Tensor | None:
    """The target ids a draft model scores: the ``size`` most frequent by ``ranking`` (else the ``size`` lowest,
    which byte-level BPE tokenizers give their earliest merges), and every special or added token (stop tokens
    among them). None (the whole vocabulary) when that is not smaller, or ``size`` is 0."""
    if size <= 0 or size >= vocab_size:
        return None
    special = set(getattr(tokenizer, "all_special_ids", []) or []) | set(getattr(tokenizer, "added_tokens_decoder", {}) or {})
    kept = ranking.top(size).tolist() if ranking is not None else range(size)
    ids = sorted(set(kept) | {i for i in special if 0 <= i < vocab_size})
    return torch.tensor(ids, dtype=torch.long)  # host: built once at load; DraftCache moves it to the model


def _sliced(lm_head: torch.nn.Module, rows: torch.Tensor) -> torch.nn.Linear:
    """The LM head's ``rows`` as a head of its own, run by the same kernels as the model's linears: on a CPU a
    plain ``F.linear`` over 2-4 rows repacks the weight every call, and then costs more than the full packed head
    (a 0.5B Qwen, 300 tokens cached: 65,536 sliced columns 90 ms a 2-row forward, the whole head 78 ms)."""
    bias = getattr(lm_head, "bias", None)
    head = torch.nn.Linear(lm_head.weight.shape[1], len(rows), bias=bias is not None,
                           device=rows.device, dtype=lm_head.weight.dtype)
    with torch.no_grad():
        head.weight.copy_(lm_head.weight[rows])
        if bias is not None:
            head.bias.copy_(bias[rows])
    if isinstance(lm_head, HalfLinear):
        to_half(head)
    elif isinstance(lm_head, CpuLinear):
        use_cpu_linears(head, pack=lm_head.packed is not None)
    return head.requires_grad_(False)


class DraftCache(Target):
    """The target's KV-cache mechanics for a draft model, plus forwards of tree levels under a mask; logits over
    ``vocab`` only when given (through the decoder and a sliced copy of the LM head), then over what
    :meth:`also_score` adds."""

    def __init__(self, model: torch.nn.Module, vocab: torch.Tensor | None = None) -> None:
        super().__init__(model)
        self.head: torch.nn.Linear | None = None
        self.extra: torch.nn.Linear | None = None  # more columns after the head's
        if vocab is not None:
            self.head = _sliced(model.get_output_embeddings(), vocab.to(self.device))

    def also_score(self, ids: torch.Tensor) -> None:
        """Columns for ``ids`` after the reduced head's (a request's own tokens it lacks)."""
        self.extra = _sliced(self.model.get_output_embeddings(), ids) if len(ids) else None

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
                      attention_mask=mask, **self.cached, use_cache=True, visible=past - tree_rows)
        with self.kernels:
            logits = self.logits(inputs, last)
        self.length = past + tokens.shape[0]
        return logits

    def logits(self, inputs: dict, last: int = 0) -> torch.Tensor:
        """The model run on a forward's keyword arguments: logits of every row, or of the ``last`` rows (through
        the reduced head and the request's own columns when there are)."""
        if self.head is None:
            return self.model(**inputs, logits_to_keep=last).logits[0]
        hidden = self.model.get_decoder()(**inputs).last_hidden_state[0]
        rows = hidden[-last:] if last else hidden
        logits = self.head(rows)
        return logits if self.extra is None else torch.cat([logits, self.extra(rows)], dim=-1)

    @torch.inference_mode()
    def fixed_level(self, levels: FixedLevels, tokens: torch.Tensor, positions: torch.Tensor, tree_rows: int,
                    mask: torch.Tensor, base: torch.Tensor | None = None, most: int = 0) -> torch.Tensor:
        """A tree level at a fixed shape over the whole cache (graft_cli/drafting/fixed_levels.py): the logits of
        its rows; the cache counts them itself, as :meth:`feed` does. ``base``: the context rows on the device
        (a draft queued ahead, ``most`` of them at most), else the cache's count."""
        n = tokens.shape[0]
        visible = self.length - tree_rows if base is None else base
        inputs = levels.prepare(self.cache, tokens, positions, visible, tree_rows, mask, most)
        with self.kernels:
            logits = levels.run("draft level", self.cache, inputs, partial(model_level, self, inputs, self.logits),
                                self._columns())
        self.length += n
        self.cache.settle(self.length)
        return logits[:n]

    @torch.inference_mode()
    def fixed_catch_up(self, levels: FixedLevels, outcome: Outcome) -> torch.Tensor:
        """A step's accepted tokens (:class:`Outcome`'s, padded) fed at a fixed shape after the cached context:
        the next root's logits ``[1, V']``. The cache counts them once the step is read."""
        inputs = levels.catch_up(self.cache, outcome, self.length)
        with self.kernels:
            return levels.run("draft catch-up", self.cache, inputs,
                              partial(model_catch_up, self, inputs, self.logits, levels.count), self._columns())

    def _columns(self) -> int | None:
        """What a level's graph records of the request: its own columns of the LM head."""
        return None if self.extra is None else self.extra.weight.data_ptr()


def default_vocab(asked: int | None, ranking: Ranking | None, device: str) -> int:
    """``--draft-vocab`` as given; unset, the ranked tokens that cover ``RANKING_COVERAGE`` of the counted
    corpus on a CPU, where that was measured faster (a GPU's draft forward is not bound by streaming its head:
    unmeasured there, so it keeps the whole vocabulary), and the whole vocabulary without a ranking."""
    if asked is not None:
        return asked
    if ranking is None or not defaults_for(device).ranked_draft_vocab:
        return 0
    size = ranking.size_for()
    print(f"graft: the draft model scores the {size:,} tokens that cover {RANKING_COVERAGE:.2%} of a counted "
          f"corpus ({ranking.corpus or 'graft models vocab'}), and each prompt's own; --draft-vocab 0 scores all",
          file=sys.stderr)
    return size


SINK = 4  # leading prompt tokens a windowed draft keeps


class DraftModelDrafter(TreeDrafter):
    """``before_read``: on the fixed-shape path, draft before the step's read (one read a step) instead of after it. Off
    by default: after the read the draft model checks the step's retrieved chain exactly, in its first forward,
    and continues past it, which a draft queued ahead cannot (the chain needs the tokens the read brings). On the
    default model drafting for itself (``python -m benchmarks.host_time --drafter model --fixed-shapes``) the
    check kept τ at 4.20 where drafting ahead (``--draft-ahead``) gave 3.08: worth more than the read it costs."""

    def __init__(self, model: torch.nn.Module, vocab_size: int, depth: int = 6, top_k: int = 4,
                 prune: PruneSchedule | None = None, chain: bool = False, vocab: torch.Tensor | None = None,
                 window: int = 0, before_read: bool = False) -> None:
        super().__init__(depth, top_k, prune, chain)
        self.before_read = before_read
        self.window = window  # prompt tokens the draft reads at most (0: all)
        self.skipped = 0  # context tokens after the sink that the draft never read: its row r >= SINK is r + skipped
        self.cache = DraftCache(model, vocab)
        self.reduced = None if vocab is None else vocab.to(self.cache.device)  # the reduced head's target ids
        self.vocab = self.reduced  # target id of each logit column: the reduced head's, then the request's own
        self.vocab_size = vocab_size if vocab is None else len(vocab)  # draft logits past it are never proposed
        self.column = None  # the logit column of each target id (-1: not scored), with a reduced vocabulary
        if self.reduced is not None:
            self.column = torch.full((vocab_size,), -1, dtype=torch.long, device=self.cache.device)
            self.column[self.reduced] = torch.arange(len(self.reduced), device=self.cache.device)
        self.root_position = 0
        self.capacity, self.joined = 0, False  # the request's positions; whether its prompt has been read
        self.read: Sequence[int] = ()  # the last request the draft read, as its context (the engine's list) ...
        self.kept = 0  # ... and how many of its first tokens this request's prompt begins with, still cached
        self.resumed = 0  # rows of the next prompt a prefix cache wrote into the cache (resume)

    def start(self, prompt: Sequence[int], prefill: Step, capacity: int) -> None:
        held = self.cache.length - self.tree_rows  # the cache's rows: the first tokens of the last request read
        super().start(prompt, prefill, capacity)
        self.skipped = len(prompt) - self.window if self.window and len(prompt) > self.window else 0
        self.capacity, self.joined = capacity, False  # the prompt is read at the first draft
        self.kept = 0 if self.skipped else _common(self.read[:held], prompt[:-1])
        if self.resumed and not self.skipped:  # the prefix cache's rows, the same tokens: the cache holds them now
            self.kept, self.read, self.cache.length = self.resumed, prompt, self.resumed
        self.resumed = 0
        if self.reduced is not None:
            self._score_prompt(prompt)

    def _score_prompt(self, prompt: Sequence[int]) -> None:
        """A reduced vocabulary, plus the prompt's tokens it lacks: the draft can still say the names and rare
        words a request's answer copies from it (a summary's, a program's identifiers)."""
        reduced, column, device = self.reduced, self.column, self.cache.device
        column[self.vocab[len(reduced) :]] = -1  # the last request's own columns go
        ids = torch.tensor(list(prompt), dtype=torch.long, device=device).clamp_(0, column.shape[0] - 1)
        own = torch.unique(ids[column[ids] < 0])
        column[own] = torch.arange(len(reduced), len(reduced) + len(own), device=device)
        self.vocab = torch.cat([reduced, own])
        self.vocab_size = len(self.vocab)
        self.cache.also_score(own)

    def state(self, context: Sequence[int]) -> tuple[Any, int]:
        """Its cache and the context's rows in it: all it read, or what it held of the prompt if it never joined
        (none with a window: its rows are not the context's positions)."""
        rows = 0 if self.skipped else self.cache.length - self.tree_rows if self.joined else self.kept
        return self.cache.cache, min(rows, max(len(context) - 1, 0))

    def resume(self, rows: int) -> None:
        self.resumed = rows

    def unread(self, context: Sequence[int]) -> int:
        read = self.cache.length if self.joined else self.kept
        return len(context) - self.skipped - read

    def _join(self, context: Sequence[int]) -> None:
        """Before a request's first draft: prefill what it has of the context but its last token (the root, fed
        with the draft's first forward), the window's middle left out, and what the cache still holds of the
        last request left in (a conversation's next turn repeats the last one); timed as ``catch_up_s``."""
        self.catch_up_s = 0.0
        if self.joined:
            return
        t0 = self.recorder.clock()
        ids = list(context[:-1])
        ids = ids[:SINK] + ids[SINK + self.skipped :] if self.skipped else ids
        self.cache.prefill(ids, capacity=self.capacity - self.skipped, kept=self.kept)
        self.read = () if self.skipped else context  # a window's rows are not its context's positions
        self.joined, self.catch_up_s = True, self.recorder.clock() - t0

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

    def _root_queued(self, outcome: Outcome, context: Sequence[int], budget: int) -> tuple[torch.Tensor, Any] | None:
        """A step's accepted tokens fed before its read, when it drafts: first the request's prompt where the
        draft joins now, and any token of ``context`` it has not read (a step it sat out). Not at the prefill:
        whether to join is decided on a step's retrieval."""
        if outcome.start or budget <= 0 or self.fixed is None:
            return None
        self._join(context)
        if self.cache.length < len(context) - self.skipped:
            self._feed(context, [])
        logits = self.cache.fixed_catch_up(self.fixed, outcome)
        self.base, self.most = self.fixed.base, self.fixed.most
        return self._logp(logits)[0], None

    def _count_fed(self, rows: int) -> None:
        self.cache.length += rows
        self.cache.cache.settle(self.cache.length)
        self.root_position = self.cache.length - 1

    def fix_levels(self, capture: Capture | None) -> bool:
        self.fixed = FixedLevels(capture, self.top_k, self.cache.device)
        self.cache.cache.zeroed = True  # levels read the whole cache, unfilled rows masked
        return True

    def _grow(self, tokens: torch.Tensor, states: Any, depth: int | torch.Tensor,
              mask: torch.Tensor) -> tuple[torch.Tensor, Any]:
        base = self.base  # a draft queued ahead: its context ends on the device
        at = positions(self.root_position if base is None else base - 1, depth, tokens.shape[0], tokens.device)
        if self.fixed is not None:
            logits = self.cache.fixed_level(self.fixed, tokens, at, self.tree_rows, mask, base, self.most)
            return self._logp(logits), None
        logits = self.cache.feed(tokens, at, mask, self.tree_rows)
        return self._logp(logits), None

    def _drop_tree(self, keep_rows: list[int]) -> None:
        if self.tree_rows:
            self.cache.keep(keep_rows, self.tree_rows)
        self.tree_rows = 0


def _common(held: Sequence[int], prompt: Sequence[int]) -> int:
    """How many leading tokens ``held`` and ``prompt`` share."""
    n = min(len(held), len(prompt))
    differ = np.flatnonzero(np.asarray(held[:n]) != np.asarray(prompt[:n])) if n else ()
    return int(differ[0]) if len(differ) else n


def make(env: DrafterEnv) -> DraftModelDrafter:
    """The ``model`` drafter (``--draft NAME``, or ``model:NAME``): a catalog name or path, loaded on the target's
    device in its dtype, refused unless it spells tokens as the target does; with ``--draft-weights fp16`` (a CPU's
    default) its linears run over half-precision weights (graft_cli/runtime/half_linear.py)."""
    target = env.target
    dtype = str(next(target.model.parameters()).dtype).replace("torch.", "")
    loaded = load_model(env.spec, target.device, dtype)
    check_vocab(target.tokenizer, loaded.tokenizer, env.spec)
    model = loaded.model
    settings = env.settings
    if settings.draft_weights == "fp16":
        if not str(target.device).startswith("cpu") or not half_available():
            raise GraftError("--draft-weights fp16 runs a draft model's linears on FBGEMM's fp16 CPU kernel: this run "
                             f"is on {target.device}{'' if half_available() else ', and this torch has no FBGEMM'} "
                             "(use --draft-weights full)")
        model = half_copy(model)  # the loaded draft stays as it is: graft bench's hf-assisted shares it
    size = target.model.config.vocab_size
    ranking = load_ranking(target.tokenizer, size)
    kept = draft_vocab(target.tokenizer, size, default_vocab(settings.draft_vocab, ranking, target.device), ranking)
    return DraftModelDrafter(model, size, depth=settings.depth, top_k=settings.draft_top_k, prune=env.prune,
                             chain=settings.chain, vocab=kept, window=settings.draft_window or 0,
                             before_read=bool(settings.draft_ahead)).following(env)
