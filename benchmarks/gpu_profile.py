"""Where the device time of the fixed-shape path's slowest rows goes, for a GPU session's diagnosis: a one-token
step of the 8B-shaped model and an 8B-shaped EAGLE-3 head's level, each compiled, captured and eager, under
torch's profiler (the kernels by device time). gpu_check.py's ``fixed`` rows say how long they take; this says why.

    python -m benchmarks.gpu_profile            # on a CUDA machine, in bf16
    python -m benchmarks.gpu_profile --smoke    # tiny shapes on the CPU, in fp32
"""

from __future__ import annotations

import argparse
from functools import partial
from typing import Callable

import torch

from graft_cli.core import Tree
from graft_cli.runtime.fixed_target import drafter_shapes

from benchmarks.gpu_fixed import NAMES, VARIANTS, first_level, fixed_target, head_drafter, random_head, verify_step
from benchmarks.gpu_setup import GPU, SMOKE, big_model, kernel_table

CALLS = 5  # profiled calls of each run, after as many to warm up


def runs(device: str, shape: dict, dtype: torch.dtype, past: int, backend: str) -> dict[str, Callable[[], object]]:
    """The runs profiled, by name: a one-token step and a head level, compiled, captured and eager."""
    model = big_model(shape, device, dtype)
    head = random_head(model, 32000 if device.startswith("cuda") else shape["vocab_size"] // 2)
    out: dict[str, Callable[[], object]] = {}
    for switch in VARIANTS:
        target = fixed_target(model, switch, backend)
        target.prefill([i % shape["vocab_size"] for i in range(past)], capacity=past + 512)
        out[f"one-token step, {NAMES[switch]}"] = partial(verify_step(target), Tree(), reset=True)
        shapes = drafter_shapes(target)
        head.reset(past + 4096)
        drafter = head_drafter(model, head, False if shapes is None else shapes.capture, past, 8)
        out[f"head level, {NAMES[switch]}"] = partial(first_level, drafter, head)
    return out


def profile(device: str, shape: dict, dtype: torch.dtype, backend: str, past: int = 512) -> None:
    """Print each run's device time a call and its kernels, the most device time first."""
    for name, run in runs(device, shape, dtype, past, backend).items():
        total, table = kernel_table(run, device, CALLS, 12)
        print(f"== {name}: {total:.3f} ms of device time a call")
        print(table)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU")
    args = parser.parse_args()
    scale = SMOKE if args.smoke else GPU
    profile("cpu" if args.smoke else "cuda", scale.latency_shape, torch.float32 if args.smoke else torch.bfloat16,
            scale.compiler)


if __name__ == "__main__":
    main()
