"""A KV cache preallocated per request and addressed by position, so a step's cache traffic follows the tokens fed.

transformers' ``DynamicCache`` grows by concatenation: every forward copies the whole cache of every layer (at 4K
tokens on SmolLM2-135M about 190 MB a step, however few tokens are verified). Here each layer holds one buffer of
``capacity`` rows, reserved when a request starts (prompt + new tokens + tree room); a forward writes its rows at
the next free positions and attention reads a view of the filled rows, and compaction to the accepted path moves
only the accepted rows inside the buffer.

Why not ``StaticCache``: its layers hand the model the *whole* buffer and size the attention mask to it, so every
step would attend over (masked) unfilled rows, costing attention time in proportion to the capacity rather than
the context; and its length is a device tensor, which a host-side compaction would have to read back. These layers
return only the filled rows (so the model's masks, and graft's tree masks, keep the key length they have today)
and count on the host.

All layers live in ONE block ``[layers, 2 (keys, values), batch, heads, capacity, head_dim]``, so compaction is a
single gather and copy over every layer at once (two device calls a step, not four per layer). A layer whose keys
do not fit that block (another device, dtype or shape), and every layer of a model sharded by ``--device-map``
(``shared=False``), keeps a block of its own on the device its first keys arrive on, next to the layer.

A forward that would pass the capacity (a caller that reserved too little) doubles it once; requests whose caller
reserves (``Target.prefill(ids, capacity=...)``) never reallocate.

The fixed-shape path (graft_cli/runtime/fixed_target.py) uses the same blocks another way: while
``PositionCache.write_index`` holds a device tensor of positions, a forward writes its rows there and attention
reads the block's first ``read_rows`` rows (all of them unless set), its unfilled rows masked, so every forward of a bucket has one shape and touches no
Python-int slice (what a CUDA graph needs). Blocks it reads are made zero-filled (``zeroed``): a masked key still
multiplies its value by a zero weight, and garbage there could be NaN.
"""

from __future__ import annotations

import inspect
from typing import Optional, Sequence

import torch

Rows = list[Optional[torch.Tensor]]  # positions of a cache's blocks: the shared block's, then each layer's own


class PositionLayer:
    """One attention layer's keys and values: ``[batch, heads, capacity, head_dim]`` views of its cache's block (or
    of a block of its own); ``filled`` rows are valid. The blocks survive between requests and grow only. Free of
    transformers (graft's own forward needs none of it); transformers' models get it under their cache's base
    classes (graft_cli/runtime/hf_cache.py)."""

    is_sliding = False
    is_croppable = True

    def __init__(self, cache: PositionCache, number: int) -> None:
        self.keys: torch.Tensor | None = None
        self.values: torch.Tensor | None = None
        self.is_initialized = False
        self.cache, self.number = cache, number
        self.own: torch.Tensor | None = None  # [1, 2, batch, heads, capacity, head_dim] when not in the shared block
        self.filled = 0

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """Views of this layer's rows in its block (sized, or resized, to the cache's capacity)."""
        self.device = key_states.device
        kv = self.cache.storage(self, key_states)
        self.keys, self.values = kv[0], kv[1]
        self.is_initialized = True

    def make_room(self, key_states: torch.Tensor) -> int:
        """A block that holds ``key_states``'s rows after the filled ones (made, or grown, as needed); returns
        where they end."""
        end = self.filled + key_states.shape[2]
        if end > self.cache.capacity:
            self.cache.capacity = max(end, 2 * self.cache.capacity)
        if not self.is_initialized or self.keys.shape[2] != self.cache.capacity:
            self.lazy_initialization(key_states, key_states)
        return end

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
        index = self.cache.write_index
        if index is not None:  # fixed shapes: rows written where the device index says, a fixed span read
            self.keys.index_copy_(2, index, key_states)
            self.values.index_copy_(2, index, value_states)
            rows = self.cache.read_rows
            return (self.keys, self.values) if rows is None else (self.keys[:, :, :rows], self.values[:, :, :rows])
        end = self.make_room(key_states)
        self.keys[:, :, self.filled : end] = key_states
        self.values[:, :, self.filled : end] = value_states
        self.filled = end
        return self.keys[:, :, :end], self.values[:, :, :end]

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.filled + query_length, 0

    def get_seq_length(self) -> int:
        return self.filled

    def get_max_length(self) -> int:
        return -1  # grows when it must

    def reset(self) -> None:
        self.filled = 0  # the buffers stay for the next request

    def crop(self, tokens_to_remove: int) -> None:
        """Drop the last ``-tokens_to_remove`` rows (transformers' convention: a negative count)."""
        self.filled = max(0, self.filled + min(tokens_to_remove, 0))


class PositionCache:
    """A :class:`PositionLayer` per decoder layer over one shared block, reserved per request. ``shared=False``
    (a sharded model): a block per layer, on the layer's device."""

    layer = PositionLayer  # the class of its layers

    def __init__(self, layers: int, shared: bool = True) -> None:
        self.layers = [self.layer(self, i) for i in range(layers)]
        self.shared = shared
        self.capacity = 0
        self.block: torch.Tensor | None = None  # [layers, 2, batch, heads, capacity, head_dim]
        self.write_index: torch.Tensor | None = None  # set: the fixed-shape path's forward (module docstring)
        self.read_rows: int | None = None  # ... and the leading rows its attention reads (None: the whole block)
        self.zeroed = False  # new blocks made zero-filled (the fixed-shape path reads unfilled rows, masked)

    def reserve(self, capacity: int, keep: int = 0) -> None:
        """Start a request of up to ``capacity`` positions: its first ``keep`` rows those held now (a prefix the
        last request shares with it), the rest empty, in blocks of at least that many rows (held ones are reused
        when big enough; bigger ones are made at the first forward, only kept rows copied)."""
        if capacity > self.capacity:
            self.capacity = capacity
            if not keep:
                self.block = None
                for layer in self.layers:
                    layer.own = None
        for layer in self.layers:
            layer.filled = keep

    def storage(self, layer: PositionLayer, like: torch.Tensor) -> torch.Tensor:
        """``layer``'s ``[2, batch, heads, capacity, head_dim]`` rows: in the shared block when ``like`` (its
        keys) fits it, else in a block of its own; a block smaller than the capacity grows, its rows copied."""
        block = self.block
        if self.shared and (block is None or (block.device, block.dtype, block.shape[2:4], block.shape[5])
                            == (like.device, like.dtype, like.shape[:2], like.shape[3])):
            self.block = self._sized(block, len(self.layers), like)
            return self.block[layer.number]
        layer.own = self._sized(layer.own, 1, like)
        return layer.own[0]

    def _sized(self, block: torch.Tensor | None, layers: int, like: torch.Tensor) -> torch.Tensor:
        if block is not None and block.shape[4] == self.capacity:
            return block
        shape = (layers, 2, like.shape[0], like.shape[1], self.capacity, like.shape[3])
        grown = like.new_zeros(shape) if self.zeroed else like.new_empty(shape)
        if block is not None:  # a forward passed the reserved capacity: the rows held so far come along
            grown[:, :, :, :, : block.shape[4]] = block
        return grown

    def keep(self, start: int, rows: list[int]) -> None:
        """Of the rows past ``start`` keep only ``start + r`` for ``r`` in ``rows`` (ascending), moved down to
        ``start``; the cache then holds ``start + len(rows)`` rows. Only kept rows not yet in place move (a leading
        run 0, 1, 2, ... is: the root's row always, a whole chain accepted from its first node), in one gather and
        one copy per block; the rest are simply overwritten by the next forward."""
        placed = 0
        while placed < len(rows) and rows[placed] == placed:
            placed += 1
        if placed < len(rows):
            moved = len(rows) - placed
            blocks = [b for b in (self.block, *(layer.own for layer in self.layers)) if b is not None]
            index: dict[torch.device, torch.Tensor] = {}
            for block in blocks:  # a sharded model's layers keep their caches on their own devices
                if block.device not in index:
                    index[block.device] = torch.tensor([start + r for r in rows[placed:]], device=block.device)
                block.narrow(4, start + placed, moved).copy_(block.index_select(4, index[block.device]))
        self.settle(start + len(rows))

    def take(self, start: int, end: int) -> Rows:
        """A copy of positions ``[start, end)`` of every block (what the prefix cache keeps of a request): the shared
        block's rows first, then each layer's own block's (None where a layer has none)."""
        blocks = (self.block, *(layer.own for layer in self.layers))
        return [None if b is None else b[..., start:end, :].clone() for b in blocks]

    def load(self, pieces: Sequence[Rows], capacity: int) -> int:
        """Start a request of up to ``capacity`` positions whose first rows are ``pieces`` (consecutive runs of
        :meth:`take`, in position order), written into blocks of that capacity; returns how many rows that is.
        Blocks too small for the capacity are made anew (zero-filled where the cache reads unfilled rows)."""
        self.capacity = max(self.capacity, capacity)
        length = 0
        for slot, layer in enumerate((None, *self.layers)):
            runs = [piece[slot] for piece in pieces if piece[slot] is not None]
            if not runs:
                continue
            rows = torch.cat(runs, dim=-2) if len(runs) > 1 else runs[0]
            held = self.block if layer is None else layer.own
            if held is None or held.shape[4] < self.capacity or held.shape[:4] != rows.shape[:4]:
                shape = (*rows.shape[:4], self.capacity, rows.shape[5])
                held = rows.new_zeros(shape) if self.zeroed else rows.new_empty(shape)
                if layer is None:
                    self.block = held
                else:
                    layer.own = held
            held[..., : rows.shape[-2], :] = rows
            length = rows.shape[-2]
        for layer in self.layers:  # each layer's views of its block (a new one, maybe) made now
            block = layer.own[0] if layer.own is not None else None if self.block is None else self.block[layer.number]
            if block is not None:
                layer.keys, layer.values, layer.device, layer.is_initialized = block[0], block[1], block.device, True
            layer.filled = length
        return length

    def settle(self, length: int) -> None:
        """Every layer holds ``length`` rows (the fixed-shape path moves them on the device and says so here)."""
        for layer in self.layers:
            layer.filled = length


def cache_keyword(model: torch.nn.Module) -> str:
    """The forward keyword that hands ``model`` a cache: ``cache`` in newer transformers, ``past_key_values`` in
    older 5.x releases. Only the right one will do: the other lands in the forward's ``**kwargs`` and the model
    silently runs without a cache."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
