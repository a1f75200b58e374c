"""The n-gram store's parameters: those of a build, which its manifest records (the shards of one store must agree
on them) and which are checked before the corpus is read, and the defaults of a query."""

from __future__ import annotations

from typing import Any

from datastores.errors import DatastoreError

BUILD_DEFAULTS: dict[str, Any] = {
    "n": 3,  # context length
    "top_k": 8,  # next tokens kept per context
    "min_count": 2,  # contexts seen fewer times are not stored
    "max_contexts": 1_000_000,  # the most frequent contexts kept
    "dim": 64,  # embedding dimensions after PCA
    "decay": 0.7,  # weight ratio between a position and the next one
    "index": "auto",  # auto (flat up to flat_max, else ivf), flat, ivf, hnsw
    "flat_max": 50_000,
    "nprobe": 8,  # IVF lists searched per query (HNSW: efSearch = 4 * nprobe)
}
QUERY_DEFAULTS: dict[str, Any] = {"neighbours": 8, "min_sim": 0.8, "depth": 8, "budget": 64}


def check_params(params: dict[str, Any]) -> dict[str, Any]:
    """``params`` over :data:`BUILD_DEFAULTS`, each converted to its default's type and range-checked: the
    manifest records every parameter, so stores built with and without a default given compare equal."""
    out = dict(BUILD_DEFAULTS)
    for key, value in params.items():
        if key not in BUILD_DEFAULTS:
            raise DatastoreError(f"unknown n-gram store parameter {key!r} (known: {', '.join(BUILD_DEFAULTS)})")
        default = BUILD_DEFAULTS[key]
        try:
            out[key] = type(default)(value)
        except (TypeError, ValueError):
            raise DatastoreError(
                f"n-gram store parameter {key} must be a {type(default).__name__}, not {value!r}"
            ) from None
    if not 1 <= out["n"] <= 16:
        raise DatastoreError("n-gram context length n must be between 1 and 16")
    if not 1 <= out["top_k"] <= 64:
        raise DatastoreError("top_k must be between 1 and 64")
    if out["min_count"] < 1 or out["max_contexts"] < 1 or out["dim"] < 2 or out["nprobe"] < 1:
        raise DatastoreError("min_count, max_contexts, nprobe must be at least 1 and dim at least 2")
    if not 0 < out["decay"] <= 1:
        raise DatastoreError("decay must be in (0, 1]")
    if out["index"] not in ("auto", "flat", "ivf", "hnsw"):
        raise DatastoreError("index must be auto, flat, ivf or hnsw")
    return out
