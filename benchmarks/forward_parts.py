"""Where one forward of graft's own model spends its time, by kind of work: the linear layers, graft's attention
kernel (where it serves) or attention's matrix products and softmax, copies and sums, and the rest (Python and
small operations), beside the floor this machine sets it. What holds a step, a tree and a long chunk above it.

    python -m benchmarks.forward_parts [--model smollm2-135m-instruct] [--dtype bfloat16] [--context 3500]
                                       [--shapes step,tree:7,chunk:512] [--threads N]

Each shape runs after ``--context`` cached tokens, rolled back after every call, as graft runs it on a free
machine (every operation on every thread): ``step`` one new token, ``tree:N`` N tokens as a binary tree under a
mask (graft's verification), ``chunk:N`` N prompt tokens. The wall time is the fastest of a few calls; the
parts are torch's profiler over one more call (its own cost spreads over the parts, so they add to a little more
than the wall time, and "the rest" is the wall time less the measured parts, never below zero). The floor: the
forward's multiply-adds at the rate of the fastest GEMM measured here (benchmarks/prefill.py's), or its weights and
cache read once at the rate of a plain sum, whichever takes longer.
"""

from __future__ import annotations

import argparse
import time

import torch
from torch.profiler import ProfilerActivity, profile, record_function

from graft_cli.core.cpu_units import cpu_units
from graft_cli.core.memory import reuse_freed_memory
from graft_cli.core.threads import available_cores
from graft_cli.models import decoder, invariant
from graft_cli.runtime.kv_cache import PositionCache
from graft_cli.runtime.loading import load_model

from benchmarks.prefill import gemm_ceiling, prefill_flops

KERNEL = "graft attention kernel"  # graft's C++ kernel, which torch's profiler sees only as marked
PARTS = {  # torch's operator names -> the kind of work they are
    "linear layers": ("mkldnn::_linear_pointwise", "aten::linear", "aten::addmm", "aten::mm"),
    "attention kernel": (KERNEL,),
    "attention products": ("aten::bmm", "aten::matmul"),
    "softmax": ("aten::_softmax",),
    "copies and sums": ("aten::copy_", "aten::add_", "aten::cumsum", "aten::constant_pad_nd", "aten::cat",
                        "aten::fill_", "aten::gather", "aten::masked_fill_"),
}


def mark_the_kernel() -> None:
    """Make graft's attention kernel, where it serves, visible to torch's profiler as ``KERNEL``."""
    kernel = invariant.attention_kernel()
    if kernel is None:
        return

    def marked(*args):
        with record_function(KERNEL):
            return kernel(*args)

    invariant.attention_kernel = lambda: marked


def stream_rate(megabytes: int = 512) -> float:
    """Bytes a second this machine reads through a plain sum of a large tensor: the bar for a forward that
    streams its weights (a step's products read every weight once for one row)."""
    data = torch.ones(megabytes * 2**20 // 4)
    best = float("inf")
    for _ in range(4):
        start = time.perf_counter()
        data.sum()
        best = min(best, time.perf_counter() - start)
    return data.numel() * 4 / best


def tree_mask(context: int, rows: int) -> dict:
    """A binary tree of ``rows`` nodes after ``context`` cached tokens, as graft's verification passes it."""
    parents = [-1] + [(row - 1) // 2 for row in range(1, rows)]
    seen = torch.zeros(rows, context + rows, dtype=torch.bool)
    seen[:, :context] = True
    depth = []
    for row in range(rows):
        node = row
        while node >= 0:
            seen[row, context + node] = True
            node = parents[node]
        depth.append(0 if parents[row] < 0 else depth[parents[row]] + 1)
    return {"position_ids": torch.tensor([[context + d for d in depth]]), "attention_mask": seen[None, None],
            "visible": context}


def multiply_adds(config, rows: int, keys: int, logits: int) -> float:
    """The multiply-adds of a forward's products: the layers' projections and MLPs over ``rows`` rows, the LM
    head over ``logits`` of them, and attention's two products over ``keys`` keys in all (each row's, summed)."""
    linear, _ = prefill_flops(config, rows)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    attention = 2 * keys * config.num_attention_heads * head_dim * config.num_hidden_layers
    return linear / 2 + logits * config.hidden_size * config.vocab_size + attention


def parts_of(model: torch.nn.Module, cache: PositionCache, ids: torch.Tensor, context: int,
             kwargs: dict) -> tuple[float, dict]:
    """The fastest wall time of a few calls, and the profiler's self time by part over one more."""
    def call() -> None:
        for layer in cache.layers:
            layer.filled = context
        model(input_ids=ids, cache=cache, **kwargs)

    best = float("inf")
    for i in range(6 if ids.shape[1] < 64 else 3):
        start = time.perf_counter()
        call()
        if i:
            best = min(best, time.perf_counter() - start)
    with profile(activities=[ProfilerActivity.CPU]) as run:
        call()
    seconds = {part: 0.0 for part in PARTS}
    for event in run.key_averages():
        for part, names in PARTS.items():
            if event.key in names:
                seconds[part] += event.self_cpu_time_total / 1e6
    seconds["the rest"] = max(0.0, best - sum(seconds.values()))
    return best, seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--context", type=int, default=3500)
    parser.add_argument("--shapes", default="step,tree:7,chunk:512")
    parser.add_argument("--threads", type=int, default=0, help="torch's threads (0: the cores graft may use)")
    args = parser.parse_args()
    reuse_freed_memory()
    torch.set_num_threads(args.threads or available_cores())
    decoder.crowded = lambda now: False  # as on a free machine: every operation on every thread
    mark_the_kernel()
    model = load_model(args.model, device="cpu", dtype=args.dtype, forward="own").model
    dtype = next(model.parameters()).dtype
    config = model.config
    with torch.inference_mode():
        rate, stream = gemm_ceiling(model, rows=512, dtype=dtype) / 2, stream_rate()
    shapes = [(s.split(":")[0], int(s.split(":")[1]) if ":" in s else 1) for s in args.shapes.split(",")]
    most = max(rows for _, rows in shapes)
    cache = PositionCache(len(model.model.layers))
    cache.reserve(args.context + most)
    ids = torch.randint(0, model.config.vocab_size, (1, args.context + most),
                        generator=torch.Generator().manual_seed(0))
    weights = multiply_adds(config, 1, 0, 1) * dtype.itemsize  # a row's products read each weight once
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    kv = config.num_hidden_layers * 2 * config.num_key_value_heads * head_dim * dtype.itemsize  # a cached token's
    print(f"{args.model} {args.dtype}, {args.context} cached tokens, {torch.get_num_threads()} threads, "
          f"{cpu_units().summary()}; its fastest {dtype} GEMM runs {rate / 1e9:.0f} G multiply-adds/s, a sum "
          f"reads {stream / 1e9:.1f} GB/s")
    print("| shape | wall | " + " | ".join(PARTS) + " | the rest | floor |")
    print("|---|---|" + "---|" * (len(PARTS) + 2))
    with torch.inference_mode():
        model(input_ids=ids[:, : args.context], cache=cache)
        for kind, rows in shapes:
            if kind == "tree":  # every row's logits, as verification reads them
                kwargs, logits = tree_mask(args.context, rows), rows
                keys = int(kwargs["attention_mask"].sum())
            else:  # a prompt's chunk keeps its last row's logits; a step has one
                kwargs, logits = {"logits_to_keep": 1}, 1
                keys = rows * args.context + rows * (rows + 1) // 2
            best, seconds = parts_of(model, cache, ids[:, args.context : args.context + rows], args.context, kwargs)
            # the products at the GEMM's rate, or the weights and the cache read once at the sum's, whichever is more
            floor = max(multiply_adds(config, rows, keys, logits) / rate, (weights + args.context * kv) / stream)
            cells = " | ".join(f"{s * 1e3:.1f} ms ({s / best:.0%})" for s in seconds.values())
            print(f"| {kind} of {rows} | {best * 1e3:.1f} ms | {cells} | {floor * 1e3:.1f} ms |", flush=True)


if __name__ == "__main__":
    main()
