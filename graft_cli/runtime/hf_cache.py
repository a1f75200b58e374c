"""graft's position-addressed KV cache as transformers' models take it: the same layers and cache under
transformers' ``CacheLayerMixin`` and ``Cache`` base classes, which its models check for and call through
(``update`` by layer index, the mask sizes, the sequence length).

Kept apart from graft_cli/runtime/kv_cache.py so that graft's own forward, which calls the layers itself, never
imports transformers' cache module (and the model machinery that comes with it).
"""

from __future__ import annotations

from transformers.cache_utils import Cache, CacheLayerMixin

from graft_cli.runtime.kv_cache import PositionCache, PositionLayer


class TransformersLayer(PositionLayer, CacheLayerMixin):
    """A :class:`PositionLayer` that transformers' attention updates through its cache."""


class TransformersCache(PositionCache, Cache):
    """A :class:`PositionCache` of :class:`TransformersLayer`, with the fields transformers' ``Cache`` reads."""

    layer = TransformersLayer

    def __init__(self, layers: int, shared: bool = True) -> None:
        super().__init__(layers, shared)
        self.layer_class_to_replicate = None
        self.offloading = False
