"""Acceptance on the device, at fixed shapes: the target's own token at every verified row, the accepted path and
the KV rows it keeps, as tensor operations a graph can capture, and one result the host reads once.

It is the rule of graft_cli/runtime/verify.py without the walk. Row r's choice is the argmax of its logits, or
``argmax(log p + G)`` with the Gumbel row of its position when sampling. A node is accepted when its token equals
the choice at its parent row and every ancestor of it is accepted: with the ancestor rows ``A`` (row i: i and its
ancestors), when no row j with ``A[i, j]`` mismatches -- one masked reduction, no walk, no ``nonzero``. Siblings
never share a token (a Tree merges them), so the accepted rows are one path from the root: the ancestors of the
deepest accepted row, whose choice is the bonus token.

The path's rows, in order and padded to the bucket with each padded index pointing at its own row, are also the
compaction: ``index_copy`` of those rows down to ``past + i`` moves the accepted keys and values into place and
leaves every other row as it was (later forwards overwrite them). So the host learns the step's outcome in ONE
read -- ``[count, bonus, rows...]`` -- after the device has already compacted its cache.

:class:`NoiseRing` keeps the sampling noise where a graph can find it: row ``t`` of
:class:`~graft_cli.runtime.sampling.Noise` (drawn there, by the same generator, in the same order: the same
values) in slot ``t % size`` of one device buffer; a step's rows are gathered by slot inside the graph.
"""

from __future__ import annotations

import torch

from graft_cli.runtime.fixed_shapes import StaticInputs
from graft_cli.runtime.sampling import Noise, Sampling, probabilities


def choose(logits: torch.Tensor, sampling: Sampling, noise: torch.Tensor | None) -> torch.Tensor:
    """The target's token at every row of ``logits [B, V]``: the argmax, or ``argmax(log p + G)`` with ``noise``
    ``[B, V]`` (each row's Gumbel row) -- the very operations of ``verify.accept``, so the same tokens."""
    if sampling.greedy:
        return logits.argmax(dim=-1)
    return (torch.log(probabilities(logits, sampling)) + noise).argmax(dim=-1)


def accepted_rows(choice: torch.Tensor, inputs: StaticInputs) -> torch.Tensor:
    """``[2 + B]`` int64: how many rows the accepted path keeps (the root included), the bonus token, then the
    path's rows in order, padded with each index's own row (the compaction's source rows)."""
    size, device = inputs.size, choice.device
    order = torch.arange(size, device=device)
    sees = inputs.ancestors != 0
    real = sees[:, 0]  # a real row sees the root; a padded one only itself
    match = ((inputs.tokens[0] == choice.index_select(0, inputs.parents)) & real) | (order == 0)
    accepted = ~(sees & ~match[None, :]).any(dim=1)
    depth = sees.sum(dim=1)  # 1 + depth for a real row
    last = torch.where(accepted, depth, 0).argmax()[None]  # the deepest accepted row (unique: one path)
    path = sees.index_select(0, last)[0]
    count = path.sum()[None]
    rows = torch.where(path, order, order + size).sort().values  # the path's rows first, ascending
    source = torch.where(order < count, rows, order)
    return torch.cat([count, choice.index_select(0, last), source])


def following(packed: torch.Tensor, inputs: StaticInputs) -> torch.Tensor:
    """``[B]``: the token after each of the path's rows (:func:`accepted_rows`' ``packed``): the next path row's
    token, the bonus after the last and past it -- what a drafter pairs with each accepted row's states."""
    count, bonus, rows = packed[:1], packed[1:2], packed[2:]
    order = torch.arange(inputs.size, device=rows.device)
    after = inputs.tokens[0].index_select(0, rows.roll(-1))
    return torch.where(order + 1 < count, after, bonus)


def top_k_rows(logits: torch.Tensor, k: int) -> torch.Tensor:
    """Every row's top-k next tokens ``[B, 2k]``: ids (exact as floats below 2^24), then probabilities -- what
    Token Recycling learns from every verified row (plugins/adjacency.py), read with the step's result."""
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    values, ids = torch.topk(probs, min(k, probs.shape[-1]), dim=-1)
    return torch.cat([ids.to(torch.float32), values], dim=1)


def compact(blocks: list[torch.Tensor], inputs: StaticInputs, source: torch.Tensor) -> None:
    """Move the accepted rows (``source``, from :func:`accepted_rows`) of every KV block down to ``past + i``;
    a padded index copies its row onto itself."""
    past = inputs.positions[0, :1]
    to = past + torch.arange(inputs.size, device=past.device)
    start = past + source
    for block in blocks:
        block.index_copy_(4, to, block.index_select(4, start))


class NoiseRing:
    """The Gumbel rows of one generation in a fixed device buffer: row ``t`` in slot ``t % size``.

    Rows come from ``noise`` (:meth:`Noise.draw`, in position order, each once), which hands them over and forgets
    them. A row is needed from the step that first verifies its position until the context passes it, and a
    step's rows span its tree's depth, so ``size`` above the deepest tree (the ring grows if one is deeper) keeps
    every row that can still be asked for. ``at`` serves the host-side rule (an eager step) from the same rows."""

    def __init__(self, noise: Noise, vocab: int, size: int) -> None:
        self.noise, self.vocab = noise, vocab
        self.rows = torch.zeros((size, vocab), dtype=torch.float32, device=noise.device)
        self.end = noise.first  # positions before it are in the ring

    @property
    def size(self) -> int:
        return self.rows.shape[0]

    def fill(self, start: int, end: int) -> None:
        """Bring every row before position ``end`` into the ring, keeping those from ``start`` on."""
        if max(self.end, end) - start > self.size:  # one step spans more than the ring: a bigger one, rows kept
            self._grow(2 * (max(self.end, end) - start))
        noise = self.noise
        noise.draw(end, self.vocab)
        for t in range(max(self.end, noise.first), noise.first + len(noise.rows)):
            self.rows[t % self.size].copy_(noise.rows[t - noise.first])
        self.end = max(self.end, noise.first + len(noise.rows))
        noise.first, noise.rows = self.end, []

    def at(self, offsets: torch.Tensor, start: int, span: int, vocab: int) -> torch.Tensor:
        """:meth:`Noise.at` from the ring: rows for positions ``start + offsets``."""
        self.fill(start, start + span)
        return self.rows.index_select(0, (offsets + start) % self.size)

    def _grow(self, size: int) -> None:
        rows = torch.zeros((size, self.vocab), dtype=torch.float32, device=self.rows.device)
        for t in range(max(0, self.end - self.size), self.end):
            rows[t % size].copy_(self.rows[t % self.size])
        self.rows = rows
