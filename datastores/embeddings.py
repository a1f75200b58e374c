"""A model's input-embedding rows, read straight from its safetensors files (no torch).

The safetensors layout is simple (an 8-byte little-endian header length, a JSON header with each tensor's dtype,
shape and byte offsets, then the raw data), so the one tensor needed is memory-mapped and converted to float32,
bfloat16 included (which numpy cannot represent, hence no ``safetensors.numpy`` here). Sharded checkpoints
(``model.safetensors.index.json``) are followed to the file that holds the tensor.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import numpy as np

from datastores.errors import DatastoreError

# tensor-name endings of the input embedding in common architectures, best first
EMBEDDING_NAMES = (
    "model.embed_tokens.weight",
    "embed_tokens.weight",
    "transformer.wte.weight",
    "wte.weight",
    "word_embeddings.weight",
    "tok_embeddings.weight",
    "embeddings.weight",
    "embed_in.weight",
)
_DTYPES = {"F32": np.float32, "F16": np.float16, "F64": np.float64, "BF16": np.uint16}


def _header(path: Path) -> tuple[dict, int]:
    try:
        with open(path, "rb") as f:
            raw = f.read(8)
            if len(raw) != 8:
                raise ValueError("file too short")
            (n,) = struct.unpack("<Q", raw)
            if n > 100_000_000:
                raise ValueError("header too large")
            header = json.loads(f.read(n))
    except (OSError, ValueError) as e:
        raise DatastoreError(f"cannot read safetensors file {path}: {e}") from e
    return header, 8 + n


def _pick(names: list[str]) -> str | None:
    for ending in EMBEDDING_NAMES:
        hits = sorted((n for n in names if n == ending or n.endswith("." + ending)), key=len)
        if hits:
            return hits[0]
    return None


def find_embeddings(model_dir: str | Path) -> tuple[Path, str]:
    """``(file, tensor name)`` of the input embedding of the model in ``model_dir``."""
    model_dir = Path(model_dir)
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (OSError, ValueError, KeyError) as e:
            raise DatastoreError(f"cannot read {index}: {e}") from e
        name = _pick(list(weight_map))
        if name is None:
            raise DatastoreError(f"no input-embedding tensor in {index}")
        return model_dir / weight_map[name], name
    files = sorted(model_dir.glob("*.safetensors")) if model_dir.is_dir() else []
    if not files:
        raise DatastoreError(f"no safetensors weights in {model_dir} (an n-gram store embeds with the model's input embeddings)")
    for path in files:
        header, _ = _header(path)
        name = _pick([k for k in header if k != "__metadata__"])
        if name is not None:
            return path, name
    raise DatastoreError(f"no input-embedding tensor (e.g. model.embed_tokens.weight) in {model_dir}")


def load_embeddings(model_dir: str | Path) -> np.ndarray:
    """The ``[vocab, hidden]`` input-embedding matrix as float32."""
    path, name = find_embeddings(model_dir)
    header, base = _header(path)
    info = header.get(name)
    if not isinstance(info, dict):
        raise DatastoreError(f"{path} has no tensor {name}")
    dtype = _DTYPES.get(info.get("dtype"))
    shape = info.get("shape")
    if dtype is None or not isinstance(shape, list) or len(shape) != 2:
        raise DatastoreError(f"{name} in {path} is {info.get('dtype')} {shape}: expected a 2-D float tensor")
    start, end = info["data_offsets"]
    count = int(shape[0]) * int(shape[1])
    if end - start != count * np.dtype(dtype).itemsize:
        raise DatastoreError(f"{name} in {path} has inconsistent offsets (damaged file?)")
    try:
        raw = np.memmap(path, dtype=dtype, mode="r", offset=base + start, shape=(count,))
    except (OSError, ValueError) as e:
        raise DatastoreError(f"cannot map {name} from {path}: {e}") from e
    if info["dtype"] == "BF16":
        out = (raw.astype(np.uint32) << np.uint32(16)).view(np.float32)
    else:
        out = np.asarray(raw, dtype=np.float32)
    return out.reshape(int(shape[0]), int(shape[1]))
