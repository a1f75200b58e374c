"""A checkpoint's safetensors read in place: each tensor a view of the memory-mapped file, nothing read until used.

The files are mapped copy-on-write (``MAP_PRIVATE``), so a tensor that is written to (none is, at inference) never
reaches the file; a tensor already in the dtype asked for costs no copy at all, and pages the process never touches
(an LM head's rows that a packed copy replaced) are never read.
"""

from __future__ import annotations

import json
import mmap
from pathlib import Path

import torch

DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16, "F64": torch.float64,
          "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
          "BOOL": torch.bool}
INDEX = "model.safetensors.index.json"


def checkpoint_files(directory: Path) -> list[Path]:
    """The safetensors files of a model directory: one, or the shards its index names."""
    index = directory / INDEX
    if index.exists():
        return [directory / name for name in sorted(set(json.loads(index.read_text())["weight_map"].values()))]
    return [directory / "model.safetensors"]


def mapped(path: Path) -> dict[str, torch.Tensor]:
    """Every tensor of one safetensors file, as views of its memory map (they keep the map alive)."""
    with open(path, "rb") as file:
        memory = mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_COPY)
    size = int.from_bytes(memory[:8], "little")
    header = json.loads(memory[8 : 8 + size])
    tensors = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        dtype, (start, end) = DTYPES[entry["dtype"]], entry["data_offsets"]
        if end == start:
            tensors[name] = torch.empty(entry["shape"], dtype=dtype)
            continue
        flat = torch.frombuffer(memory, dtype=dtype, count=(end - start) // dtype.itemsize, offset=8 + size + start)
        tensors[name] = flat.view(entry["shape"])
    return tensors


def read_weights(directory: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a model directory's checkpoint, by name."""
    tensors: dict[str, torch.Tensor] = {}
    for path in checkpoint_files(directory):
        tensors.update(mapped(path))
    return tensors
