"""The mixed mode on a CPU (``--dtype mixed``): a prompt's forward in bf16, every decoding step in fp32.

Why: a prompt's forward multiplies hundreds of rows at once, where a CPU with bf16 units (AMX, AVX512-BF16) takes
well under fp32's time, while a step's 1-16 rows gain little or lose (docs/models.md, "Precision on a CPU"). On a
long prompt the prefill is a large share of a request, and speculation cannot shorten it.

What it guarantees: each linear layer of the prompt's forward multiplies in bf16 (inputs rounded to bf16, products
summed in fp32, the result returned in fp32); norms, attention and the KV cache stay fp32. oneDNN's packed product
gives a row the same result whatever rows travel with it, so a prompt row's cache entry does not depend on how
the prompt was chunked or which rows a prefix cache resumed. Every step verifies in fp32. So every method's greedy
tokens are plain decoding's *in the same mode*, and sampled text the same for a seed; they are not plain fp32
decoding's, whose prompt rows differ in their last bits.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator, Sequence

import torch
from torch import nn

from graft_cli.runtime.cpu_linear import PACK_BATCH, CpuLinear

PROMPT_DTYPE = torch.bfloat16


def add_prompt_copies(model: nn.Module) -> int:
    """Give every ``CpuLinear`` of ``model`` a packed bf16 copy of its weight (and bias) for prompts; the bytes
    added (half of what the fp32 weights take)."""
    added = 0
    for module in model.modules():
        if isinstance(module, CpuLinear) and module.weight.numel():
            weight = module.weight.detach().to(PROMPT_DTYPE)
            bias = None if module.bias is None else module.bias.detach().to(PROMPT_DTYPE)
            module.prompt = (torch.ops.mkldnn._reorder_linear_weight(weight, PACK_BATCH), bias)
            added += weight.numel() * weight.element_size()
    return added


def prompt_layers(model: nn.Module) -> list[CpuLinear]:
    """The layers a prompt's forward switches: those given a copy by :func:`add_prompt_copies` (none in any other
    mode, so the switch costs nothing there)."""
    return [m for m in model.modules() if isinstance(m, CpuLinear) and m.prompt is not None]


@contextmanager
def prompt_precision(layers: Sequence[CpuLinear]) -> Iterator[None]:
    """While inside, ``layers`` multiply through their bf16 copies."""
    for layer in layers:
        layer.in_prompt = True
    try:
        yield
    finally:
        for layer in layers:
            layer.in_prompt = False
