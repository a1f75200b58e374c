"""Linear layers that keep a tree of a few tokens cheap to verify on a CPU.

Speculative decoding pays off when feeding k tokens costs far less than k forwards. With PyTorch's default fp32
CPU path (MKL) it did not on this project's machine (AMD EPYC, one thread): ``F.linear`` over 2 or 3 rows of a
large weight cost about 2 and 3 times 1 row, so a 2-token tree cost the 0.5B Qwen two forwards. Two measured
remedies, each the same product with another kernel (docs/benchmarks.md, "CPU kernels"):

- 2-3 rows through a large weight that widens (out >= in, and 4 rows through an LM head): ``(W @ x.T).T``, a
  GEMM with a narrow right-hand side that streams the weight once. 2 rows then cost about 1.1 rows.
- everything else: oneDNN's linear (``torch.ops.mkldnn._linear_pointwise``), 1.2-1.8x faster than MKL's from 2 to
  32 rows here, and no slower for 1 row. Plain ``F.linear`` where that operator is missing.

The summation order changes in the last bits, as it already did between MKL's kernels for different row counts;
greedy outputs stay identical to plain decoding in the same process, which is what the tests check.
"""

from __future__ import annotations

from functools import cache

import torch
from torch import nn
from torch.nn import functional as F

LARGE = 1 << 21  # weights of 2M+ elements that widen: 2-3 rows go narrow
HUGE = 1 << 24  # 16M+ (LM heads): 4 rows too


@cache
def onednn_available() -> bool:
    try:
        torch.ops.mkldnn._linear_pointwise(torch.ones(1, 2), torch.ones(3, 2), None, "none", [], "")
    except (AttributeError, RuntimeError):
        return False
    return True


def narrow_rows(weight: torch.Tensor) -> tuple[int, ...]:
    """Row counts for which ``weight`` goes through the narrow GEMM."""
    out_features, in_features = weight.shape
    rows = (2, 3) if out_features >= in_features and weight.numel() >= LARGE else ()
    return (*rows, 4) if weight.numel() >= HUGE else rows


class CpuLinear(nn.Linear):
    """``nn.Linear`` whose forward picks the faster CPU kernel by row count; the same parameters (tied weights
    stay tied). ``narrow`` (the row counts that go narrow) is set once, when a layer is switched."""

    narrow: tuple[int, ...] = ()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // x.shape[-1] if x.numel() else 0
        if rows in self.narrow:
            y = (self.weight @ x.reshape(rows, -1).T).T.contiguous()  # a transposed view would slow the next layer
            if self.bias is not None:
                y = y + self.bias
            return y.reshape(*x.shape[:-1], self.out_features)
        if onednn_available():
            return torch.ops.mkldnn._linear_pointwise(x, self.weight, self.bias, "none", [], "")
        return F.linear(x, self.weight, self.bias)


def use_cpu_linears(model: nn.Module) -> None:
    """Switch every plain ``nn.Linear`` of an fp32 CPU model to ``CpuLinear`` in place (nothing is copied)."""
    for module in model.modules():
        if type(module) is nn.Linear and module.weight.device.type == "cpu" and module.weight.dtype == torch.float32:
            module.__class__ = CpuLinear
            module.narrow = narrow_rows(module.weight)
