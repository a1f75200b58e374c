"""Where the device time of the fixed-shape path's slowest rows goes, for a GPU session's diagnosis: a one-token
step of the 8B-shaped model and an 8B-shaped EAGLE-3 head's level, each eager and on the path, under torch's
profiler (the kernels by device time). gpu_check.py's ``fixed`` rows say how long they take; this says why.

    python -m benchmarks.gpu_profile            # on a CUDA machine, in bf16
    python -m benchmarks.gpu_profile --smoke    # tiny shapes on the CPU, in fp32
"""

from __future__ import annotations

import argparse
from functools import partial
from typing import Callable

import torch
from torch.profiler import ProfilerActivity, profile as profiled

from graft_cli.core import Tree
from graft_cli.runtime.fixed_target import make_target

from benchmarks.gpu_fixed import first_level, head_drafter, random_head, verify_step
from benchmarks.gpu_setup import GPU, SMOKE, big_model, syncer

CALLS = 5  # profiled calls of each run, after as many to warm up


def runs(device: str, shape: dict, dtype: torch.dtype, past: int) -> dict[str, Callable[[], object]]:
    """The runs profiled, by name: a one-token step with graphs off and on, and a head level eager and fixed."""
    model = big_model(shape, device, dtype)
    out: dict[str, Callable[[], object]] = {}
    for switch in ("off", "on"):
        target = make_target(model, switch)
        target.prefill([i % shape["vocab_size"] for i in range(past)], capacity=past + 512)
        out[f"one-token step, graphs {switch}"] = partial(verify_step(target), Tree(), reset=True)
    head = random_head(model, 32000 if device.startswith("cuda") else shape["vocab_size"] // 2)
    for fixed in (False, True):
        head.reset(past + 4096)
        out[f"head level, fixed {fixed}"] = partial(first_level, head_drafter(model, head, fixed, past, 8), head)
    return out


def profile(device: str, shape: dict, dtype: torch.dtype, past: int = 512) -> None:
    """Print each run's device time a call and its kernels, the most device time first."""
    sync = syncer(device)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.startswith("cuda") else [])
    for name, run in runs(device, shape, dtype, past).items():
        with torch.inference_mode():
            for _ in range(CALLS):
                run()
            sync()
            with profiled(activities=activities) as prof:
                for _ in range(CALLS):
                    run()
                sync()
        averages = prof.key_averages()
        total = sum(e.self_device_time_total for e in averages) / CALLS / 1000
        print(f"== {name}: {total:.3f} ms of device time a call")
        print(averages.table(sort_by="self_device_time_total", row_limit=12, max_name_column_width=60))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU")
    args = parser.parse_args()
    scale = SMOKE if args.smoke else GPU
    profile("cpu" if args.smoke else "cuda", scale.latency_shape, torch.float32 if args.smoke else torch.bfloat16)


if __name__ == "__main__":
    main()
