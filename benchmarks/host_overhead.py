"""Host time of one decoding step with the model forwards excluded, and device-to-host reads per step.

On a GPU the target verifies a 60-node tree of an 8B model in about 8-10 ms; every millisecond of Python around
that forward is a millisecond the GPU waits, and every read of a device tensor (``.item()``, ``.tolist()``, ...)
stalls the host until the GPU queue drains. This runs graft at the CUDA defaults (budget 60, depth 7, draft top-k
8, the GPU's pruning floor and latency curve) on a CPU, times every model forward (the target's, the draft
model's, the EAGLE-3 head's) and subtracts it, and splits what is left by phase, timed at the boundaries of the
engine and ``GraftProposer`` (not inside the drafter, so a rewritten drafter is measured the same way):

``draft``     the drafter's own work besides its forwards (draft() and observe())
``mask``      ``Target.verify`` besides the forward: input ids, positions, the tree mask
``retrieve``  every retriever's ``retrieve`` and the proposer's pooling of their trees
``graft``     grafting the pool into the free slots and the latency model's cut
``accept``    ``verify.accept``;  ``keep``: the KV cache compacted to the accepted path
``observe``   retrievers and calibration learning from the step
``engine``    the rest of the loop (token lists, counters)

A TorchFunctionMode sees every torch call: it counts them per phase (each is a kernel launch on a GPU) and the
device-to-host reads among them (``.item()``, ``.tolist()``, ``.cpu()``, ``.numpy()``, ``float()``, ``bool()``,
``int()``, indexing with a tensor, ``np.asarray``); reads inside the model forwards (transformers' own) are shown
apart and not counted in ``syncs_per_step``. On this CPU every tensor op runs at once; a call over a
vocabulary-sized tensor (softmax, top-k, argmax over the logits, KV moves) is device work a GPU runs
asynchronously, so it is timed and excluded like a forward. What remains is Python and small tensor calls (on a
GPU each of those is a kernel launch of a few microseconds, about what a small CPU op costs here). The counting
mode's own cost per call is measured at the start and subtracted. The clock is this thread's CPU time by default
(``--clock wall`` for perf_counter): on a shared machine wall time mostly measures the neighbours.

    python benchmarks/host_overhead.py --drafter model --threads 1
    python benchmarks/host_overhead.py --drafter eagle3 --threads 1
    python benchmarks/host_overhead.py --drafter none --threads 1

The suffix-array store is built once from one Alpaca-Eval output file (``$GRAFT_HOME/datastores/host-overhead``);
the EAGLE-3 head has random weights (written to a temporary directory), scaled so that its distributions are
peaked enough for the tree to grow.
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
import tempfile
from collections import Counter
from pathlib import Path
from time import perf_counter, thread_time
from typing import Any, Callable

import torch
from torch.overrides import TorchFunctionMode

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from graft_cli import engine  # noqa: E402
from graft_cli.bench.datasets import load_questions, resolve_dataset  # noqa: E402
from graft_cli.budget import LatencyModel  # noqa: E402
from graft_cli.catalog.home import graft_home  # noqa: E402
from graft_cli.catalog.resolve import resolve_model  # noqa: E402
from graft_cli.loading import encode, load_model, stop_ids  # noqa: E402
from graft_cli.methods import MethodConfig, build  # noqa: E402
from graft_cli.prune import DEFAULT as DEFAULT_PRUNE  # noqa: E402
from graft_cli.prune import default_floor  # noqa: E402
from graft_cli.sampling import Sampling  # noqa: E402
from graft_cli.stats import Stats  # noqa: E402
from graft_cli.target import Target  # noqa: E402

PHASES = ("draft", "mask", "retrieve", "graft", "accept", "keep", "observe", "engine")
FORWARD = "forward"
DEVICE = "device"  # torch calls over vocabulary-sized tensors outside the forwards
CORPUS = "corpus/alpaca_eval_outputs/gpt4.jsonl"  # under the shared data, beside the benchmark prompts
READS = ("item", "tolist", "cpu", "numpy", "__float__", "__bool__", "__int__", "__index__", "__array__")


class Phases(TorchFunctionMode):
    """Exclusive time per phase (a nested phase's time is its own, not its caller's), and per phase the torch
    calls made and the device-to-host reads among them. A torch call over a vocabulary-sized tensor (at least
    ``big`` elements: softmax, top-k, argmax over logits) is device work on a GPU: timed like a forward."""

    def __init__(self, clock: Callable[[], float], big: int = 1 << 16) -> None:
        super().__init__()
        self.clock, self.big = clock, big
        self.stack: list[list] = []  # [name, start, time spent in nested phases]
        self.time: Counter = Counter()
        self.reads: Counter = Counter()
        self.calls: Counter = Counter()
        self.counting = False

    def wrap(self, name: str, fn: Callable) -> Callable:
        @functools.wraps(fn)
        def timed(*args, **kwargs):
            self.enter(name)
            try:
                return fn(*args, **kwargs)
            finally:
                self.exit()

        return timed

    def enter(self, name: str) -> None:
        self.stack.append([name, self.clock(), 0.0])

    def exit(self) -> None:
        phase, start, nested = self.stack.pop()
        elapsed = self.clock() - start
        self.time[phase] += elapsed - nested
        if self.stack:
            self.stack[-1][2] += elapsed

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if not self.counting:
            return func(*args, **kwargs)
        phase = self.stack[-1][0] if self.stack else "outside"
        name = getattr(func, "__name__", "")
        self.calls[phase] += 1
        if name in READS:
            self.reads[phase] += 1
        if phase != FORWARD and any(isinstance(a, torch.Tensor) and a.numel() >= self.big for a in args):
            self.enter(DEVICE)
            try:
                return func(*args, **kwargs)
            finally:
                self.exit()
        return func(*args, **kwargs)

    def reset(self) -> None:
        for counter in (self.time, self.reads, self.calls):
            counter.clear()

    def cost(self, n: int = 4000) -> float:
        """Seconds this mode adds to one torch call: small calls timed without it and with it (best of 5)."""
        x = torch.ones(4)

        def calls() -> float:
            start = self.clock()
            for _ in range(n):
                x.add(1)
                x[1]
            return self.clock() - start

        plain = min(calls() for _ in range(5))
        self.counting = True
        self.stack.append(["calibration", self.clock(), 0.0])
        with self:
            counted = min(calls() for _ in range(5))
        self.stack.clear()
        self.counting = False
        self.reset()
        return max(counted - plain, 0.0) / (2 * n)


def datastore(name: str, corpus: Path) -> str:
    """A small suffix-array store over real text, built once under GRAFT_HOME (seconds)."""
    from datastores import DatastoreError
    from datastores.build import build_store
    from datastores.store import read_store

    path = graft_home() / "datastores" / name
    try:
        read_store(path)
    except DatastoreError:
        print(f"building suffix-array store {path} from {corpus} ...", file=sys.stderr)
        build_store([corpus], path, model_dir=resolve_model("smollm2-135m-instruct"),
                    model_name="smollm2-135m-instruct", fields=["output"], jobs=1, force=True)
    return str(path)


def random_head(root: Path, target: torch.nn.Module, draft_vocab: int, sharpness: float) -> str:
    """An EAGLE-3 head with random weights in the format users' heads come in (for the target's width)."""
    from safetensors.torch import save_file

    from graft_cli.drafters.eagle3 import HeadConfig, expected_shapes

    c = target.config
    heads, kv = c.num_attention_heads, c.num_key_value_heads
    head_dim = c.hidden_size // heads
    config = dict(hidden_size=c.hidden_size, num_attention_heads=heads, num_key_value_heads=kv, head_dim=head_dim,
                  intermediate_size=c.intermediate_size, vocab_size=c.vocab_size, draft_vocab_size=draft_vocab,
                  rms_norm_eps=1e-5, hidden_act="silu")
    (root / "config.json").write_text(json.dumps(config))
    cfg = HeadConfig(c.hidden_size, heads, kv, head_dim, c.intermediate_size, c.vocab_size, draft_vocab, 1e4, 1e-5, "silu")
    gen = torch.Generator().manual_seed(0)
    tensors = {}
    for name, shape in expected_shapes(cfg, c.hidden_size).items():
        if name.endswith("norm.weight"):
            tensors[name] = torch.ones(shape)
        else:
            scale = sharpness if name == "lm_head.weight" else 1.0
            tensors[name] = torch.randn(shape, generator=gen) * (scale / shape[-1] ** 0.5)
    tensors["d2t"] = torch.zeros(draft_vocab, dtype=torch.long)
    save_file(tensors, str(root / "model.safetensors"))
    return f"eagle3:{root}"


def instrument(phases: Phases, target: Target, proposer) -> None:
    """Wrap the phase boundaries of the engine and the proposer, and every model forward."""
    wrap = phases.wrap
    target.model.forward = wrap(FORWARD, target.model.forward)
    target.verify = wrap("mask", target.verify)
    target.keep = wrap("keep", target.keep)
    engine.accept = wrap("accept", engine.accept)
    proposer.propose = wrap("retrieve", proposer.propose)  # what propose does itself: pooling retrieved trees
    proposer._graft = wrap("graft", proposer._graft)
    proposer.observe = wrap("observe", proposer.observe)
    for retriever in proposer.retrievers:
        retriever.retrieve = wrap("retrieve", retriever.retrieve)
        retriever.observe = wrap("observe", retriever.observe)
    drafter = proposer.drafter
    if drafter is not None:
        drafter.draft = wrap("draft", drafter.draft)
        drafter.observe = wrap("draft", drafter.observe)
        head = getattr(drafter, "head", None)
        if head is not None:  # EAGLE-3: the head's layer, its fusion of target features, its LM head
            for name in ("forward", "fuse", "logp"):
                setattr(head, name, wrap(FORWARD, getattr(head, name)))
        else:
            model = drafter.cache.model
            model.forward = wrap(FORWARD, model.forward)
            model.get_decoder().forward = wrap(FORWARD, model.get_decoder().forward)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--drafter", choices=("model", "eagle3", "none"), default="model")
    ap.add_argument("--draft", default=None, help="draft model for --drafter model (default: the target itself)")
    ap.add_argument("--method", default="graft")
    ap.add_argument("--retrievers", default="prompt,recycling,suffix-array")
    ap.add_argument("--datastore", default=None, help="suffix-array store (default: one built under GRAFT_HOME)")
    ap.add_argument("--budget", type=int, default=60)
    ap.add_argument("--depth", type=int, default=7)
    ap.add_argument("--draft-top-k", type=int, default=8)
    ap.add_argument("--prune-at", default=f"{DEFAULT_PRUNE},floor:{default_floor('cuda')}")
    ap.add_argument("--head-sharpness", type=float, default=12.0, help="EAGLE-3: scale of the random LM head")
    ap.add_argument("--categories", default="writing,coding,summarization,math_reasoning")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--clock", choices=("cpu", "wall"), default="cpu",
                    help="cpu: this thread's CPU time (steady on a shared machine; with --threads 1 it holds the "
                         "tensor work too); wall: perf_counter")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    loaded = load_model(args.model, "cpu")
    dataset = resolve_dataset("spec-bench")  # $GRAFT_BENCH_DATA or the shared data beside the repository
    questions = load_questions(dataset, args.categories.split(","), limit=1)
    prompts = [encode(loaded.tokenizer, q.turns[0]) for q in questions]
    retrievers = [r for r in args.retrievers.split(",") if r]
    options = {}
    if "suffix-array" in retrievers:
        options["datastore"] = args.datastore or datastore("host-overhead", dataset.parents[1] / CORPUS)
    with tempfile.TemporaryDirectory() as tmp:
        draft = None
        if args.drafter == "model":
            draft = args.draft or args.model
        elif args.drafter == "eagle3":
            draft = random_head(Path(tmp), loaded.model, 32000, args.head_sharpness)
        config = MethodConfig(args.method, budget=args.budget, retrievers=retrievers, options=options, draft=draft,
                              depth=args.depth, draft_top_k=args.draft_top_k,
                              prune_at=args.prune_at if args.method != "dense" else None)
        proposer = build(config, loaded)
    proposer.latency = LatencyModel.default("cuda")
    target = Target(loaded.model)
    phases = Phases(thread_time if args.clock == "cpu" else perf_counter)
    instrument(phases, target, proposer)
    stops = stop_ids(loaded)

    def run(prompt: list[int], max_new: int) -> Stats:
        stats = Stats()
        steps = engine.decode(target, proposer, prompt, Sampling(), max_new, stops, stats=stats)
        next(steps)  # the prefill and the proposer's start: not a step
        phases.counting = True
        wrap = phases.wrap("engine", lambda: [None for _ in steps])
        wrap()
        phases.counting = False
        return stats

    cost = phases.cost()
    with phases:
        run(prompts[0], 8)  # warm-up
        phases.reset()
        steps = tokens = 0
        for prompt in prompts:
            stats = run(prompt, args.max_new_tokens)
            steps, tokens = steps + stats.steps, tokens + stats.new_tokens

    print(f"{args.model}, method {args.method}, drafter {args.drafter}{' ' + draft if draft else ''}, "
          f"budget {args.budget}, depth {args.depth}, draft top-k {args.draft_top_k}, retrievers {args.retrievers}; "
          f"{len(prompts)} Spec-Bench prompts ({args.categories}), {tokens} tokens in {steps} steps "
          f"(tau {tokens / max(steps, 1):.2f}), threads {args.threads}, {args.clock} clock; counting costs "
          f"{1e6 * cost:.2f} us per torch call, subtracted")
    for phase, calls in phases.calls.items():  # the counting's own cost is not the host's
        phases.time[phase] -= calls * cost
    print(f"{'phase':<10}{'ms/step':>10}{'reads/step':>12}{'torch calls/step':>18}")
    host = sum(phases.time[p] for p in PHASES)
    syncs = sum(phases.reads[p] for p in PHASES)
    for phase in (*PHASES, FORWARD, DEVICE):
        note = {FORWARD: "  model forwards: excluded", DEVICE: "  vocabulary-wide tensor ops: excluded"}.get(phase, "")
        print(f"{phase:<10}{1e3 * phases.time[phase] / steps:>10.3f}{phases.reads[phase] / steps:>12.2f}"
              f"{phases.calls[phase] / steps:>18.1f}{note}")
    mine = host - phases.time["draft"]
    print(f"without the drafter's own work: host_ms_per_step={1e3 * mine / steps:.3f} "
          f"syncs_per_step={(syncs - phases.reads['draft']) / steps:.2f}")
    print(f"host_ms_per_step={1e3 * host / steps:.3f} syncs_per_step={syncs / steps:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
