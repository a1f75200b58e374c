"""One forward of graft's own model by its rows, on one thread and on all of them: as graft runs it on a free
machine (every operation on every thread) and on a crowded one (its operations on one thread, the products that
pay on all: graft_cli/core/threads.py), side by side in one process.

    python -m benchmarks.forward_threads [--model smollm2-135m-instruct] [--dtype bfloat16] [--rows 1,16,64,512]
                                         [--context 200] [--repeats 2] [--linears]

It runs as graft runs (OpenMP's threads spinning briefly as they wait, which the package sets before torch is
imported). Each row is a forward of that many new tokens after ``--context`` cached ones, rolled back after every
call; the three ways take turns ``--repeats`` times, each keeping its fastest time. All three give the same bits
(checked). ``--linears``: also the model's linear layers alone over each row count, on one thread (what the rest
of a forward costs is the difference).
"""

from __future__ import annotations

import argparse
import os
import time

import torch

from graft_cli.core.cpu_units import cpu_units
from graft_cli.core.threads import available_cores
from graft_cli.models import decoder
from graft_cli.runtime.kv_cache import PositionCache
from graft_cli.runtime.loading import load_model

WAYS = {"1 thread": (1, True), "all, crowded": (0, True), "all, free": (0, False)}  # threads (0: all), crowded


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--rows", default="1,16,64,512")
    parser.add_argument("--context", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--linears", action="store_true")
    args = parser.parse_args()
    cores = available_cores()
    model = load_model(args.model, device="cpu", dtype=args.dtype, forward="own").model
    rows = [int(r) for r in args.rows.split(",")]
    cache = PositionCache(len(model.model.layers))
    cache.reserve(args.context + max(rows))
    ids = torch.randint(0, model.config.vocab_size, (1, args.context + max(rows)),
                        generator=torch.Generator().manual_seed(0))
    print(f"{args.model} {args.dtype}, {args.context} cached tokens, {cores} cores, {cpu_units().summary()}, "
          f"GOMP_SPINCOUNT={os.environ.get('GOMP_SPINCOUNT')}, OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY')}")
    print("| rows | " + " | ".join(WAYS) + " | crowded against free | same bits |")
    print("|---|" + "---|" * (len(WAYS) + 2))
    with torch.inference_mode():
        model(input_ids=ids[:, : args.context], cache=cache)
        for n in rows:
            best, logits = {}, {}
            for _ in range(args.repeats):
                for way, (threads, crowd) in WAYS.items():
                    torch.set_num_threads(threads or cores)
                    decoder.crowded = lambda now, crowd=crowd: crowd
                    logits[way], seconds = timed(model, cache, ids[:, args.context : args.context + n], args.context)
                    best[way] = min(best.get(way, seconds), seconds)
            same = all(torch.equal(t, logits["1 thread"]) for t in logits.values())
            ratio = best["all, crowded"] / best["all, free"]
            print(f"| {n} | " + " | ".join(f"{best[w] * 1e3:.1f} ms" for w in WAYS) + f" | {ratio:.2f}x | {same} |")
        if args.linears:
            torch.set_num_threads(1)
            for n in rows:
                print(f"{n} rows: the linear layers alone {linears_alone(model, n) * 1e3:.1f} ms on one thread")


def linears_alone(model: torch.nn.Module, rows: int) -> float:
    """Seconds of every linear layer of ``model`` over ``rows`` rows once, the fastest of 5 rounds."""
    layers = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    dtype = next(model.parameters()).dtype
    inputs = [torch.randn(1, rows, layer.in_features).to(dtype) for layer in layers]
    best = float("inf")
    for _ in range(6):
        start = time.perf_counter()
        for layer, x in zip(layers, inputs):
            layer(x)
        best = min(best, time.perf_counter() - start)
    return best


def timed(model: torch.nn.Module, cache: PositionCache, new: torch.Tensor, context: int) -> tuple[torch.Tensor, float]:
    """The logits of a forward of ``new`` after ``context`` cached rows, and its fastest of a few timings."""
    calls = 10 if new.shape[1] < 64 else 3
    best, logits = float("inf"), None
    for _ in range(calls + 1):  # the first call warms the way up
        for layer in cache.layers:
            layer.filled = context
        start = time.perf_counter()
        logits = model(input_ids=new, cache=cache).logits
        best = min(best, time.perf_counter() - start)
    return logits, best


if __name__ == "__main__":
    main()
