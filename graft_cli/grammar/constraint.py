"""A grammar applied to a speculative step: every node's token checked from its parent's state, every verified
row masked by the state after its own path, and the tokens the grammar forces added to the tree as drafts.

One llguidance matcher holds the state after the accepted text; a step walks the tree depth first, feeding each
node's token and rolling it back on the way up, so a node's state is exactly the state plain decoding would be
in after the same tokens. Acceptance then chooses among allowed tokens only at every row, which is what plain
decoding with the same mask does at every position: the accepted text is the same, greedy or seeded."""

from __future__ import annotations

from typing import Callable, Sequence

import numpy as np
import torch

from graft_cli.core import ROOT, Clock, GraftError, Tree
from graft_cli.grammar.copied import COPIED, CopiedValues
from graft_cli.grammar.spec import Grammar, GrammarTokenizer

FORCED = "forced"  # the source name of nodes the grammar forced (Stats.accepted counts them under it)
FORCED_NODES = 48  # forced nodes a step may add past the proposer's tree (each costs a verified row)
COPIED_NODES = 8  # copied nodes likewise (a guess, unlike a forced chain: fewer)
COPIED_SCORE = 0.5  # a copied node's acceptance estimate: where the value ends in the prompt is a guess


class GrammarConstraint:
    """One request's grammar state (graft_cli.core.constraint.Constraint). ``drafts``: whether forced tokens are
    added to the tree (not for plain decoding, the reference). ``seconds`` adds up the host time spent on the
    grammar (masks, checks, forced tokens), read on ``clock`` (the generation's recorder's): what the constraint
    costs each step, reported beside the phases. ``prompt``: the request's tokens, whose text a value the answer
    copies from it is drafted from (copied.py)."""

    def __init__(self, grammar: Grammar, tokenizer: GrammarTokenizer, clock: Clock, drafts: bool = True,
                 prompt: Sequence[int] = ()) -> None:
        self.matcher, self.clock = tokenizer.matcher(grammar), clock
        self.copied = CopiedValues(tokenizer.text, prompt) if drafts and prompt else None
        self.output: list[int] = []  # the text so far, as tokens (the copied values' context)
        self.tokenizer, self.vocab, self.stops, self.drafts = tokenizer, tokenizer.vocab, tokenizer.stops, drafts
        self.words = len(self.matcher.compute_bitmask()) // 4  # a row's 32-bit words (the engine's own count)
        self.seconds = 0.0
        self.fed = 0  # tokens fed to the matcher: the text so far, stop tokens excepted

    @property
    def complete(self) -> bool:
        """Whether the text so far is a whole match (a cut answer is not)."""
        return self.matcher.is_accepting()

    def advance(self, tokens: Sequence[int]) -> None:
        began = self.clock()
        for token in tokens:
            if token in self.stops:
                break
            if not self.matcher.consume_token(int(token)):  # the mask allowed it: only an engine fault gets here
                raise GraftError(f"the grammar rejected token {token} it allowed: {self.matcher.get_error()}")
            self.fed += 1
            self.output.append(int(token))
        self.seconds += self.clock() - began

    def ending(self) -> list[int]:
        return [self.tokenizer.end] if self.matcher.is_stopped() and self.tokenizer.end is not None else []

    def shape(self, tree: Tree, price: Callable[[Sequence[float]], int] | None = None) -> Tree:
        """Also: a forced node is as likely as the node it follows (the grammar allows nothing else after it), a
        copied one is a guess (:data:`COPIED_SCORE`); ``price`` None keeps every node."""
        began = self.clock()
        valid, forced = self._walk(tree, lambda: self.tokenizer.forced(self.matcher) if self.drafts else [])
        shaped = tree if len(valid) == len(tree) else tree.subtree(valid)
        room = FORCED_NODES
        for node in [ROOT, *shaped.ranked()]:  # the root, then the best nodes first
            old = ROOT if node == ROOT else valid[node]
            tokens = forced.get(old, [])[:room]
            if not tokens:
                continue
            score = 1.0 if node == ROOT else shaped.nodes[node].score
            before = len(shaped)
            shaped.add_path(tokens, [score] * len(tokens), FORCED, node)
            room -= len(shaped) - before
            if room <= 0:
                break
        room = COPIED_NODES if self.copied is not None and not forced.get(ROOT) else 0
        for text in self.copied.propose(self.output) if room > 0 else []:
            before = len(shaped)
            tokens = self._copy(text)[:room]
            shaped.add_path(tokens, [COPIED_SCORE] * len(tokens), COPIED)
            room -= len(shaped) - before
        if price is not None:  # forced and copied nodes compete with the proposer's for the rows a step pays
            shaped = shaped.select(price([shaped.nodes[i].score for i in shaped.ranked()]))
        self.seconds += self.clock() - began
        return shaped

    def _copy(self, text: str) -> list[int]:
        """``text`` from the prompt after the text so far, then what the grammar forces after it (``", "age": ``
        after a value's closing quote), tokenized whole as the model would write them (``'",'`` one token), cut
        where the grammar rejects them, with the stop token where the grammar is done after them."""
        tokens = self.copied.tokens(self.output, text)
        fed = self.matcher.try_consume_tokens(tokens)
        after = self.matcher.compute_ff_bytes().decode("utf-8", errors="ignore") if fed == len(tokens) else ""
        self.matcher.rollback(fed)
        if not after:
            return tokens[:fed]
        tokens = self.copied.tokens(self.output, text + after)
        fed = self.matcher.try_consume_tokens(tokens)
        done = fed == len(tokens) and self.matcher.is_stopped() and self.tokenizer.end is not None
        self.matcher.rollback(fed)
        return tokens[:fed] + ([self.tokenizer.end] if done else [])

    def bitmask(self, tree: Tree) -> np.ndarray:
        """Every row's allowed tokens packed as the engine packs them, ``[1 + len(tree), words]`` int32 (token t:
        bit ``t % 32`` of word ``t // 32``): the root's row, then node i's after its own path. What the
        fixed-shape path uploads with a step's inputs."""
        began = self.clock()
        packed = self._packed(tree)
        self.seconds += self.clock() - began
        return packed

    def masked(self, tree: Tree, logits: torch.Tensor) -> torch.Tensor:
        began = self.clock()
        allowed = np.unpackbits(self._packed(tree).view(np.uint8), axis=1, bitorder="little")[:, : logits.shape[-1]]
        if allowed.shape[1] < logits.shape[-1]:  # ids past the tokenizer's (padding rows of an embedding): never
            allowed = np.pad(allowed, ((0, 0), (0, logits.shape[-1] - allowed.shape[1])))
        forbidden = torch.from_numpy(allowed == 0).to(logits.device)
        self.seconds += self.clock() - began
        return logits.masked_fill(forbidden, float("-inf"))

    def _packed(self, tree: Tree) -> np.ndarray:
        packed = np.full((len(tree) + 1, self.words), -1, dtype=np.int32)  # an invalid node's row: anything

        def mask(row: int) -> None:
            if self.ending():  # the text's end: only the stop token the loop emits for free there (ending)
                packed[row] = 0
                packed.view(np.uint32)[row, self.tokenizer.end // 32] = 1 << self.tokenizer.end % 32
            else:
                packed[row] = np.frombuffer(self.matcher.compute_bitmask(), dtype=np.int32)

        mask(0)
        self._walk(tree, None, mask)
        if not packed.any(axis=1).all():
            raise GraftError(f"the grammar allows no token here: {self.matcher.get_error() or 'no continuation'}")
        return packed

    def _walk(self, tree: Tree, forced: Callable[[], list[int]] | None,
              visit: Callable[[int], None] | None = None) -> tuple[list[int], dict[int, list[int]]]:
        """Depth first from the root: each node's token fed from its parent's state (a rejected one ends its
        subtree), ``visit(row)`` called in its state, then rolled back. The valid nodes in index order, and with
        ``forced``, the tokens it returns in each state (the root's under ROOT)."""
        children: dict[int, list[int]] = {}
        for i, node in enumerate(tree.nodes):
            children.setdefault(node.parent, []).append(i)
        valid: list[int] = []
        found: dict[int, list[int]] = {}
        if forced is not None:
            found[ROOT] = forced()
        stack: list[tuple[int, bool]] = [(i, True) for i in reversed(children.get(ROOT, []))]
        while stack:
            node, entering = stack.pop()
            if not entering:
                self.matcher.rollback(1)
                continue
            if self.matcher.try_consume_tokens([tree.nodes[node].token]) != 1:
                continue
            valid.append(node)
            if visit is not None:
                visit(node + 1)
            if forced is not None:
                found[node] = forced()
            stack.append((node, False))
            stack.extend((child, True) for child in reversed(children.get(node, [])))
        valid.sort()
        return valid, found
