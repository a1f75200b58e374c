"""Long-context benchmarks from real text found on every machine: Python standard-library modules.

``datasets`` writes bench datasets (the JSONL ``graft bench --dataset`` reads): "explain this module and list its
public functions" over a module's source cut to about 2K, 4K and 8K tokens of the model's chat-templated prompt.
The 8K set stays inside SmolLM2's 8192 positions with 256 new tokens and a CPU tree (``graft_cli/runtime/limits.py``).

``prefill`` times the prefill of one context for several chunk sizes. ``steps`` times one verification step (a tree of ``--tree`` nodes, then compaction to an accepted path of
``--accept`` rows) after prefilling contexts of several lengths, and the prefill itself. It uses only the Target
API every version of graft has, so the same script measures two checkouts side by side (``PYTHONPATH``).

    python -m benchmarks.long_context datasets --out /tmp/long-context
    python -m benchmarks.long_context steps --contexts 512,2048,4096,7900 --threads 1
    python -m benchmarks.long_context prefill --context 4096 --chunks 256,512,1024,4096 [--bound]
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import inspect
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from graft_cli.runtime.loading import encode, load_model
from graft_cli.runtime.target import Target
from graft_cli.core import ROOT, Tree

MODULES = ("argparse", "difflib", "configparser", "calendar", "inspect", "tarfile", "typing", "pathlib")
SIZES = {"2k": 2048, "4k": 4096, "8k": 7800}  # 8k: 7800 + 256 new tokens + a 16-node tree < 8192 positions
ASK = "Explain what this module does and list its public functions.\n\n```python\n{}\n```"


def module_source(name: str) -> list[str]:
    return inspect.getsource(importlib.import_module(name)).splitlines()


def cut(tokenizer, lines: list[str], tokens: int) -> tuple[str, int]:
    """The prompt over the longest prefix of ``lines`` whose templated prompt has at most ``tokens`` tokens."""
    lo, hi = 1, len(lines)
    while lo < hi:  # binary search on the line count
        mid = (lo + hi + 1) // 2
        if len(encode(tokenizer, ASK.format("\n".join(lines[:mid])))) <= tokens:
            lo = mid
        else:
            hi = mid - 1
    prompt = ASK.format("\n".join(lines[:lo]))
    return prompt, len(encode(tokenizer, prompt))


def write_atomically(path: Path, text: str) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        f.write(text)
    os.replace(tmp, path)


def datasets(args) -> None:
    tokenizer = load_model(args.model, device="cpu").tokenizer
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    sources = {name: module_source(name) for name in MODULES}
    sizes = dict(SIZES) if not args.sizes else {
        label: int(n) for label, n in (item.split("=") for item in args.sizes.split(","))}
    for label, tokens in sizes.items():
        records = []
        for name, lines in sources.items():
            prompt, length = cut(tokenizer, lines, tokens)
            if length < 0.9 * tokens:  # the module is too short for this size
                continue
            records.append({"question_id": f"{name}-{label}", "category": f"long-{label}", "turns": [prompt]})
            print(f"{label} {name}: {length} tokens")
        write_atomically(out / f"long-context-{label}.jsonl", "".join(json.dumps(r) + "\n" for r in records))
        print(f"wrote {out / f'long-context-{label}.jsonl'} ({len(records)} prompts)")


def path_tree(tokens: list[int], size: int) -> Tree:
    """A chain of half the nodes along ``tokens`` and a sibling branch at each of its levels (a draft's shape)."""
    tree, parent = Tree(), ROOT
    for depth in range(size // 2):
        parent = tree.add(parent, tokens[depth], "bench", 0.9)
        tree.add(ROOT if depth == 0 else tree.nodes[parent].parent, tokens[depth] + 1, "bench", 0.1)
    while len(tree) < size:
        tree.add(ROOT, tokens[len(tree)] + 2, "bench", 0.05)
    return tree


def steps(args) -> None:
    torch.set_num_threads(args.threads)
    loaded = load_model(args.model, device="cpu")
    text = "\n".join(line for name in MODULES for line in module_source(name))
    ids = encode(loaded.tokenizer, ASK.format(text), raw=True)
    print(f"graft from {Path(inspect.getsourcefile(Target)).parents[1]}")
    for context in [int(c) for c in args.contexts.split(",")]:
        target = Target(loaded.model)
        t0 = time.perf_counter()
        target.prefill(ids[:context])
        prefill = time.perf_counter() - t0
        times, at = [], context
        for step in range(args.steps + 1):  # the first step warms up
            tree = path_tree(ids[at + 1 : at + 1 + args.tree], args.tree)
            t0 = time.perf_counter()
            target.verify(ids[at], tree)
            chain = [i + 1 for i, node in enumerate(tree.nodes) if node.score == 0.9][: args.accept - 1]
            target.keep([0, *chain], args.tree + 1)  # the root and an accepted path that is not a prefix
            if step:
                times.append(time.perf_counter() - t0)
            at += len(chain) + 1
        print(f"context {context:5d}: prefill {prefill:6.2f} s ({context / prefill:6.0f} tok/s), verify+keep of "
              f"{args.tree} nodes {statistics.median(times) * 1000:7.2f} ms (median of {args.steps})", flush=True)


def ab(args) -> None:
    """This checkout's step against another checkout's (``--before DIR``), alternated in one process on the same
    cache contents: the before side gets a copy of the after side's prefilled cache, so one prefill serves both."""
    spec = importlib.util.spec_from_file_location("before_target", Path(args.before) / "graft_cli" / "target.py")
    before_module = sys.modules["before_target"] = importlib.util.module_from_spec(spec)  # dataclasses look it up
    spec.loader.exec_module(before_module)
    torch.set_num_threads(args.threads)
    loaded = load_model(args.model, device="cpu")
    text = "\n".join(line for name in MODULES for line in module_source(name))
    ids = encode(loaded.tokenizer, ASK.format(text), raw=True)
    for context in [int(c) for c in args.contexts.split(",")]:
        after, before = Target(loaded.model), before_module.Target(loaded.model)
        if args.prefill:  # each side prefills its own cache, timed
            seconds = {}
            for name, target in (("before", before), ("after", after)):
                t0 = time.perf_counter()
                target.prefill(ids[:context])
                seconds[name] = time.perf_counter() - t0
            print(f"context {context:5d}: prefill: before {context / seconds['before']:5.0f} tok/s, after "
                  f"{context / seconds['after']:5.0f} tok/s, after/before time {seconds['after'] / seconds['before']:.3f}",
                  flush=True)
        else:
            after.prefill(ids[:context])
            for i, layer in enumerate(after.cache.layers):
                before.cache.update(layer.keys[:, :, :context].clone(), layer.values[:, :, :context].clone(), i)
            before.length = context
        times: dict[str, list[float]] = {"before": [], "after": []}
        at = context
        for step in range(args.steps + 1):  # the first round warms up
            tree = path_tree(ids[at + 1 : at + 1 + args.tree], args.tree)
            chain = [i + 1 for i, node in enumerate(tree.nodes) if node.score == 0.9][: args.accept - 1]
            for name, target in (("before", before), ("after", after)):
                t0 = time.perf_counter()
                target.verify(ids[at], tree)
                target.keep([0, *chain], args.tree + 1)
                if step:
                    times[name].append(time.perf_counter() - t0)
            at += len(chain) + 1
        b, a = (statistics.median(times[n]) * 1000 for n in ("before", "after"))
        print(f"context {context:5d}: verify+keep of {args.tree} nodes: before {b:7.2f} ms, after {a:7.2f} ms, "
              f"after/before {a / b:.3f} (medians of {args.steps}, alternated)", flush=True)


def prefill(args) -> None:
    """Prefill tokens/s at one context for several chunk sizes (this checkout's Target only); with ``--bound``,
    also the most any fp32 kernel could give on this CPU."""
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


def gemm_ceiling(model: torch.nn.Module, rows: int, repeats: int = 7) -> float:
    """The best fp32 FLOP/s on this CPU of the model's own linear layers (graft's packed oneDNN path, over
    ``rows`` rows) and of ``torch.mm`` on a large square: an upper bound for every kernel of the prefill,
    attention included."""
    calls = {}
    for module in model.modules():
        if isinstance(module, torch.nn.Linear) and module.out_features < 16384:  # not the LM head (one row)
            x = torch.randn(rows, module.in_features)
            calls.setdefault((module.in_features, module.out_features), (module, x, 2.0 * rows * module.weight.numel()))
    a = torch.randn(2048, 2048)
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
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    model = argparse.ArgumentParser(add_help=False)
    model.add_argument("--model", default="smollm2-135m-instruct")
    timed = argparse.ArgumentParser(add_help=False, parents=[model])
    timed.add_argument("--threads", type=int, default=1)
    stepped = argparse.ArgumentParser(add_help=False, parents=[timed])
    stepped.add_argument("--contexts", default="512,2048,4096,7900")
    stepped.add_argument("--tree", type=int, default=16)
    stepped.add_argument("--accept", type=int, default=3)
    stepped.add_argument("--steps", type=int, default=10)
    p = sub.add_parser("datasets", parents=[model], help="write long-context bench datasets")
    p.add_argument("--out", default="long-context")
    p.add_argument("--sizes", default="", help="LABEL=TOKENS,... instead of 2k, 4k and 8k (e.g. 16k=16000 for a "
                   "model with a longer window)")
    sub.add_parser("steps", parents=[stepped], help="time verification steps at several context lengths")
    p = sub.add_parser("ab", parents=[stepped], help="this checkout's step against another's, alternated in one "
                   "process")
    p.add_argument("--before", required=True)
    p.add_argument("--prefill", action="store_true", help="also time each side's own prefill")
    p = sub.add_parser("prefill", parents=[timed], help="prefill tokens/s for several chunk sizes")
    p.add_argument("--context", type=int, default=4096)
    p.add_argument("--chunks", default="256,512,1024,4096")
    p.add_argument("--bound", action="store_true", help="also print the fp32 ceiling: the prefill's FLOPs at this "
                   "CPU's fastest matmul rate")
    args = parser.parse_args()
    {"datasets": datasets, "steps": steps, "ab": ab, "prefill": prefill}[args.command](args)


if __name__ == "__main__":
    main()
