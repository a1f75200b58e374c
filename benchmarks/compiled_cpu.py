"""The compiled path on a CPU, per region: a real model's fixed-shape step (verification, acceptance and the one
read) of 1 and 16 tokens, uncompiled and compiled by inductor (C++ through gcc), side by side in one process, and
what the compilation cost. What decides ``--graphs auto``'s CPU default (graft_cli/core/defaults.py).

    python -m benchmarks.compiled_cpu --threads 1               # SmolLM2-135M-Instruct, fp32
    python -m benchmarks.compiled_cpu --model qwen2.5-coder-0.5b-instruct --repeats 20
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch

from graft_cli.bench.synthetic import random_tree
from graft_cli.core import Tree
from graft_cli.runtime.loading import load_model

from benchmarks.gpu_fixed import compile_note, fixed_target, verify_step
from benchmarks.gpu_setup import syncer, timed

SIZES = (1, 16)  # tokens a step verifies, root included (plain decoding, a CPU's usual tree)


def measure(model: torch.nn.Module, past: int, repeats: int) -> None:
    """Print ms per step of each size, uncompiled then compiled, and the compiled path's first calls' seconds."""
    rng, vocab = np.random.default_rng(0), model.config.vocab_size
    prompt = rng.integers(0, vocab, past).tolist()
    print(f"| path | {' | '.join(f'step of {size} ms' for size in SIZES)} | first calls s |\n|---|---|---|---|")
    for switch in ("on", "compiled"):
        target = fixed_target(model, switch, "inductor")
        target.prefill(prompt, capacity=past + 256)
        step = verify_step(target)
        trees = {size: Tree() if size == 1 else random_tree(size - 1, vocab, rng) for size in SIZES}
        started = time.perf_counter()
        for tree in trees.values():  # the first call of each compiles
            step(tree, reset=True)
        first = time.perf_counter() - started
        ms = [timed(lambda: step(trees[size], reset=True), syncer("cpu"), repeats) for size in SIZES]
        name = "fixed shapes, uncompiled" if switch == "on" else f"compiled{compile_note(target)}"
        print(f"| {name} | {' | '.join(f'{m:.1f}' for m in ms)} | {first:.1f} |", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--past", type=int, default=256, help="prompt tokens in the cache")
    parser.add_argument("--repeats", type=int, default=10)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    measure(load_model(args.model, device="cpu").model, args.past, args.repeats)


if __name__ == "__main__":
    main()
