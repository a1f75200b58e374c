"""What the decoding loop asks of a request's constraint (a grammar): declared here so that the runtime, which
applies it, never imports the engine that implements it (graft_cli/grammar/)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Protocol, Sequence

from graft_cli.core.tree import Tree

if TYPE_CHECKING:
    import numpy as np
    import torch


class Constraint(Protocol):
    """The tokens a request may produce: a state after the accepted text, rolled forward along tree paths."""

    def shape(self, tree: Tree, price: Callable[[Sequence[float]], int]) -> Tree:
        """The tree to verify: without the nodes the constraint rejects (nor their subtrees), and with paths
        extended by the tokens it forces (for a method that drafts), then cut to the nodes that pay for their
        rows as ``price`` (the proposer's cost model: ``Proposer.price``) counts them."""

    def masked(self, tree: Tree, logits: "torch.Tensor") -> "torch.Tensor":
        """``logits [1 + len(tree), V]`` with every token the constraint forbids at each row -- the root's, node
        i's after its own path -- set to minus infinity, so that acceptance chooses among allowed tokens only."""

    def bitmask(self, tree: Tree) -> "np.ndarray":
        """The same rows' allowed tokens packed ``[1 + len(tree), words]`` int32, token t at bit ``t % 32`` of
        word ``t // 32``: what the fixed-shape path uploads with a step's inputs and applies on the device."""

    def advance(self, tokens: Sequence[int]) -> None:
        """The accepted tokens of a step (a stop token ends the text: it is not fed)."""

    def ending(self) -> list[int]:
        """``[stop]`` when the text so far allows nothing but its end (the one stop token the masks then allow),
        else ``[]``: the loop emits it without a forward, as plain decoding under the same mask would pick it."""
