"""What the captured path's first-use check costs, and that it catches a broken capture, on any machine: the
check (graft_cli/api/capture_check.py) run for each method over the fixed-shape target, captured by CUDA graphs
on a GPU and by the CPU stand-in elsewhere (graft_cli.bench.synthetic.ReplayCapture; ``--wrong-buffer``: its
broken variant, whose replays write buffers of their own). Nothing is kept: the verdicts are printed.

    python -m benchmarks.capture_check --threads 1                   # SmolLM2-135M, fp32, ar, pld and graft
    python -m benchmarks.capture_check --threads 1 --wrong-buffer    # every verdict must fail
"""

from __future__ import annotations

import argparse
import sys

import torch

from graft_cli.api.capture_check import check
from graft_cli.bench.synthetic import ReplayCapture
from graft_cli.catalog.entries import DEFAULT_MODEL
from graft_cli.method import builder as methods
from graft_cli.method.config import configure
from graft_cli.runtime.fixed_target import FixedShapeTarget
from graft_cli.runtime.graphs import CudaCapture
from graft_cli.runtime.loading import load_model


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--methods", default="ar,pld,graft")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--wrong-buffer", action="store_true", help="the broken stand-in (CPU only)")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    loaded = load_model(args.model, args.device, args.dtype)
    cuda = loaded.device.startswith("cuda")
    if cuda and args.wrong_buffer:
        parser.error("--wrong-buffer is the CPU stand-in's")
    failed = 0  # verdicts other than expected
    for method in args.methods.split(","):
        config = configure(method)
        target = FixedShapeTarget(loaded.model, capture=CudaCapture() if cuda else ReplayCapture(args.wrong_buffer))
        verdict = check(loaded, config, target, methods.build(config, loaded, target))
        failed += verdict.ok == args.wrong_buffer  # a broken capture must fail its check
        print(f"{method}: {'ok' if verdict.ok else 'FAILED'} in {verdict.seconds:.2f} s ({verdict.tokens} tokens "
              f"twice){'; ' + verdict.reason if verdict.reason else ''}{'; ties ' + str(verdict.ties) if verdict.ties else ''}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
