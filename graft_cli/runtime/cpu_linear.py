"""Linear layers that keep a tree of a few tokens cheap to verify on a CPU.

Speculative decoding pays off when feeding k tokens costs far less than k forwards. With PyTorch's default fp32
CPU path (MKL) it did not on this project's machine (AMD EPYC, one thread): ``F.linear`` over 2 or 3 rows of a
large weight cost about 2 and 3 times 1 row, because the GEMM repacks the whole weight on every call and a
one-token forward only streams it. The remedy, measured (docs/cpu.md, "Kernels"):

- every weight is packed once, at load, into oneDNN's blocked layout (``torch.ops.mkldnn._reorder_linear_weight``)
  and multiplied with ``torch.ops.mkldnn._linear_pointwise``: feeding 4 to 6 tokens to SmolLM2 then costs about
  what 1 token costs, and 16 tokens 1.8 (against 1.34-1.59 and 2.16 before);
- inputs of 1-3 rows are padded to 4: oneDNN's kernels for fewer rows over a packed weight run slower than 4
  rows (2 rows cost 1.3 one-row forwards, 4 rows 1.0).

A bf16 model's layers are packed alike where the CPU multiplies bf16 in hardware (AMX or AVX512-BF16,
graft_cli/core/cpu_units.py): there the packed bf16 product takes about half the packed fp32 one's time at every
row count from 1 to 64 (half the bytes to stream), where transformers' plain bf16 linear lost to fp32 below 16
rows; elsewhere bf16 stays plain (emulated either way). Its row results do not depend on the rows beside it
either, so a bf16 tree's linears give each row the bits a one-row step gives it.

The packed copy costs as much memory as the weights, so a model is packed only when the machine has room for the
copy (``GRAFT_CPU_PACK=0`` never packs, ``=1`` always does); otherwise its layers run oneDNN over the plain weight.
The plain weight stays: other code reads it (an EAGLE-3 head's training copies the target's LM head rows,
``--draft-vocab`` slices a draft's), and releasing it lowered no measured peak (fp32 safetensors are memory-mapped:
their pages stay resident until the file's last tensor goes). The summation order changes in the last bits, as it
already did between MKL's kernels for different row counts; greedy outputs stay identical to plain decoding in the
same process, which is what the tests check.
"""

from __future__ import annotations

import os
from functools import cache
from pathlib import Path

import torch
from torch import nn

from graft_cli.core.cpu_units import cpu_units
from graft_cli.core.threads import fanned, product_pays

PAD_ROWS = 4  # 1-3 rows through a packed weight run as 4
PACK_BATCH = 8  # the row count oneDNN's packed layout is chosen for (measured best among 1, 4 and 8)
MEMORY_SHARE = 0.5  # pack a model only if the copy fits in this share of the memory still available


@cache
def onednn_available() -> bool:
    try:
        torch.ops.mkldnn._linear_pointwise(torch.ones(1, 2), torch.ones(3, 2), None, "none", [], "")
        torch.ops.mkldnn._reorder_linear_weight(torch.ones(3, 2), PACK_BATCH)
    except (AttributeError, RuntimeError):
        return False
    return True


class CpuLinear(nn.Linear):
    """``nn.Linear`` over a oneDNN-packed copy of its weight (``packed``, made once when the layer is switched;
    None: oneDNN over the plain weight). A packed layer's own weight is then an empty placeholder; a weight it
    shares with another module (tied embeddings) stays as it is."""

    packed: torch.Tensor | None = None
    # the mixed mode's (graft_cli/runtime/prompt_precision.py): a packed bf16 copy and its bias, used while
    # ``in_prompt`` (a prompt's forward) is set
    prompt: tuple[torch.Tensor, torch.Tensor | None] | None = None
    in_prompt: bool = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.compiler.is_compiling():  # inductor lowers no oneDNN linear: it chooses its own GEMM
            return nn.functional.linear(x, self.weight, self.bias)
        if self.in_prompt and self.prompt is not None:
            weight, bias = self.prompt
            return packed_product(x.to(weight.dtype), weight, bias, self.out_features).to(x.dtype)
        if self.packed is None:
            with fanned(product_pays(x.numel() // max(x.shape[-1], 1), self.weight.nbytes)):
                return torch.ops.mkldnn._linear_pointwise(x, self.weight, self.bias, "none", [], "")
        return packed_product(x, self.packed, self.bias, self.out_features)


def packed_product(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None, out: int) -> torch.Tensor:
    """``x`` times a oneDNN-packed weight, 1-3 rows padded to ``PAD_ROWS`` (a row's result does not depend on the
    rows beside it: the mixed mode relies on it, tests/test_prompt_precision.py checks it)."""
    rows = x.numel() // x.shape[-1] if x.numel() else 0
    # many rows or a large weight: on every thread the forward has (core/threads.py)
    with fanned(product_pays(rows, out * x.shape[-1] * x.element_size())):
        if 0 < rows < PAD_ROWS:
            flat = x.reshape(rows, -1)
            padded = torch.cat([flat, flat.new_zeros(PAD_ROWS - rows, flat.shape[1])])
            y = torch.ops.mkldnn._linear_pointwise(padded, packed, bias, "none", [], "")[:rows]
            return y.reshape(*x.shape[:-1], out)
        return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


def packed_dtypes() -> tuple[torch.dtype, ...]:
    """The weight dtypes this CPU's packed kernels serve: fp32, and bf16 where the CPU has bf16 units."""
    return (torch.float32, torch.bfloat16) if cpu_units().bf16 else (torch.float32,)


def use_cpu_linears(model: nn.Module, pack: bool | None = None) -> None:
    """Switch every plain CPU ``nn.Linear`` of ``model`` whose dtype :func:`packed_dtypes` names to ``CpuLinear``
    in place (nothing is copied but the packed weights). ``pack`` None: as ``GRAFT_CPU_PACK`` says, else when the
    copy fits in the memory available."""
    if not onednn_available():
        return  # plain F.linear it stays
    dtypes = packed_dtypes()
    layers = [m for m in model.modules()
              if type(m) is nn.Linear and m.weight.device.type == "cpu" and m.weight.dtype in dtypes]
    if pack is None and os.environ.get("GRAFT_CPU_PACK") in ("0", "1"):
        pack = os.environ["GRAFT_CPU_PACK"] == "1"
    if pack is None:
        need = sum(m.weight.numel() * m.weight.element_size() for m in layers)
        pack = need <= MEMORY_SHARE * available_memory()
    for module in layers:
        module.__class__ = CpuLinear
        if pack:
            module.packed = torch.ops.mkldnn._reorder_linear_weight(module.weight.detach(), PACK_BATCH)


def available_memory() -> int:
    """Bytes of memory the kernel says a new allocation can use (Linux ``MemAvailable``; elsewhere: unknown, 0)."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return 0
