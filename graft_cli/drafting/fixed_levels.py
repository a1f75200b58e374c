"""Draft levels at fixed shapes: a level of the tree drafted by an EAGLE-3 head or a draft model, padded to the
drafter's ``top_k`` rows and attending over the drafter's whole reserved cache, so that one captured graph per
level shape serves every level of every draft (graft_cli/runtime/graphs.py; eager on a CPU).

The expansion loop (tree_drafter.py) still chooses each level's frontier; what changes is how a level's forward
runs. Its inputs are copied into static buffers (device-to-device, no read): the frontier's tokens and positions,
the cache rows they are written at, how many context keys every row sees, and which rows of the tree block each
sees (its ancestors and itself). The mask over the whole cache is made from those on the device, the rows are
written through the cache's device index (graft_cli/runtime/kv_cache.py), and the outputs -- the head's
log-probabilities and states, or the draft model's logits -- are the graph's own tensors, which the loop reads
(``topk``) before the next level replays over them. Padded rows feed token 0 at row ``i``'s slot past the level's
real rows: the next level writes there, and no real row ever sees them.

A drafter on this path runs EVERY tree level through it (captured or, before its warm-up ends, eagerly): its
cache's rows are then written where the index says and never counted by the cache, which the drafter does itself.

A draft queued before a step's read (tree_drafter.py, ``queue``) first feeds the step's accepted tokens the
same way, as one causal block padded to the verification's bucket (:meth:`FixedLevels.catch_up`): their count is
on the device, so the levels after it take their context length from there (``visible`` as a device tensor).
"""

from __future__ import annotations

from contextlib import contextmanager, nullcontext
from typing import Any, Callable, Iterator

import torch

from graft_cli.core import Outcome
from graft_cli.runtime.fixed_shapes import additive, bucket, visible_keys
from graft_cli.runtime.graphs import Capture, Graphs
from graft_cli.runtime.kv_cache import PositionCache

WIDTH = 64  # tree rows a level's static mask holds at first


class LevelInputs:
    """A level's static inputs for ``rows`` rows over a tree block of ``width`` rows."""

    def __init__(self, rows: int, width: int, device: torch.device) -> None:
        self.rows = rows
        self.tokens = torch.zeros(rows, dtype=torch.long, device=device)
        self.positions = torch.zeros(rows, dtype=torch.long, device=device)
        self.write = torch.zeros(rows, dtype=torch.long, device=device)  # the cache rows they are written at
        self.visible = torch.zeros(1, dtype=torch.long, device=device)  # context keys every row sees
        self.tree = torch.zeros((rows, width), dtype=torch.bool, device=device)  # tree rows each sees
        self.order = torch.arange(rows, device=device)

    def fill(self, tokens: torch.Tensor, positions: torch.Tensor, visible: int | torch.Tensor, tree_rows: int,
             mask: torch.Tensor) -> None:
        """This level's ``n`` rows (``mask [n, tree_rows + n]``: the tree rows each sees), the rest padding;
        ``visible``: the context rows, a host int or (a draft queued before the step's read) a device ``[1]``."""
        n = tokens.shape[0]
        if n < self.rows:  # padding: token 0 at position 0 (a full frontier, the usual level, has none)
            self.tokens.zero_()
            self.positions.zero_()
        self.tokens[:n].copy_(tokens)
        self.positions[:n].copy_(positions)
        if isinstance(visible, torch.Tensor):
            self.visible.copy_(visible)
        else:
            self.visible.fill_(visible)
        torch.add(self.order, self.visible, out=self.write).add_(tree_rows)
        self.tree.zero_()
        self.tree[:n, : mask.shape[1]].copy_(mask)
        self.tree[n:, tree_rows + n :].fill_diagonal_(True)  # a padded row sees its own row (and the context)


def reserve_rows(cache: PositionCache, end: int) -> None:
    """Make ``cache``'s blocks hold ``end`` rows (its filled rows kept): a level must never write past them."""
    layer = cache.layers[0]
    if end > layer.keys.shape[2]:
        for layer in cache.layers:
            keys = layer.keys
            layer.make_room(keys.new_empty((keys.shape[0], keys.shape[1], end - layer.filled, keys.shape[3])))


class FixedLevels:
    """A drafter's fixed-shape levels: static inputs per padded row count (``top_k``, or a bucket for a longer
    checked chain), and their graphs."""

    def __init__(self, capture: Capture | None, rows: int, device: torch.device) -> None:
        self.graphs, self.rows, self.device = Graphs(capture), rows, device
        self.inputs: dict[int, LevelInputs] = {}
        self.states: dict[tuple[int, int], torch.Tensor] = {}  # a head's input states [rows, width], by both
        self.count = torch.zeros(1, dtype=torch.long, device=device)  # a catch-up's real rows
        self.base = torch.zeros(1, dtype=torch.long, device=device)  # the context rows after it
        self.most = 0  # ... at most
        self._causal: dict[int, torch.Tensor] = {}  # a catch-up block's mask, by rows
        self.width = WIDTH  # tree rows the static masks hold (they grow with a deeper tree)

    def prepare(self, cache: PositionCache, tokens: torch.Tensor, positions: torch.Tensor,
                visible: int | torch.Tensor, tree_rows: int, mask: torch.Tensor, most: int = 0) -> LevelInputs:
        """The level's inputs filled (a wider tree block than the buffers hold gets new ones, and new graphs);
        ``most``: the most context rows a device ``visible`` may hold."""
        if mask.shape[1] > self.width:
            self.width = 2 * mask.shape[1]
            self.inputs.clear()
            self.graphs.forget()
        rows = self.rows if tokens.shape[0] <= self.rows else bucket(tokens.shape[0])
        inputs = self.inputs.get(rows)
        if inputs is None:
            inputs = self.inputs[rows] = LevelInputs(rows, self.width, self.device)
        reserve_rows(cache, (visible if isinstance(visible, int) else most) + tree_rows + rows)
        inputs.fill(tokens, positions, visible, tree_rows, mask)
        return inputs

    def catch_up(self, cache: PositionCache, outcome: Outcome, past: int) -> LevelInputs:
        """A step's accepted pairs (:class:`Outcome`, padded, their count on the device) as one causal block
        written from row ``past`` on; :attr:`count` holds their count and :attr:`base` the rows after them (at most
        :attr:`most`), where the next draft's levels go."""
        rows, device = outcome.tokens.shape[0], self.device
        causal = self._causal.get(rows)
        if causal is None:
            causal = self._causal[rows] = torch.ones((rows, rows), dtype=torch.bool, device=device).tril()
        at = torch.arange(past, past + rows, device=device)
        inputs = self.prepare(cache, outcome.tokens, at, past, 0, causal)
        self.count.copy_(outcome.count)
        torch.add(self.count, past, out=self.base)
        self.most = past + rows
        return inputs

    def states_for(self, states: torch.Tensor, rows: int) -> torch.Tensor:
        """The static input states of a level of ``rows`` rows, holding ``states`` in its first rows."""
        key = (rows, states.shape[1])
        static = self.states.get(key)
        if static is None:
            static = self.states[key] = states.new_zeros(key)
        static[: states.shape[0]].copy_(states)
        return static

    def run(self, name: str, cache: PositionCache, inputs: LevelInputs, region: Callable[[], Any],
            *more: Any) -> Any:
        """``region`` through the graphs, keyed by what it records: its rows, the cache's block and ``more``."""
        block = cache.layers[0].keys
        key = (name, inputs.rows, block.data_ptr(), block.shape[2], inputs.tree.data_ptr(), *more)
        return self.graphs.run(key, region)


@contextmanager
def kernels_outside(head: Any) -> Iterator[None]:
    """The head's attention kernels entered around a level's run, and its forward's own entry of them a no-op
    meanwhile: a graph records the kernels they select, and a context manager is no part of a graph."""
    kernels = head.kernels
    with kernels:
        head.kernels = nullcontext()
        try:
            yield
        finally:
            head.kernels = kernels


def head_rows(head: Any, inputs: LevelInputs, states: torch.Tensor) -> torch.Tensor:
    """An EAGLE-3 head's forward of ``inputs``' rows over its whole cache, written where they say: the states
    ``[rows, H]`` (run under :func:`kernels_outside`, in inference mode)."""
    cache = head.cache
    allowed = visible_keys(inputs.visible, inputs.tree, cache.layers[0].keys.shape[2])
    cache.write_index = inputs.write
    try:
        return head.rows(inputs.tokens, states, inputs.positions, allowed)
    finally:
        cache.write_index = None


def head_level(head: Any, inputs: LevelInputs, states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A level of the tree: log-probabilities ``[rows, V']`` and states ``[rows, H]``."""
    out = head_rows(head, inputs, states)
    return head.logp(out), out


def head_catch_up(head: Any, inputs: LevelInputs, features: torch.Tensor,
                  count: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A step's accepted pairs fed at a fixed shape (``features``: their target features, padded past
    ``count``): the log-probabilities ``[V']`` and state ``[1, H]`` of the last real row, the next root's."""
    last = head_rows(head, inputs, head.fuse(features)).index_select(0, count - 1)
    return head.logp(last)[0], last


def model_catch_up(draft: Any, inputs: LevelInputs, logits: Callable[[dict], torch.Tensor],
                   count: torch.Tensor) -> torch.Tensor:
    """A step's accepted tokens fed to a draft model at a fixed shape (padded past ``count``): the logits
    ``[1, V']`` of the last real row, the next root's."""
    return model_level(draft, inputs, logits).index_select(0, count - 1)


def model_level(draft: Any, inputs: LevelInputs, logits: Callable[[dict], torch.Tensor]) -> torch.Tensor:
    """A draft model's level over its whole cache (``draft``: its cache, a Target); ``logits`` runs the model on
    the forward's keyword arguments."""
    cache = draft.cache
    mask = additive(visible_keys(inputs.visible, inputs.tree, cache.layers[0].keys.shape[2]), draft.dtype)
    cache.write_index = inputs.write
    try:
        return logits(dict(input_ids=inputs.tokens[None], position_ids=inputs.positions[None], attention_mask=mask,
                           **draft.cached, use_cache=True))
    finally:
        cache.write_index = None
