"""Linears over a GGUF's quantized weights as stored (``--dtype q4``): a model that keeps its 4-, 5- and 8-bit
values and their per-32 block scales in memory instead of float32 or bf16 copies.

The product is torch's own CPU kernel for 4-bit weights with per-group scales and zeros
(``_weight_int4pack_mm_for_cpu``, weight = (value - 8) * scale + zero, groups of 32 columns), the one maintained
CPU kernel that multiplies GGUF blocks as they are stored. It is fast only for bf16 inputs (its fp32 and fp16
paths are scalar: 25-35x slower), so a q4 model runs in bf16, and the scale and zero it reads are the GGUF's rounded
to bf16 (the values themselves are the GGUF's, untouched). A row's result does not depend on the rows beside it
(tests/test_four_bit.py), so a tree's rows get the bits plain decoding's single row gets, as in bf16.

A 5- or 8-bit weight (Q5_0, Q5_1, Q8_0) is stored as two 4-bit planes (graft_cli/catalog/q4.py): the kernel runs
once over twice the columns, the input repeated, so the two halves add up inside its float32 sum. Linears whose
weights the GGUF stores otherwise (Q6_K, float), the embeddings and the norms are read from the float32 conversion
in bf16, as ``--dtype bfloat16`` reads them.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from graft_cli.catalog.q4 import FILE, GROUP
from graft_cli.core.threads import fanned, product_pays
from graft_cli.models.decoder import FUSED
from graft_cli.models.weights import mapped

_PARTS = (".q4", ".scale", ".offset")
# a packed weight from which even one row's product runs on every thread: the kernel unpacks as it multiplies, so
# it is bound by arithmetic, not memory (the 2-core Zen 4, one row, two threads against one: 0.8 MiB 1.03x, 1.5 MiB
# 1.26x, 6.6 MiB 1.62x, 13 MiB 1.90x)
PARALLEL_PACKED = 1 << 20


class FourBitLinear(nn.Module):
    """``x @ W.T + bias`` for a bf16 ``x [..., in_features]``, ``W`` held as packed 4-bit values ``packed`` (the
    kernel's layout) and ``scales_zeros [planes * in/32, out, 2]`` (bf16): ``planes`` 2 for 5- and 8-bit weights,
    whose input the kernel reads twice."""

    def __init__(self, packed: torch.Tensor, scales_zeros: torch.Tensor, bias: torch.Tensor | None,
                 planes: int = 1) -> None:
        super().__init__()
        self.planes = planes
        self.in_features = scales_zeros.shape[0] * GROUP // planes
        self.out_features = scales_zeros.shape[1]
        self.register_buffer("packed", packed)
        self.register_buffer("scales_zeros", scales_zeros)
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features)
        if self.planes == 2:
            flat = torch.cat([flat, flat], dim=-1)
        # many rows or a large weight: on every thread the forward has (core/threads.py)
        with fanned(product_pays(flat.shape[0], self.packed.nbytes, PARALLEL_PACKED)):
            y = torch.ops.aten._weight_int4pack_mm_for_cpu(flat, self.packed, GROUP, self.scales_zeros)
        if self.bias is not None:
            y = y + self.bias
        return y.view(*x.shape[:-1], self.out_features)


def four_bit_weights(directory: Path) -> dict[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] | None:
    """A model directory's 4-bit linear weights (graft_cli/catalog/q4.py) by weight name, ``(values, scale,
    offset)`` memory-mapped; None where the directory has none."""
    path = Path(directory) / FILE
    if not path.is_file():
        return None
    tensors = mapped(path)
    names = sorted({key[: -len(".q4")] for key in tensors if key.endswith(".q4")})
    return {name: tuple(tensors[name + part] for part in _PARTS) for name in names}


def _widened(part: tuple[torch.Tensor, torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, ...]:
    """A one-plane weight as two planes, the second all zero (scale and offset 0: it adds exactly nothing), to be
    stacked with a wider weight's rows in a fused projection."""
    return tuple(torch.cat([tensor, torch.zeros_like(tensor)], dim=1) for tensor in part)


def four_bit_linear(parts: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]], bias: torch.Tensor | None,
                    in_features: int) -> FourBitLinear:
    """One linear of ``in_features`` columns from one or more weights' parts (one or two planes each), their
    output rows stacked (a fused projection)."""
    columns = [part[0].shape[1] * 2 for part in parts]  # two values a byte
    if not set(columns) <= {in_features, 2 * in_features}:
        raise ValueError(f"4-bit weights of {columns} columns for a linear of {in_features}")
    planes = [count // in_features for count in columns]
    if len(set(planes)) > 1:
        parts = [_widened(part) if n == 1 else part for part, n in zip(parts, planes)]
    packed, scale, offset = (torch.cat([part[i] for part in parts]) for i in range(3))
    values = torch.stack([packed & 15, packed >> 4], dim=-1).reshape(packed.shape[0], -1).to(torch.int32)
    zero = offset + 8 * scale  # the kernel's form: (value - 8) * scale + zero
    scales_zeros = torch.stack([scale.t(), zero.t()], dim=-1).to(torch.bfloat16).contiguous()
    kernel_layout = torch.ops.aten._convert_weight_to_int4pack_for_cpu(values, 2)
    return FourBitLinear(kernel_layout, scales_zeros, None if bias is None else bias.to(torch.bfloat16),
                         max(planes))


def precision(model: nn.Module) -> str:
    """What a model's forward computes in, as profiles and reports name it: ``q4`` where its linears are 4-bit,
    else its parameters' dtype (``float32``, ``bfloat16``, ...)."""
    if any(isinstance(module, FourBitLinear) for module in model.modules()):
        return "q4"
    return str(next(model.parameters()).dtype).replace("torch.", "")


def attach(model: nn.Module, weights: dict[str, torch.Tensor],
           four_bit: dict[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]) -> int:
    """Put a :class:`FourBitLinear` in place of every linear of ``model`` (graft's own forward, on the meta
    device) whose weights are all 4-bit in ``four_bit``, a fused projection's parts stacked; their plain weights
    and biases leave ``weights`` and the new modules' tensors enter it. Returns how many linears were replaced."""
    replaced = 0
    for name, module in list(model.named_modules()):
        if not isinstance(module, nn.Linear):
            continue
        fused = next((f for f in FUSED if name.endswith(f)), None)
        sources = [name[: -len(fused)] + part for part in FUSED[fused]] if fused else [name]
        if not all(f"{source}.weight" in four_bit for source in sources):
            continue
        biases = [weights.pop(f"{source}.bias", None) for source in sources]
        for source in sources:
            weights.pop(f"{source}.weight", None)
        linear = four_bit_linear([four_bit[f"{source}.weight"] for source in sources],
                                 None if biases[0] is None else torch.cat(biases), module.in_features)
        parent, _, leaf = name.rpartition(".")
        setattr(model.get_submodule(parent), leaf, linear)
        weights.update({f"{name}.{key}": value for key, value in linear.state_dict().items()})
        replaced += 1
    return replaced
