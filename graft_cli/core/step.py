"""What one target forward showed: the record every proposer, drafter and retriever learns from, and the same
result while it is still on the device (what a draft queued before the step's read starts from)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Sequence

from graft_cli.core.tree import Tree

if TYPE_CHECKING:  # torch stays out of the core so that retriever plugins without torch import it cheaply
    import numpy as np
    import torch


@dataclass
class Step:
    """The prefill, then each verification: the context, what it appended, and the target's outputs. The target
    makes it (``Target.start``, ``Target.step``); the loop hands it to the proposer as it is."""

    context: list[int]  # every token so far (prompt + generated); the last one is the next root
    accepted: list[int]  # tokens this step appended (the accepted path and the bonus token)
    tree: Tree  # the verified tree (empty for the prefill)
    kept: list[int]  # rows of the fed block that joined the context (prefill: every prompt position)
    logits: "torch.Tensor | None" = None  # target logits of the fed rows [T, V] (prefill: the last row only)
    hidden: "Sequence[torch.Tensor] | None" = None  # per-layer hidden states [T, H], when a proposer needs them
    # the target's top-k next tokens at each fed row, on the host: [T, 2k] ids (exact as floats) then their
    # probabilities, when a proposer needs them (``Needs.successors``) and the fixed-shape path read them
    successors: "np.ndarray | None" = None
    # the kept rows' hidden states of the layers a proposer names (``Needs.layers``), side by side
    # ``[len(kept), F]``: gathered on the device by the fixed-shape path, instead of ``hidden``; valid until the
    # next step (a captured graph's output), so a drafter that keeps them copies them
    features: "torch.Tensor | None" = None
    # what the proposer queued on the device before this step's read (``Needs.queue``: the next draft), read with it
    queued: "list[float] | None" = None


@dataclass
class Outcome:
    """A step's result while it is still on the device: what a drafter needs to draft the next step before the
    host reads this one, so that both come back in the step's one read (the fixed-shape path).

    ``count`` ``[1]``: the rows the accepted path keeps, the root's included; ``tokens`` ``[R]``: the token that
    followed each of those rows (the accepted tokens, then the bonus), padded past ``count``; ``features``
    ``[R, F]``: those rows' states of the drafter's layers, in the same order."""

    count: "torch.Tensor"
    tokens: "torch.Tensor"
    features: "torch.Tensor | None"
    start: int = 0  # a request's prefill (every prompt row, unpadded): the capacity the request reserves
