"""Every setting whose default depends on the device, in one table: the code and the help texts read it here.

A CPU pays for every verified token and every draft row, so it verifies small trees of a few confident paths; a
GPU verifies dozens of tokens for the price of one (memory-bound), so it verifies wide trees and keeps its device
queue full (a read of the device stalls it: the draft's depth is planned before each draft there).
"""

from __future__ import annotations

from dataclasses import dataclass


PREFIX_CACHE_MIB = 1024  # the prefix cache's default budget: ~23K tokens of SmolLM2-135M's fp32 rows, ~18K of Qwen2.5-1.5B's
MAX_LEVELS = 24  # draft forwards per step at most in a cost-chosen tree, unless --depth says otherwise


@dataclass(frozen=True)
class DeviceDefaults:
    budget: int  # verified tree nodes per step
    depth: int  # draft tree levels at most (fixed trees)
    draft_top_k: int  # draft nodes expanded per level, and children per node
    draft_window: int  # prompt tokens a draft model reads at most (0: all of it)
    draft_weights: str  # a draft model's linear weights: "fp16" (where FBGEMM has the kernel) or "full"
    ranked_draft_vocab: bool  # a draft model scores only the ranked tokens covering nearly all of a corpus
    prune_floor: float  # draft frontier nodes less likely than this are not expanded
    planned_draft: bool  # the cost-aware draft's depth is chosen before the draft, with one read at its end
    latency: dict[int, float]  # verification latency by tokens fed, relative to one token, until measured
    per_context: tuple[float, float]  # what each context token past 512 adds: to every forward, per fed row
    profile_sizes: tuple[int, ...]  # tokens fed per forward when the latency is measured (--budget auto)
    dtype: str  # the model's dtype under --dtype auto (CUDA: bf16 where the card has it, else fp16)
    graphs: bool  # verify at fixed shapes, captured as CUDA graphs (a CPU pays for the padding: off)
    compiled: bool = False  # ... with the regions compiled by torch.compile (graft_cli/runtime/compiled.py)


# CPU latency: SmolLM2-135M with a 512-token cache and graft's CPU kernels, made non-decreasing; its context cost:
# one thread at 4K tokens against a few hundred (one row 50 -> 86 ms, 17 rows 78 -> 200 ms). CUDA: flat while the
# GPU is memory-bound, the regime EAGLE's budget of 60 assumes; its context cost is not measured yet.
CPU = DeviceDefaults(
    budget=16, depth=8, draft_top_k=2, draft_window=2048, draft_weights="fp16", ranked_draft_vocab=True,
    prune_floor=0.1, planned_draft=False,
    latency={1: 1.0, 2: 1.08, 3: 1.12, 4: 1.12, 6: 1.12, 8: 1.22, 12: 1.40, 16: 1.52, 24: 2.01, 32: 2.48, 48: 3.47,
             64: 4.26},
    per_context=(1.9e-4, 2.8e-5), profile_sizes=(1, 2, 4, 8, 16, 32, 64), dtype="float32", graphs=False,
    compiled=False,  # measured slower on this path's CPU (docs/gpu.md, "The compiled path")
)
CUDA = DeviceDefaults(
    budget=60, depth=7, draft_top_k=8, draft_window=0, draft_weights="full", ranked_draft_vocab=False,
    prune_floor=0.02, planned_draft=True,
    latency={1: 1.0, 16: 1.0, 32: 1.02, 64: 1.08, 128: 1.35},
    per_context=(0.0, 0.0), profile_sizes=(1, 2, 4, 8, 16, 32, 64, 96, 128), dtype="bfloat16", graphs=True,
    compiled=False,  # on once the GPU rows measure it faster (docs/gpu.md, "The compiled path")
)
DEVICES = {"cpu": CPU, "cuda": CUDA}


def device_kind(device: object) -> str:
    """``cuda`` for any CUDA device (``cuda``, ``cuda:1``, a torch.device), else ``cpu``: the table's keys."""
    return "cuda" if str(device).startswith("cuda") else "cpu"


def defaults_for(device: object) -> DeviceDefaults:
    return DEVICES[device_kind(device)]


def both(field: str, unit: str = "") -> str:
    """A help text's "N on CPU, M on CUDA" for one field of the table."""
    return f"{getattr(CPU, field)}{unit} on CPU, {getattr(CUDA, field)}{unit} on CUDA"
