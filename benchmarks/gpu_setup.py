"""What every row of the GPU check stands on, shared by gpu_check.py and gpu_fixed.py (and gpu_profile.py): the
sizes a run uses (the GPU's, or the CPU smoke run's), the table its rows go into, the Llama-3-8B-shaped model
with random weights that the latency rows time, and how a row times device work.
"""

from __future__ import annotations

import statistics
import sys
import time
from dataclasses import dataclass
from typing import Callable

import torch
from transformers import AutoModelForCausalLM, LlamaConfig

LLAMA3_8B = dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                 num_key_value_heads=8, vocab_size=128256, rope_theta=500000.0)


@dataclass(frozen=True)
class Scale:
    """How big each part runs: the GPU run, or the CPU smoke run."""

    vocab: int
    hidden: int
    layers: int
    prompts: int
    new_tokens: int
    samples: int  # sampling runs per method
    latency_shape: dict
    sizes: tuple[int, ...]
    past: int
    repeats: int
    dtype: str  # bf16 on the GPU; fp32 on the CPU, where bf16 matmuls are slow and users run fp32
    depth: int | None  # draft levels (None: the device's default)
    compiler: str = "inductor"  # the compiled rows' backend: a smoke run's aot_eager traces without code generation


GPU = Scale(1024, 512, 6, 8, 128, 400, LLAMA3_8B, (1, 2, 4, 8, 16, 32, 64, 96, 128, 192, 256), 512, 10, "bfloat16",
            None)
SMOKE = Scale(97, 64, 6, 3, 24, 80, dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, vocab_size=97), (1, 4, 16), 64, 3, "float32", 3,
              "aot_eager")


class Table:
    """The one table the check prints: check | ok | figures."""

    def __init__(self) -> None:
        self.rows: list[tuple[str, bool | None, str]] = []
        self.details: dict[str, object] = {}  # what --out keeps besides the rows

    def add(self, check: str, ok: bool | None, figures: str) -> None:
        self.rows.append((check, ok, figures))
        mark = {True: "ok", False: "FAIL", None: "-"}[ok]
        print(f"  {check}: {mark} {figures}", file=sys.stderr, flush=True)  # progress while it runs

    def print(self, title: str) -> None:
        print(f"\n{title}\n\n| check | ok | figures |\n|---|---|---|")
        for check, ok, figures in self.rows:
            print(f"| {check} | {({True: 'ok', False: 'FAIL', None: '-'})[ok]} | {figures} |")

    @property
    def ok(self) -> bool:
        return all(ok is not False for _, ok, _ in self.rows)


def big_model(shape: dict, device: str, dtype: torch.dtype) -> torch.nn.Module:
    """A Llama of ``shape`` with random weights from its config, built on ``device``: an 8B model's timings
    without a download."""
    config = LlamaConfig(**shape, max_position_embeddings=8192, attn_implementation="sdpa")
    with torch.device(device):
        return AutoModelForCausalLM.from_config(config, dtype=dtype).eval()


def syncer(device: str) -> Callable[[], None]:
    """What waits for ``device`` to finish its queue: a timing that does not wait times the launches only."""
    return torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)


def kernel_table(run: Callable[[], object], device: str, calls: int = 5, rows: int = 10) -> tuple[float, str]:
    """Device milliseconds a call of ``run`` takes under torch's profiler (``calls`` calls after as many to warm
    up), and its ``rows`` kernels by device time, as the profiler's table prints them."""
    from torch.profiler import ProfilerActivity, profile

    sync = syncer(device)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.startswith("cuda") else [])
    with torch.inference_mode():
        for _ in range(calls):
            run()
        sync()
        with profile(activities=activities) as prof:
            for _ in range(calls):
                run()
            sync()
    averages = prof.key_averages()
    total = sum(e.self_device_time_total for e in averages) / calls / 1000
    return total, averages.table(sort_by="self_device_time_total", row_limit=rows, max_name_column_width=60)


def timed(run: Callable[[], object], sync: Callable[[], None], repeats: int) -> float:
    """Median milliseconds of ``run`` (a first call warms up)."""
    times = []
    for _ in range(repeats + 1):
        sync()
        start = time.perf_counter()
        run()
        sync()
        times.append(time.perf_counter() - start)
    return statistics.median(times[1:]) * 1000
