"""A GGUF's quantized weights kept as they are stored, beside the float32 conversion, for ``--dtype q4``.

Written once, when a GGUF is converted: every linear weight of a Llama or Qwen2 GGUF stored as Q4_0, Q4_1, Q4_K,
Q5_0, Q5_1 or Q8_0 goes into ``q4.graft`` (safetensors' format, but not its suffix: vLLM and other loaders read
every ``*.safetensors`` of a model directory as the model's weights) under its Hugging Face name, as three tensors:

- ``NAME.q4``: uint8 ``[out, columns/2]``, two 4-bit values a byte (column ``2j`` in the low nibble, ``2j+1`` in
  the high one), each 0-15;
- ``NAME.scale`` and ``NAME.offset``: float32 ``[out, columns/32]``: weight = scale * value + offset within each
  group of 32 columns.

Every type is read as values with a scale and an offset per 32 columns: Q4_0's scale d with offset -8d, Q4_1's d
and m, Q4_K's sub-block scale d*sc and offset -dmin*m (exact in float32), Q5_0's d and -16d, Q5_1's d and m, Q8_0's
d and -128d (its int8 shifted to 0-255). The one kernel that multiplies such blocks takes 4-bit values, so a wider
type (5 or 8 bits) is kept as two 4-bit planes side by side, ``columns = 2 * in``: the high nibbles with scale
16*scale, then the low nibbles with the scale, the offset shared between them (:func:`planes`); their sum over the
same input repeated is the weight's product, every value kept exactly.

The file is checked before it is kept: scale * value + offset, computed in float32 before any split, must be bit
for bit the weights of the float32 conversion (transformers dequantises a GGUF the same way). Other types (Q6_K,
whose 16-column scales the kernel cannot take, and the rest), a weight whose rows are not a multiple of 16 and
every other tensor are not written (docs/quantized.md).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

FILE = "q4.graft"
GROUP = 32  # columns sharing one scale and offset
ROWS = 16  # the kernel lays a weight's rows out 16 at a time: a weight of other row counts is not kept
FOUR_BIT = ("Q4_0", "Q4_1", "Q4_K")
WIDE = ("Q5_0", "Q5_1", "Q8_0")  # kept as two 4-bit planes
TYPES = FOUR_BIT + WIDE
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


def _five_bit(blocks: np.ndarray, start: int) -> np.ndarray:
    """Q5_0/Q5_1 values 0-31: the low nibbles from the 16 bytes after the 4 bytes of fifth bits at ``start``
    (bit j of that little-endian word is value j's)."""
    high = np.ascontiguousarray(blocks[..., start : start + 4]).view(np.uint32)
    fifth = ((high >> np.arange(32, dtype=np.uint32)) & 1).astype(np.uint8) << 4
    return _nibbles(blocks[..., start + 4 :]) | fifth


def _k_values(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Q4_K's 256-value blocks: d, dmin, 12 bytes of scales, then 4 runs of 32 bytes (sub-block 2r in the low
    nibbles of run r, 2r+1 in the high ones)."""
    rows, count = blocks.shape[:2]
    sub_scales, sub_mins = _k_scales(blocks[..., 4:16])
    runs = blocks[..., 16:].reshape(rows, count, 4, 1, 32)
    values = np.concatenate([runs & 15, runs >> 4], axis=-2)
    return values, _halves(blocks, 0) * sub_scales, -(_halves(blocks, 2) * sub_mins)


_BLOCKS = {"Q4_0": (32, 18), "Q4_1": (32, 20), "Q4_K": (256, 144), "Q5_0": (32, 22), "Q5_1": (32, 24),
           "Q8_0": (32, 34)}  # values and bytes a block


def unpack(kind: str, data: np.ndarray, columns: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A tensor's rows of GGUF blocks (uint8 ``[rows, bytes]``) as values ``[rows, columns]`` (uint8: 0-15, 0-31
    or 0-255 by type) and float32 scales and offsets ``[rows, columns/32]``."""
    if kind not in _BLOCKS:
        raise ValueError(f"not a type kept quantized: {kind}")
    rows, (span, size) = data.shape[0], _BLOCKS[kind]
    blocks = data.reshape(rows, columns // span, size)
    if kind == "Q4_K":
        return tuple(part.reshape(rows, -1) for part in _k_values(blocks))
    scale = _halves(blocks, 0)
    if kind == "Q8_0":
        values = (blocks[..., 2:].view(np.int8).astype(np.int16) + 128).astype(np.uint8)
        offset = -128 * scale
    elif kind in ("Q5_0", "Q5_1"):
        values = _five_bit(blocks, 2 if kind == "Q5_0" else 4)
        offset = -16 * scale if kind == "Q5_0" else _halves(blocks, 2)
    else:
        values = _nibbles(blocks[..., size - 16 :])
        offset = -8 * scale if kind == "Q4_0" else _halves(blocks, 2)
    return values.reshape(rows, columns), scale.reshape(rows, -1), offset.reshape(rows, -1)


def planes(values: np.ndarray, scale: np.ndarray, offset: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A wider type's ``(values, scale, offset)`` as two 4-bit planes side by side, twice the columns: the high
    nibbles with scale 16*scale, then the low ones with the scale; the same weight once both halves multiply the
    same input. The offset is shared between the planes so that the kernel's zero points (offset + 8 * its scale,
    rounded to bf16) stay exact where they can: Q8_0's are 0 and 8*scale, Q5_0's 128*scale and -8*scale."""
    high = np.where(np.abs(offset + 8 * scale) < np.abs(offset + 136 * scale), 0, -128 * scale).astype(np.float32)
    return (np.concatenate([values >> 4, values & 15], axis=1), np.concatenate([16 * scale, scale], axis=1),
            np.concatenate([high, offset - high], axis=1))


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


def quantized_tensors(reader: Any, config: Any) -> dict[str, tuple[str, np.ndarray, np.ndarray, np.ndarray]]:
    """The GGUF's linear weights of the types kept by Hugging Face name: ``(kind, values, scale, offset)``, rows
    in the converted model's order."""
    found = {}
    permuted = {"attn_q": config.num_attention_heads, "attn_k": config.num_key_value_heads}
    for tensor in reader.tensors:
        name, kind = hf_name(tensor.name), tensor.tensor_type.name
        if name is None or kind not in TYPES or int(tensor.shape[-1]) % ROWS:
            continue
        columns = int(tensor.shape[0])  # GGUF lists dimensions innermost first
        parts = unpack(kind, np.asarray(tensor.data), columns)
        heads = permuted.get(tensor.name.split(".")[2] if tensor.name.startswith("blk.") else "")
        if config.model_type == "llama" and heads:
            parts = tuple(unpermute(part, heads) for part in parts)
        found[name] = (kind, *parts)
    return found


def write_q4(gguf_path: Path, out_dir: Path, config: Any, weights: dict[str, Any]) -> int:
    """Write ``q4.graft`` into ``out_dir`` from the GGUF's quantized linear weights, each checked bit for bit
    against ``weights`` (the float32 conversion's tensors by name), a wider type then split into two planes;
    returns how many were written (0: no file)."""
    import gguf  # lazy: only a conversion reads a GGUF's blocks
    from safetensors.numpy import save_file  # lazy: as above

    if config.model_type not in ARCHITECTURES:
        return 0
    found = quantized_tensors(gguf.GGUFReader(str(gguf_path)), config)
    tensors = {}
    for name, (kind, values, scale, offset) in found.items():
        reference = weights.get(name)
        if reference is None or not np.array_equal(dequantised(values, scale, offset), reference):
            raise ValueError(f"its {kind} {name} does not dequantise to the converted weights")
        if kind in WIDE:
            values, scale, offset = planes(values, scale, offset)
        tensors[f"{name}.q4"] = np.ascontiguousarray(values[:, 0::2] | (values[:, 1::2] << 4))
        tensors[f"{name}.scale"], tensors[f"{name}.offset"] = scale, offset
    if tensors:
        save_file(tensors, str(out_dir / FILE))
    return len(found)
