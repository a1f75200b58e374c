"""The CPU's precision modes end to end on long prompts: ``ar`` and ``graft`` in fp32, in the mixed mode (a prompt's
linear layers in bf16, every step in fp32) and wholly in bf16, side by side in one process on one thread, graft's
own forward, the prefix cache off.

    python -m benchmarks.precision_modes [--size 4k] [--prompts 3] [-n 128] [--threads 1] [--out FILE]

The prompts are benchmarks/long_context.py's (standard-library modules cut to the size's tokens). Each prompt goes
to the six runs in turn, so a machine whose speed drifts slows them alike. Per run: the prefill's seconds (time to
the first token), decoding's tokens per second after it, and new tokens per second end to end; per mode, graft's
ratio to ``ar`` in the same mode and on how many prompts their tokens are the same (the mode's contract; in bf16
up to floating-point ties, which ``graft bench --dtype bfloat16`` lists with their margins); and each lower
precision's times against fp32's.
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from benchmarks.long_context import MODULES, SIZES, cut, module_source
from datastores.atomic import write_text_atomic

MODES = ("float32", "mixed", "bfloat16")
METHODS = ("ar", "graft")


def timed(generator, prompt: str, tokens: int) -> dict:
    """One greedy request streamed: wall seconds to its first piece and in all, and its tokens."""
    started = time.perf_counter()
    first = None
    stream = generator.stream(prompt, max_new_tokens=tokens)
    for _ in stream:
        first = first or time.perf_counter() - started
    wall = time.perf_counter() - started
    return dict(ttft=first or wall, wall=wall, ids=stream.completion.token_ids)


def summary(runs: list[dict]) -> dict:
    new = sum(len(r["ids"]) for r in runs)
    prefill, wall = sum(r["ttft"] for r in runs), sum(r["wall"] for r in runs)
    return dict(prefill_s=round(prefill / len(runs), 2), decode_tok_s=round(new / max(wall - prefill, 1e-9), 2),
                tok_s=round(new / wall, 2), new_tokens=new)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--size", default="4k", choices=sorted(SIZES))
    parser.add_argument("--prompts", type=int, default=3)
    parser.add_argument("-n", type=int, default=128)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out")
    args = parser.parse_args()
    from graft_cli.api import Generator
    from graft_cli.core.cpu_units import cpu_units
    from graft_cli.method.config import configure
    from graft_cli.runtime.loading import load_model

    torch.set_num_threads(args.threads)
    loaded = {mode: load_model(args.model, "cpu", mode, forward="own") for mode in MODES}
    generators = {(mode, method): Generator(loaded[mode], configure(method), prefix_cache=0)
                  for mode in MODES for method in METHODS}
    tokenizer = loaded["float32"].tokenizer
    prompts = [cut(tokenizer, module_source(name), SIZES[args.size])[0] for name in MODULES[: args.prompts]]
    for g in generators.values():  # warm-up: first-call costs are no mode's
        g.generate("Hello", max_new_tokens=4)
    done: dict[tuple[str, str], list[dict]] = {key: [] for key in generators}
    for i, prompt in enumerate(prompts):
        for key, g in generators.items():
            done[key].append(timed(g, prompt, args.n))
            print(f"prompt {i + 1}/{len(prompts)} {key[0]} {key[1]}: {done[key][-1]['wall']:.1f} s", flush=True)
    out: dict = {"cpu": cpu_units().summary(), "threads": args.threads, "size": args.size, "prompts": len(prompts),
                 "new_tokens": args.n}
    for mode in MODES:
        rows = {method: summary(done[mode, method]) for method in METHODS}
        rows["graft vs ar"] = round(rows["graft"]["tok_s"] / rows["ar"]["tok_s"], 2)
        same = sum(a["ids"] == g["ids"] for a, g in zip(done[mode, "ar"], done[mode, "graft"]))
        rows["same tokens"] = f"{same}/{len(prompts)}"
        out[mode] = rows
    for mode in MODES[1:]:
        out[f"{mode} prefill vs float32"] = round(out[mode]["ar"]["prefill_s"] / out["float32"]["ar"]["prefill_s"], 2)
        out[f"{mode} graft vs float32 ar"] = round(out[mode]["graft"]["tok_s"] / out["float32"]["ar"]["tok_s"], 2)
    text = json.dumps(out, indent=1)
    print(text)
    if args.out:
        write_text_atomic(args.out, text + "\n")


if __name__ == "__main__":
    main()
