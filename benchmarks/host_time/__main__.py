"""``python -m benchmarks.host_time``: the instrument on Spec-Bench prompts with the default model (see the
package's docstring)."""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path
from time import perf_counter, thread_time

import numpy as np
import torch

import benchmarks.host_time as host_time
from graft_cli.bench.datasets import load_questions, resolve_dataset
from graft_cli.core import DEFAULT_SCHEDULE
from graft_cli.core.defaults import CUDA
from graft_cli.method.config import configure
from graft_cli.runtime.loading import encode, load_model

from benchmarks.host_time.inputs import CORPUS, datastore, random_head
from benchmarks.host_time.instrument import Measured, measure
from benchmarks.host_time.playback import cold_caches


def options() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.host_time", description=host_time.__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--drafter", choices=("model", "eagle3", "none"), default="model")
    ap.add_argument("--draft", default=None,
                    help="--drafter model: the draft model (default: the target itself); --drafter eagle3: the "
                         "head, eagle3:NAME|DIR (default: random weights)")
    ap.add_argument("--method", default="graft")
    ap.add_argument("--retrievers", default="prompt,recycling,suffix-array")
    ap.add_argument("--datastore", default=None, help="suffix-array store (default: one built under GRAFT_HOME)")
    ap.add_argument("--budget", type=int, default=60)
    ap.add_argument("--depth", type=int, default=7)
    ap.add_argument("--draft-top-k", type=int, default=8)
    ap.add_argument("--prune-at", default=f"{DEFAULT_SCHEDULE},floor:{CUDA.prune_floor}")
    ap.add_argument("--head-sharpness", type=float, default=12.0, help="EAGLE-3: scale of the random LM head")
    ap.add_argument("--categories", default="writing,coding,summarization,math_reasoning")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--clock", choices=("cpu", "wall"), default="cpu",
                    help="cpu: this thread's CPU time (steady on a shared machine; with --threads 1 it holds the "
                         "tensor work too); wall: perf_counter")
    ap.add_argument("--in-run", action="store_true",
                    help="time the forwards' own pass (they run inline, as on this CPU) instead of the replay")
    ap.add_argument("--cold-caches", action="store_true",
                    help="only time a piece of host code on warm caches and right after a big matmul, and exit")
    ap.add_argument("--fixed-shapes", action="store_true",
                    help="the fixed-shape path (graft_cli/runtime/fixed_target.py), run eagerly: padded verification, "
                         "acceptance and compaction on the device, one read")
    ap.add_argument("--write-kv", action="store_true", help="play the forwards' cache writes back as zeros in host "
                    "memory (their traffic evicts the host code's caches, which a GPU's writes do not), not as rows")
    ap.add_argument("--draft-ahead", action="store_true",
                    help="--fixed-shapes: a draft model drafts before the step's read too, as a head does")
    ap.add_argument("--read-per-level", action="store_true",
                    help="the cost-aware builder as on a CPU: each draft level decided from its own read")
    ap.add_argument("--repeat", type=int, default=3, help="replays (each from a fresh proposer); the quietest is shown")
    ap.add_argument("--target-ms", type=float, default=9.0,
                    help="the modelled clock: a one-token target forward (an 8B model on a GPU: 8-10 ms)")
    ap.add_argument("--draft-share", type=float, default=None,
                    help="the modelled clock: a draft forward against a target forward of as many rows (default: "
                         "0.35 for a draft model, Qwen2.5-Coder 0.5B against 1.5B; 0.1 for an EAGLE-3 head, one "
                         "layer and an LM head against a 32-layer target)")
    return ap


def main() -> int:
    args = options().parse_args()
    torch.set_num_threads(args.threads)
    clock = thread_time if args.clock == "cpu" else perf_counter
    if args.cold_caches:
        print(cold_caches(clock))
        return 0
    loaded = load_model(args.model, "cpu")
    dataset = resolve_dataset("spec-bench")  # $GRAFT_BENCH_DATA or the shared data beside the repository
    questions = load_questions(dataset, args.categories.split(","), limit=1)
    prompts = [encode(loaded.tokenizer, q.turns[0]) for q in questions]
    retrievers = [r for r in args.retrievers.split(",") if r]
    store = None
    if "suffix-array" in retrievers:
        store = args.datastore or datastore("host-overhead", dataset.parents[1] / CORPUS)
    with tempfile.TemporaryDirectory() as tmp:  # the EAGLE-3 head's files, for every pass's proposer
        draft = None
        if args.drafter == "model":
            draft = args.draft or args.model
        elif args.drafter == "eagle3":
            draft = args.draft or random_head(Path(tmp), loaded.model, 32000, args.head_sharpness)
        config = configure(args.method, budget=args.budget, retrievers=retrievers, datastore=store, draft=draft,
                           depth=args.depth, draft_top_k=args.draft_top_k, draft_ahead=args.draft_ahead,
                           prune_at=args.prune_at if args.method != "dense" else None)
        share = args.draft_share if args.draft_share is not None else (0.1 if args.drafter == "eagle3" else 0.35)
        m = measure(loaded, prompts, config, args.max_new_tokens, args.repeat, args.in_run, args.target_ms, share,
                    args.read_per_level, clock, args.write_kv, args.fixed_shapes)
    print(header(args, m, len(prompts), draft))
    print("\n".join(m.table()))
    return 0


def header(args: argparse.Namespace, m: Measured, prompts: int, draft: str | None) -> str:
    """The line above the table: what was run, and how it was timed."""
    kv = "as zeros in host memory" if args.write_kv else "as rows"
    timing = "forwards run inline" if args.in_run else \
        f"forwards played back (cache writes {kv}), the quietest of {args.repeat} replays"
    return (f"{args.model}, method {args.method}, drafter {args.drafter}{' ' + draft if draft else ''}, "
            f"budget {args.budget}, depth {args.depth}, draft top-k {args.draft_top_k}, retrievers {args.retrievers}; "
            f"{'the fixed-shape path (eager), ' if args.fixed_shapes else ''}"
            f"{prompts} Spec-Bench prompts ({args.categories}), {m.tokens} tokens in {m.steps} steps "
            f"(tau {m.tokens / max(m.steps, 1):.2f}; {len(m.levels)} drafts of "
            f"{np.mean(m.levels) if m.levels else 0:.1f} levels), threads {args.threads}, {args.clock} clock, "
            f"{timing}; counting costs {1e6 * m.cost:.2f} us per torch call, subtracted")


if __name__ == "__main__":
    sys.exit(main())
