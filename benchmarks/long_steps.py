"""A verification step's time by context length: after prefilling contexts of several lengths (standard-library
source, long_context.py's text), a tree of ``--tree`` nodes verified and the cache compacted to an accepted path
of ``--accept`` rows that is not a prefix, as decoding does; the prefill's own rate beside it.

With ``--before DIR`` another checkout's step is timed against this one's, alternated in one process on the same
cache contents: the other checkout's ``Target`` is loaded from its file on top of this checkout's modules, and
gets a copy of this side's prefilled cache (``--prefill``: each side prefills its own, timed). It uses only the
Target API every version of graft has.

    python -m benchmarks.long_steps --contexts 512,2048,4096,7900 --threads 1
    python -m benchmarks.long_steps --before ../graft-old [--prefill]
"""

from __future__ import annotations

import argparse
import importlib.util
import inspect
import statistics
import sys
import time
from pathlib import Path

import torch

from graft_cli.core import ROOT, Tree
from graft_cli.runtime.loading import encode, load_model
from graft_cli.runtime.target import Target

from benchmarks.long_context import ASK, MODULES, module_source

TARGET_FILES = ("graft_cli/runtime/target.py", "graft_cli/target.py")  # where Target lived, newest layout first


def path_tree(tokens: list[int], size: int) -> Tree:
    """A chain of half the nodes along ``tokens`` and a sibling branch at each of its levels (a draft's shape)."""
    tree, parent = Tree(), ROOT
    for depth in range(size // 2):
        parent = tree.add(parent, tokens[depth], "bench", 0.9)
        tree.add(ROOT if depth == 0 else tree.nodes[parent].parent, tokens[depth] + 1, "bench", 0.1)
    while len(tree) < size:
        tree.add(ROOT, tokens[len(tree)] + 2, "bench", 0.05)
    return tree


def drafted(ids: list[int], at: int, args: argparse.Namespace) -> tuple[Tree, list[int]]:
    """The tree fed after position ``at`` and the rows of it accepted: along its chain, so not a prefix."""
    tree = path_tree(ids[at + 1 : at + 1 + args.tree], args.tree)
    return tree, [i + 1 for i, node in enumerate(tree.nodes) if node.score == 0.9][: args.accept - 1]


def timed_step(target: Target, token: int, tree: Tree, chain: list[int]) -> float:
    """Seconds of one verification of ``tree`` after ``token`` and the compaction to the root and ``chain``."""
    t0 = time.perf_counter()
    target.verify(token, tree)
    target.keep([0, *chain], len(tree) + 1)
    return time.perf_counter() - t0


def long_ids(args: argparse.Namespace) -> tuple[torch.nn.Module, list[int]]:
    """The model, and every module's source as one prompt's ids (raw: no chat template)."""
    torch.set_num_threads(args.threads)
    loaded = load_model(args.model, device="cpu")
    text = "\n".join(line for name in MODULES for line in module_source(name))
    return loaded.model, encode(loaded.tokenizer, ASK.format(text), raw=True)


def steps(args: argparse.Namespace) -> None:
    """This checkout's prefill rate and median step at each context."""
    model, ids = long_ids(args)
    print(f"graft from {Path(inspect.getsourcefile(Target)).parents[1]}")
    for context in [int(c) for c in args.contexts.split(",")]:
        target = Target(model)
        t0 = time.perf_counter()
        target.prefill(ids[:context])
        prefill = time.perf_counter() - t0
        times, at = [], context
        for step in range(args.steps + 1):  # the first step warms up
            tree, chain = drafted(ids, at, args)
            seconds = timed_step(target, ids[at], tree, chain)
            if step:
                times.append(seconds)
            at += len(chain) + 1
        print(f"context {context:5d}: prefill {prefill:6.2f} s ({context / prefill:6.0f} tok/s), verify+keep of "
              f"{args.tree} nodes {statistics.median(times) * 1000:7.2f} ms (median of {args.steps})", flush=True)


def before_target(checkout: Path) -> type:
    """The ``Target`` class of another checkout, from its own file (the rest of graft is this checkout's)."""
    path = next((checkout / f for f in TARGET_FILES if (checkout / f).is_file()), None)
    if path is None:
        raise SystemExit(f"no {' or '.join(TARGET_FILES)} under {checkout}")
    spec = importlib.util.spec_from_file_location("before_target", path)
    module = sys.modules["before_target"] = importlib.util.module_from_spec(spec)  # dataclasses look it up
    spec.loader.exec_module(module)
    return module.Target


def ab(args: argparse.Namespace) -> None:
    """This checkout's step against another's, alternated step by step on the same trees."""
    before_class = before_target(Path(args.before))
    model, ids = long_ids(args)
    for context in [int(c) for c in args.contexts.split(",")]:
        after, before = Target(model), before_class(model)
        sides = (("before", before), ("after", after))
        if args.prefill:  # each side prefills its own cache, timed
            seconds = {}
            for name, target in sides:
                t0 = time.perf_counter()
                target.prefill(ids[:context])
                seconds[name] = time.perf_counter() - t0
            print(f"context {context:5d}: prefill: before {context / seconds['before']:5.0f} tok/s, after "
                  f"{context / seconds['after']:5.0f} tok/s, after/before time "
                  f"{seconds['after'] / seconds['before']:.3f}", flush=True)
        else:
            after.prefill(ids[:context])
            for i, layer in enumerate(after.cache.layers):
                before.cache.update(layer.keys[:, :, :context].clone(), layer.values[:, :, :context].clone(), i)
            before.length = context
        times: dict[str, list[float]] = {"before": [], "after": []}
        at = context
        for step in range(args.steps + 1):  # the first round warms up
            tree, chain = drafted(ids, at, args)
            for name, target in sides:
                seconds = timed_step(target, ids[at], tree, chain)
                if step:
                    times[name].append(seconds)
            at += len(chain) + 1
        b, a = (statistics.median(times[n]) * 1000 for n in ("before", "after"))
        print(f"context {context:5d}: verify+keep of {args.tree} nodes: before {b:7.2f} ms, after {a:7.2f} ms, "
              f"after/before {a / b:.3f} (medians of {args.steps}, alternated)", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--contexts", default="512,2048,4096,7900")
    parser.add_argument("--tree", type=int, default=16)
    parser.add_argument("--accept", type=int, default=3)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--before", type=Path, default=None, help="another checkout: its step against this one's")
    parser.add_argument("--prefill", action="store_true", help="--before: also time each side's own prefill")
    args = parser.parse_args()
    (ab if args.before else steps)(args)


if __name__ == "__main__":
    main()
