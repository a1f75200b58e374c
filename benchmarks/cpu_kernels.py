"""What graft's CPU kernels (graft_cli/cpu_linear.py and SDPA's own grouped-query attention) change: the cost of
one verification forward against the tokens it feeds, relative to a one-token forward, with PyTorch's default
kernels and with graft's, measured in one process on the same model.

    python benchmarks/cpu_kernels.py --model smollm2-135m-instruct --context 1700
    python benchmarks/cpu_kernels.py --model qwen2.5-coder-0.5b-instruct --context 300
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from statistics import median

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from graft_cli.cpu_linear import use_cpu_linears  # noqa: E402
from graft_cli.loading import load_model  # noqa: E402
from graft_cli.profile import measure  # noqa: E402


def kernels(model: torch.nn.Module, on: bool) -> None:
    os.environ["TRANSFORMERS_SDPA_FORCE_GQA"] = "1" if on else "0"
    for module in model.modules():
        if isinstance(module, torch.nn.Linear):
            module.__class__ = torch.nn.Linear
    if on:
        use_cpu_linears(model)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--context", type=int, default=1700, help="tokens in the KV cache")
    parser.add_argument("--sizes", default="1,2,3,4,6,8,12,16,24,32", help="tokens fed per forward")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    sizes = [int(s) for s in args.sizes.split(",")]
    model = load_model(args.model, "cpu", "float32").model
    rows = {}
    for label, on in (("pytorch", False), ("graft", True), ("pytorch ", False), ("graft ", True)):
        kernels(model, on)
        times = measure(model, sizes, args.context, args.repeats)
        rows[label] = {n: median(t) for n, t in times.items()}
    print(f"{args.model}, {args.context}-token cache, {args.threads} thread(s): forward time / one-token forward")
    print("kernels  | 1 token (ms) | " + " | ".join(str(n) for n in sizes[1:]))
    for label, row in rows.items():
        base = row[sizes[0]]
        print(f"{label:8s} | {base * 1000:12.1f} | " + " | ".join(f"{row[n] / base:.2f}" for n in sizes[1:]))


if __name__ == "__main__":
    main()
