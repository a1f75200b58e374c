"""A GGUF's 4-bit weights kept as they are stored, beside the float32 conversion, for ``--dtype q4``.

Written once, when a GGUF is converted: every linear weight of a Llama or Qwen2 GGUF stored as Q4_0, Q4_1 or Q4_K
goes into ``q4.graft`` (safetensors' format, but not its suffix: vLLM and other loaders read every
``*.safetensors`` of a model directory as the model's weights) under its Hugging Face name, as three tensors:

- ``NAME.q4``: uint8 ``[out, in/2]``, two 4-bit values a byte (column ``2j`` in the low nibble, ``2j+1`` in the
  high one), each 0-15;
- ``NAME.scale`` and ``NAME.offset``: float32 ``[out, in/32]``: weight = scale * value + offset within each group
  of 32 columns. All three types are that form: Q4_0's scale d with offset -8d, Q4_1's d and m, Q4_K's
  sub-block scale d*sc and offset -dmin*m (both exact in float32).

The file is checked before it is kept: scale * value + offset, computed in float32, must be bit for bit the
weights of the float32 conversion (transformers dequantises a GGUF the same way). Other types (Q8_0, Q6_K, ...)
and every other tensor are not written: no maintained CPU kernel multiplies them as stored (docs/models.md).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

FILE = "q4.graft"
GROUP = 32  # columns sharing one scale and offset
TYPES = ("Q4_0", "Q4_1", "Q4_K")
LINEARS = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
           "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
           "ffn_down": "mlp.down_proj"}
ARCHITECTURES = ("llama", "qwen2")


def hf_name(name: str) -> str | None:
    """The Hugging Face name of a GGUF linear weight (``blk.3.attn_q.weight``), or None for any other tensor."""
    if name == "output.weight":
        return "lm_head.weight"
    parts = name.split(".")
    if len(parts) == 4 and parts[0] == "blk" and parts[2] in LINEARS and parts[3] == "weight":
        return f"model.layers.{parts[1]}.{LINEARS[parts[2]]}.weight"
    return None


def _halves(data: np.ndarray, start: int) -> np.ndarray:
    """The float16 at byte ``start`` of every block, as float32 ``[rows, blocks, 1]``."""
    return np.ascontiguousarray(data[..., start : start + 2]).view(np.float16).astype(np.float32)


def _nibbles(packed: np.ndarray) -> np.ndarray:
    """A 32-value run stored as 16 bytes: values 0-15 in the low nibbles, 16-31 in the high ones."""
    return np.concatenate([packed & 15, packed >> 4], axis=-1)


def _k_scales(raw: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K's twelve bytes of 6-bit scales and mins for its eight sub-blocks, as ``[rows, blocks, 8]`` each."""
    low, mid, high = raw[..., 0:4], raw[..., 4:8], raw[..., 8:12]
    scales = np.concatenate([low & 63, (high & 15) | ((low >> 2) & 48)], axis=-1)
    mins = np.concatenate([mid & 63, (high >> 4) | ((mid >> 2) & 48)], axis=-1)
    return scales.astype(np.float32), mins.astype(np.float32)


def unpack(kind: str, data: np.ndarray, columns: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A tensor's rows of GGUF blocks (uint8 ``[rows, bytes]``) as values ``[rows, columns]`` (uint8, 0-15) and
    float32 scales and offsets ``[rows, columns/32]``."""
    rows = data.shape[0]
    if kind in ("Q4_0", "Q4_1"):
        size = 18 if kind == "Q4_0" else 20
        blocks = data.reshape(rows, columns // 32, size)
        scale = _halves(blocks, 0)
        offset = -8 * scale if kind == "Q4_0" else _halves(blocks, 2)
        values = _nibbles(blocks[..., size - 16 :])
    elif kind == "Q4_K":  # 256 values: d, dmin, 12 bytes of scales, then 4 runs of 32 bytes (low, high nibbles)
        blocks = data.reshape(rows, columns // 256, 144)
        sub_scales, sub_mins = _k_scales(blocks[..., 4:16])
        scale, offset = _halves(blocks, 0) * sub_scales, -(_halves(blocks, 2) * sub_mins)
        runs = blocks[..., 16:].reshape(rows, columns // 256, 4, 1, 32)
        values = np.concatenate([runs & 15, runs >> 4], axis=-2)  # sub-block 2r: low nibbles, 2r+1: high
    else:
        raise ValueError(f"not a 4-bit type: {kind}")
    return values.reshape(rows, columns), scale.reshape(rows, -1), offset.reshape(rows, -1)


def unpermute(rows: np.ndarray, heads: int) -> np.ndarray:
    """Undo llama.cpp's reordering of a Llama query or key projection's output rows (its rotary halves
    interleaved): the rows transformers' GGUF loader restores, applied to any per-row array."""
    half = rows.shape[0] // heads // 2
    return rows.reshape(heads, half, 2, *rows.shape[1:]).swapaxes(1, 2).reshape(rows.shape)


def dequantised(values: np.ndarray, scale: np.ndarray, offset: np.ndarray) -> np.ndarray:
    """float32 ``[rows, columns]``: scale * value + offset per group, in the order the check relies on."""
    rows, columns = values.shape
    grouped = values.reshape(rows, -1, GROUP).astype(np.float32)
    return (scale[..., None] * grouped + offset[..., None]).reshape(rows, columns)


def four_bit_tensors(reader: Any, config: Any) -> dict[str, tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """The GGUF's 4-bit linear weights by Hugging Face name: ``(values, scale, offset)``, rows in the converted
    model's order."""
    found = {}
    permuted = {"attn_q": config.num_attention_heads, "attn_k": config.num_key_value_heads}
    for tensor in reader.tensors:
        name, kind = hf_name(tensor.name), tensor.tensor_type.name
        if name is None or kind not in TYPES:
            continue
        columns = int(tensor.shape[0])  # GGUF lists dimensions innermost first
        parts = unpack(kind, np.asarray(tensor.data), columns)
        heads = permuted.get(tensor.name.split(".")[2] if tensor.name.startswith("blk.") else "")
        if config.model_type == "llama" and heads:
            parts = tuple(unpermute(part, heads) for part in parts)
        found[name] = parts
    return found


def write_q4(gguf_path: Path, out_dir: Path, config: Any, weights: dict[str, Any]) -> int:
    """Write ``q4.graft`` into ``out_dir`` from the GGUF's 4-bit linear weights, each checked bit for bit
    against ``weights`` (the float32 conversion's tensors by name); returns how many were written (0: no file)."""
    import gguf  # lazy: only a conversion reads a GGUF's blocks
    from safetensors.numpy import save_file  # lazy: as above

    if config.model_type not in ARCHITECTURES:
        return 0
    found = four_bit_tensors(gguf.GGUFReader(str(gguf_path)), config)
    tensors = {}
    for name, (values, scale, offset) in found.items():
        reference = weights.get(name)
        if reference is None or not np.array_equal(dequantised(values, scale, offset), reference):
            raise ValueError(f"its 4-bit {name} does not dequantise to the converted weights")
        tensors[f"{name}.q4"] = np.ascontiguousarray(values[:, 0::2] | (values[:, 1::2] << 4))
        tensors[f"{name}.scale"], tensors[f"{name}.offset"] = scale, offset
    if tensors:
        save_file(tensors, str(out_dir / FILE))
    return len(found)
