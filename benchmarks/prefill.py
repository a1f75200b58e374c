"""Prefill tokens/s of one long context for several chunk sizes (this checkout's Target), and with ``--bound`` the
most any fp32 kernel could give on this CPU: the prefill's FLOPs at the fastest matmul rate measured here, so a
chunk size is judged against a ceiling and not only against another chunk size.

    python -m benchmarks.prefill --context 4096 --chunks 256,512,1024,4096 [--bound] [--threads 1]
"""

from __future__ import annotations

import argparse
import time

import torch

from graft_cli.runtime.loading import encode, load_model
from graft_cli.runtime.target import Target

from benchmarks.long_context import ASK, module_source


def prefill(args: argparse.Namespace) -> None:
    """Time the prefill at each chunk size; with ``--bound``, print the ceiling beside the best of them."""
    torch.set_num_threads(args.threads)
    loaded = load_model(args.model, device="cpu")
    ids = encode(loaded.tokenizer, ASK.format("\n".join(module_source("argparse"))), raw=True)[: args.context]
    best = 0.0
    for chunk in [int(c) for c in args.chunks.split(",")]:
        target = Target(loaded.model, chunk=chunk)
        t0 = time.perf_counter()
        target.prefill(ids)
        seconds = time.perf_counter() - t0
        best = max(best, len(ids) / seconds)
        print(f"context {len(ids)}, chunk {chunk:5d}: {seconds:6.2f} s ({len(ids) / seconds:5.0f} tok/s)", flush=True)
    if args.bound:
        config = loaded.model.config
        linear, attention = prefill_flops(config, len(ids))
        rate = gemm_ceiling(loaded.model, max(int(c) for c in args.chunks.split(",")))
        ceiling = len(ids) / ((linear + attention) / rate)
        print(f"prefill of {len(ids)} tokens: {linear / 1e9:.0f} GFLOP of linears + {attention / 1e9:.0f} GFLOP of "
              f"causal attention; the fastest fp32 matmul here: {rate / 1e9:.1f} GFLOP/s; so at most "
              f"{ceiling:.0f} tok/s, {ceiling / best:.2f}x the best measured above", flush=True)


def prefill_flops(config, tokens: int) -> tuple[float, float]:
    """The multiply-adds (x2) a prefill cannot skip: every layer's projections and MLP for every token (the LM head
    runs for the last one only), and causal attention (QK and PV over the n(n+1)/2 visible pairs of each head)."""
    hidden, heads = config.hidden_size, config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or hidden // heads
    kv = getattr(config, "num_key_value_heads", None) or heads
    per_layer = hidden * head_dim * (2 * heads + 2 * kv) + 3 * hidden * config.intermediate_size
    layers = config.num_hidden_layers
    linear = 2.0 * per_layer * layers * tokens
    attention = 2.0 * 2 * head_dim * heads * layers * tokens * (tokens + 1) / 2
    return linear, attention


def gemm_ceiling(model: torch.nn.Module, rows: int, repeats: int = 7, dtype: torch.dtype = torch.float32) -> float:
    """The best FLOP/s on this CPU in ``dtype`` (the model's) of its own linear layers (graft's packed oneDNN path,
    over ``rows`` rows) and of ``torch.mm`` on a large square: an upper bound for every kernel of the prefill,
    attention included."""
    calls = {}
    for module in model.modules():
        if isinstance(module, torch.nn.Linear) and module.out_features < 16384:  # not the LM head (one row)
            x = torch.randn(rows, module.in_features).to(dtype)
            calls.setdefault((module.in_features, module.out_features), (module, x, 2.0 * rows * module.weight.numel()))
    a = torch.randn(2048, 2048).to(dtype)
    calls["square"] = (lambda m: torch.mm(m, m), a, 2.0 * 2048**3)
    best = 0.0
    with torch.inference_mode():
        for call, x, flops in calls.values():
            call(x)
            for _ in range(repeats):
                t0 = time.perf_counter()
                call(x)
                best = max(best, flops / (time.perf_counter() - t0))
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--context", type=int, default=4096)
    parser.add_argument("--chunks", default="256,512,1024,4096")
    parser.add_argument("--bound", action="store_true", help="also print the fp32 ceiling: the prefill's FLOPs at "
                        "this CPU's fastest matmul rate")
    prefill(parser.parse_args())


if __name__ == "__main__":
    main()
