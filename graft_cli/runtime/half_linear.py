"""A draft model's linear layers over half-precision weights, on a CPU.

On a CPU a draft forward of a few rows streams every weight from memory once, so it costs what its bytes cost: the
Qwen pair's 0.5B draft reads 2 GB of fp32 weights a forward, about a third of what a target step reads. Stored in
fp16 and multiplied by FBGEMM's fp16 kernel (``quantized::linear_dynamic_fp16``: the weights widen to fp32 in
registers, activations and arithmetic stay fp32), it reads half the bytes and a forward costs about half.

Only a draft model's weights go half: its tokens are proposals that the fp32 target verifies, so the draft's
precision moves how many tokens a step accepts, never which. On 400 positions of code the fp16 draft's top token
matched the fp32 draft's at every one; int8 weights (FBGEMM's dynamic int8, per-channel) were faster still but
matched at only 73-82%, and were dropped.

The half copy shares every other tensor with the model it is made from, which stays as it was: ``graft bench``'s
``hf-assisted`` runs the same loaded draft, at full precision, as a user of transformers would.
"""

from __future__ import annotations

import copy
from functools import cache

import torch
from torch import nn

from graft_cli.runtime.cpu_linear import CpuLinear


@cache
def half_available() -> bool:
    """Whether this torch build has FBGEMM's fp16 linear (x86 builds do)."""
    try:
        packed = torch.ops.quantized.linear_prepack_fp16(torch.ones(3, 2), None)
        torch.ops.quantized.linear_dynamic_fp16(torch.ones(1, 2), packed)
    except (AttributeError, RuntimeError):
        return False
    return True


class HalfLinear(nn.Linear):
    """``nn.Linear`` over an FBGEMM-packed fp16 copy of its weight (``half``). The fp32 ``weight`` stays, shared
    with the model the layer was copied from (a reduced vocabulary slices its head from it)."""

    half: torch.Tensor

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.compiler.is_compiling():  # dynamo cannot trace FBGEMM's packed weight: the full one, compiled
            return nn.functional.linear(x, self.weight, self.bias)
        return torch.ops.quantized.linear_dynamic_fp16(x, self.half)


def to_half(layer: nn.Linear) -> HalfLinear:
    """Switch one fp32 CPU ``nn.Linear`` (or ``CpuLinear``) to ``HalfLinear`` in place."""
    bias = None if layer.bias is None else layer.bias.detach()
    half = torch.ops.quantized.linear_prepack_fp16(layer.weight.detach(), bias)
    layer.__dict__.pop("packed", None)  # a CpuLinear's oneDNN copy: the half layer never reads it
    layer.__class__ = HalfLinear
    layer.half = half
    return layer


def half_copy(model: nn.Module) -> nn.Module:
    """A copy of ``model`` whose fp32 CPU linears run over fp16 weights; every parameter, buffer and packed weight
    of ``model`` is shared, not copied, and ``model`` is left unchanged."""
    shared = {id(t): t for t in [*model.parameters(), *model.buffers()]}
    shared |= {id(m.packed): m.packed for m in model.modules() if isinstance(m, CpuLinear) and m.packed is not None}
    twin = copy.deepcopy(model, shared)
    for layer in twin.modules():
        if isinstance(layer, nn.Linear) and layer.weight.device.type == "cpu" and layer.weight.dtype == torch.float32:
            to_half(layer)
    return twin
