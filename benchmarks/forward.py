"""graft's own forward against transformers' modules: plain decoding (``ar``) and ``graft`` on one thread, side by
side in one process, with the tokens each gives.

    python -m benchmarks.forward [--model smollm2-135m-instruct] [-n 128] [--repeats 3] [--dtype float32]

Each (forward, method) pair is loaded once, warmed up, then the pairs take turns over ``--repeats`` rounds, each
keeping its fastest round (a shared machine only ever adds time). Figures are new tokens per second of wall time
and of the process's CPU time (which other work on the machine inflates less), prefill included, on Spec-Bench-like
questions. Each row says whether its tokens are its own forward's plain decoding's (the contract; in bf16 a tree
may part from it at a floating-point tie) and transformers' plain decoding's.
"""

from __future__ import annotations

import argparse
import os
import time

PROMPTS = (
    "Write a Python function that reads a JSON file and returns the number of keys at its top level.",
    "Summarize in three sentences why the sky is blue.",
    "Explain what a hash map is and when it is slower than a sorted list.",
)


def timed(generator, n: int) -> tuple[float, float, list[list[int]]]:
    """Wall and CPU seconds for every prompt's answer, and the answers' tokens."""
    wall, cpu = time.perf_counter(), time.process_time()
    answers = [generator.generate(p, max_new_tokens=n).token_ids for p in PROMPTS]
    return time.perf_counter() - wall, time.process_time() - cpu, answers


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("-n", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dtype", default="float32")
    args = parser.parse_args()
    import graft_cli

    pairs = {(forward, method): graft_cli.load(args.model, method=method, device="cpu", dtype=args.dtype, threads=1,
                                               forward=forward)
             for forward in ("transformers", "own") for method in ("ar", "graft")}
    for generator in pairs.values():
        generator.generate(PROMPTS[0], max_new_tokens=8)
    best: dict = {}
    for _ in range(args.repeats):
        for pair, generator in pairs.items():
            wall, cpu, answers = timed(generator, args.n)
            tokens = sum(map(len, answers))
            held = best.get(pair)
            best[pair] = (max(held[0], tokens / wall) if held else tokens / wall,
                          max(held[1], tokens / cpu) if held else tokens / cpu, answers)
    print(f"{args.model} {args.dtype}, 1 thread, load average {os.getloadavg()[0]:.2f} on {os.cpu_count()} cores")
    reference = best[("transformers", "ar")]
    for (forward, method), (wall, cpu, answers) in best.items():
        plain = best[(forward, "ar")][2]  # the contract: a method gives its own forward's plain decoding
        same = ("=" if answers == plain else "!=") + f" {forward} ar, " + ("=" if answers == reference[2] else "!=")
        print(f"{forward:<13} {method:<6} {wall:7.1f} tok/s wall {cpu:7.1f} tok/s CPU  "
              f"x{cpu / reference[1]:.2f} CPU vs transformers ar  tokens {same} transformers ar")


if __name__ == "__main__":
    main()
