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

A forward that would pass the capacity (a caller that reserved too little) doubles the buffer once; requests whose
caller reserves (``Target.prefill(ids, capacity=...)``) never reallocate. Each layer allocates on the device its
first keys arrive on, so a model sharded by ``--device-map`` keeps every layer's cache next to the layer.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache, CacheLayerMixin


class PositionLayer(CacheLayerMixin):
    """One attention layer's keys and values in ``[batch, heads, capacity, head_dim]`` buffers; ``filled`` rows
    are valid. The buffers survive between requests and are reallocated only to grow."""

    is_sliding = False
    is_croppable = True

    def __init__(self, capacity: int = 0) -> None:
        super().__init__()
        self.capacity = capacity
        self.filled = 0

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.device = key_states.device
        self.keys = key_states.new_empty((*key_states.shape[:2], self.capacity, key_states.shape[3]))
        self.values = value_states.new_empty((*value_states.shape[:2], self.capacity, value_states.shape[3]))
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.is_initialized or self.keys.shape[2] < self.capacity:
            self._allocate(key_states, value_states)
        end = self.filled + key_states.shape[2]
        if end > self.keys.shape[2]:
            self.capacity = max(end, 2 * self.keys.shape[2])
            self._allocate(key_states, value_states)
        self.keys[:, :, self.filled : end] = key_states
        self.values[:, :, self.filled : end] = value_states
        self.filled = end
        return self.keys[:, :, :end], self.values[:, :, :end]

    def _allocate(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """Fresh buffers of ``capacity`` rows, the filled rows copied over (none when a request starts)."""
        old = (self.keys, self.values) if self.is_initialized else None
        self.lazy_initialization(key_states, value_states)
        if old is not None and self.filled:
            self.keys[:, :, : self.filled] = old[0][:, :, : self.filled]
            self.values[:, :, : self.filled] = old[1][:, :, : self.filled]

    def move(self, start: int, index: torch.Tensor) -> None:
        """Rows ``index`` (all at or past ``start``) to ``start, start + 1, ...``; the rest past them is dropped."""
        self.keys[:, :, start : start + len(index)] = self.keys.index_select(2, index)
        self.values[:, :, start : start + len(index)] = self.values.index_select(2, index)

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


class PositionCache(Cache):
    """A :class:`PositionLayer` per decoder layer, reserved per request."""

    def __init__(self, layers: int) -> None:
        super().__init__(layers=[PositionLayer() for _ in range(layers)])

    def reserve(self, capacity: int) -> None:
        """Start a request of up to ``capacity`` positions: empty, and buffers of at least that many rows (held
        ones are reused when big enough)."""
        for layer in self.layers:
            layer.filled = 0
            layer.capacity = max(capacity, layer.capacity)

    def keep(self, start: int, rows: list[int]) -> None:
        """Of the rows past ``start`` keep only ``start + r`` for ``r`` in ``rows`` (ascending), moved down to
        ``start``; the cache then holds ``start + len(rows)`` rows. Only the kept rows move: the rest are simply
        overwritten by the next forward."""
        if rows != list(range(len(rows))):  # not a prefix of the block: move the accepted entries down
            index: dict[torch.device, torch.Tensor] = {}
            for layer in self.layers:  # a sharded model's layers keep their caches on their own devices
                if layer.device not in index:
                    index[layer.device] = torch.tensor([start + r for r in rows], device=layer.device)
                layer.move(start, index[layer.device])
        for layer in self.layers:
            layer.filled = start + len(rows)
