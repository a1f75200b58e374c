"""Host time of one decoding step with the model forwards excluded, and device-to-host reads per step.

On a GPU the target verifies a 60-node tree of an 8B model in about 8-10 ms; every millisecond of Python around
that forward is a millisecond the GPU waits, and every read of a device tensor (``.item()``, ``.tolist()``, ...)
stalls the host until the GPU queue drains. This runs graft at the CUDA defaults (budget 60, depth 7, draft top-k
8, the GPU's pruning floor and latency curve) on a CPU, times every model forward (the target's, the draft
model's, the EAGLE-3 head's) and subtracts it, and splits what is left by phase, timed at the boundaries of the
engine and ``GraftProposer`` (not inside the drafter, so a rewritten drafter is measured the same way):

``draft``     the drafter's own work besides its forwards (draft() and observe())
``ahead``     (fixed shapes) the next draft, queued before the step's read: on a GPU, while the device verifies
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
mode's own cost per call is measured before each pass and subtracted. The clock is this thread's CPU time by
default (``--clock wall`` for perf_counter): on a shared machine wall time mostly measures the neighbours.

The forwards are played back, not run, by default. A CPU forward streams the model's weights (hundreds of MB)
through this machine's caches, and the host code right after it runs many times slower on cold caches
(``--cold-caches``: a 60-node tree's ancestor mask takes 18 us warm, 190 us after a 128 MB matmul). A GPU's forward
leaves the host's caches alone, so that slowdown does not transfer. So the decoding is done more than once:

1. **record**: the real decoding, every model forward run; its outputs, its writes to the KV caches (rows and
   shapes) and the outputs of every vocabulary-wide call outside the forwards are kept;
2. **replay** (``--repeat`` times, the quietest shown; benchmarks/playback.py): the same decoding from the same start (a proposer built
   alike), every forward replaced by its recorded outputs and its cache writes by their rows (each layer's
   filled rows advance; no keys or values move, as on a GPU, whose writes stay in its own memory;
   ``--write-kv`` writes zeros of the recorded shapes into the host's memory, whose traffic evicts the host
   code's caches), every vocabulary-wide call by its recorded output: the host code runs exactly as before,
   minus the device's work.
   Only the replays are timed. Should a forward's rows or a call differ from the record, or the tokens at the
   end, the replay stops with an error: its timing would not be of the same decoding.

Both passes run on a modelled clock (the engine's and the drafter's ``perf_counter``): a target forward costs
``--target-ms`` times the CUDA latency curve, a draft forward ``--draft-share`` of that, and host code nothing. So
the cost-aware decisions are the same in both passes, and they are the decisions a GPU's costs would make.
``--in-run`` times the record pass instead: the forwards run inline, as they do on this CPU. The cost-aware tree
builder runs planned, as off the CPU (one device read per draft; none with ``--fixed-shapes`` and a head, whose
draft rides in the step's read; ``--read-per-level``: one per level, the CPU's way). ``measure()`` is what
``benchmarks/gpu_check.py`` calls for its host row.

    python -m benchmarks.host_overhead --drafter model|eagle3|none --threads 1
    python -m benchmarks.host_overhead --cold-caches
    python -m benchmarks.host_overhead --drafter eagle3 --threads 1 --fixed-shapes   # the fixed-shape path, eagerly

``--fixed-shapes`` runs the fixed-shape path (graft_cli/runtime/fixed_target.py) eagerly: the verification, the
acceptance and the drafter's levels run as the regions a GPU captures, and each region's own time is shown as
``captured`` and excluded like a forward (on a GPU it is one graph replay, a few microseconds of launch); what
is left is writing the static inputs (``mask``), the step around the regions and its one read (``accept``), the
draft queued before that read (``ahead``) and the rest of the loop as before.

The suffix-array store is built once from one Alpaca-Eval output file (``$GRAFT_HOME/datastores/host-overhead``);
the EAGLE-3 head has random weights (in a temporary directory), scaled so that its tree grows.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from time import perf_counter, thread_time
from typing import Callable

import numpy as np
import torch

import graft_cli.core.stats as stopwatch
import graft_cli.drafting.cost_aware as cost_aware
import graft_cli.drafting.proposer as proposers
import graft_cli.drafting.tree_drafter as drafters
import plugins.draft_model as draft_model
from graft_cli.bench.datasets import load_questions, resolve_dataset
from graft_cli.core import DEFAULT_SCHEDULE, DraftSettings, Stats
from graft_cli.core.defaults import CUDA
from graft_cli.drafting import match_target
from graft_cli.drafting.budget import LatencyModel
from graft_cli.method.builder import MethodConfig, build
from graft_cli.runtime import engine
from graft_cli.runtime.kv_cache import PositionLayer
from graft_cli.runtime.loading import encode, load_model, stop_ids
from graft_cli.runtime.sampling import Sampling
from graft_cli.runtime.fixed_target import FixedShapeTarget
from graft_cli.runtime.target import Target

from benchmarks.host_inputs import CORPUS, datastore, random_head
from benchmarks.phases import CAPTURED, DEVICE, FORWARD, Phases
from benchmarks.playback import Replay, cold_caches

PHASES = ("draft", "ahead", "mask", "retrieve", "graft", "accept", "keep", "observe", "engine")


def _wrap_forward(module: torch.nn.Module, wrap: Callable[[Callable], Callable]) -> None:
    """Replace ``module.forward`` by ``wrap`` of its own: a model shared by every pass's proposer (and by a later
    ``measure``) is wrapped afresh each time, never inside an earlier pass's wrapper (which plays back that
    pass's record)."""
    own = getattr(module.forward, "own_forward", module.forward)
    module.forward = wrap(own)
    module.forward.own_forward = own


def _unwrap_forward(module: torch.nn.Module) -> None:
    own = getattr(module.forward, "own_forward", None)
    if own is None:
        return
    if getattr(own, "__func__", None) is type(module).forward:
        del module.forward  # the class's again
    else:
        module.forward = own  # a hook's (accelerate's, for a dispatched model)


def instrument_target(phases: Phases, replay: Replay, target: Target) -> None:
    """Wrap the engine's phase boundaries and the target's forward. On the fixed-shape path a step is one call:
    writing the static inputs is ``mask``, the rest of it (the acceptance region, compaction, the one read)
    ``accept``."""
    wrap = phases.wrap
    _wrap_forward(target.model, lambda own: wrap(FORWARD, replay.wrap(own, True, target.cache)))
    if isinstance(target, FixedShapeTarget):
        target.step = wrap("accept", target.step)
        target.graphs.run = wrap(CAPTURED, target.graphs.run)
        for inputs in target.inputs.values():
            inputs.write = wrap("mask", inputs.write)
        return
    target.verify = wrap("mask", target.verify)
    target.keep = wrap("keep", target.keep)
    engine.accept = wrap("accept", engine.accept)


def instrument_proposer(phases: Phases, replay: Replay, proposer) -> list[torch.nn.Module]:
    """Wrap the proposer's phase boundaries, and every forward of its drafter; return the models whose forward
    was wrapped (shared: ``measure`` unwraps them at its end)."""
    wrap = phases.wrap
    proposer.propose = wrap("retrieve", proposer.propose)  # what propose does itself: pooling retrieved trees
    proposer._graft = wrap("graft", proposer._graft)
    proposer.observe = wrap("observe", proposer.observe)
    for retriever in proposer.retrievers:
        retriever.retrieve = wrap("retrieve", retriever.retrieve)
        retriever.observe = wrap("observe", retriever.observe)
    drafter = proposer.drafter
    if drafter is not None:
        if drafter.fixed is not None:  # levels at fixed shapes: each region a graph replay on a GPU
            drafter.fixed.graphs.run = wrap(CAPTURED, drafter.fixed.graphs.run)
            drafter.draft_ahead = wrap("ahead", drafter.draft_ahead)
        drafter.draft = wrap("draft", drafter.draft)
        drafter.observe = wrap("draft", drafter.observe)
        head = getattr(drafter, "head", None)
        if head is not None:  # EAGLE-3: the head's layer, its fusion of target features, its LM head (its own)
            for name in ("forward", "fuse", "logp"):
                setattr(head, name, wrap(FORWARD, replay.wrap(getattr(head, name), False, head.cache)))
        else:
            model = drafter.cache.model
            decoder = model.get_decoder()
            for module in (model, decoder):
                _wrap_forward(module, lambda own: wrap(FORWARD, replay.wrap(own, False, drafter.cache.cache)))
            return [model, decoder]
    return []


@dataclass
class Measured:
    """One measurement: per phase the seconds, reads and torch calls of the timed pass, and what it decoded."""

    time: Counter
    reads: Counter
    calls: Counter
    steps: int
    tokens: int
    levels: list[int]  # draft levels of each step that drafted
    cost: float  # the counting mode's own cost per torch call (subtracted)

    @property
    def host_ms(self) -> float:
        return 1e3 * sum(self.time[p] for p in PHASES) / max(self.steps, 1)

    @property
    def exposed_ms(self) -> float:
        """Host time per step the device waits for: all but the draft queued ahead (while the device verifies)."""
        return self.host_ms - 1e3 * self.time["ahead"] / max(self.steps, 1)

    @property
    def syncs(self) -> float:
        return sum(self.reads[p] for p in PHASES) / max(self.steps, 1)

    def table(self) -> list[str]:
        steps = max(self.steps, 1)
        lines = [f"{'phase':<10}{'ms/step':>10}{'reads/step':>12}{'torch calls/step':>18}"]
        notes = {FORWARD: "  model forwards: excluded", DEVICE: "  vocabulary-wide tensor ops: excluded",
                 CAPTURED: "  regions a GPU replays as CUDA graphs: excluded"}
        for phase in (*PHASES, FORWARD, DEVICE, *((CAPTURED,) if self.calls[CAPTURED] else ())):
            note = notes.get(phase, "")
            lines.append(f"{phase:<10}{1e3 * self.time[phase] / steps:>10.3f}{self.reads[phase] / steps:>12.2f}"
                         f"{self.calls[phase] / steps:>18.1f}{note}")
        mine, drafts = (sum(counts[p] for p in ("draft", "ahead")) / steps for counts in (self.time, self.reads))
        lines.append(f"without the drafter's own work: host_ms_per_step={self.host_ms - 1e3 * mine:.3f} "
                     f"syncs_per_step={self.syncs - drafts:.2f}")
        if self.time["ahead"]:
            lines.append(f"not overlapped with the device: host_ms_per_step={self.exposed_ms:.3f}")
        lines.append(f"host_ms_per_step={self.host_ms:.3f} syncs_per_step={self.syncs:.2f}")
        return lines


def _profiled(loaded) -> None:
    """Measure (or read) the target's latency profile before anything is recorded: the cost-aware builder reads it
    when a proposer is built, and on a machine that has never profiled this model the profiling forwards would
    otherwise land in the record and no replay could match it."""
    from graft_cli.core import GraftError
    from graft_cli.drafting.profile import latency_model

    try:
        latency_model(loaded)
    except GraftError:  # a model built in memory has no checksum to file a profile under: nothing to measure
        pass


CLOCKED = (engine, stopwatch, proposers, cost_aware, drafters, draft_model)  # the modules whose perf_counter a decision reads


def measure(loaded, prompts: list[list[int]], config: MethodConfig, max_new_tokens: int = 64, repeat: int = 3,
            in_run: bool = False, target_ms: float = 9.0, draft_share: float = 0.35, read_per_level: bool = False,
            clock: Callable[[], float] = thread_time, write_kv: bool = False, fixed: bool = False) -> Measured:
    """Decode ``prompts`` with ``config`` at the CUDA defaults' latency curve, once for the record and then
    ``repeat`` replays (or, ``in_run``, the record pass timed itself); the quietest timed pass. The patches it
    makes (clocks, the cache's update, ``engine.accept``, the models' forwards) are undone on return."""
    patched = [(PositionLayer, "update", PositionLayer.update), (engine, "accept", engine.accept),
               *((module, "perf_counter", module.perf_counter) for module in CLOCKED)]
    wrapped = [loaded.model]  # models whose forward is wrapped on the instance
    try:
        _profiled(loaded)
        target = FixedShapeTarget(loaded.model) if fixed else Target(loaded.model)
        phases = Phases(clock)
        replay = Replay(target_ms / 1e3, draft_share, write_kv)
        instrument_target(phases, replay, target)
        PositionLayer.update = replay.recording()
        for module in CLOCKED:  # every clock a decision reads: the modelled one, in every pass
            module.perf_counter = replay.clock
        stops = stop_ids(loaded)

        def proposer():
            """A fresh proposer at the CUDA defaults: every pass starts from the same state."""
            made = match_target(build(config, loaded), target)  # --fixed-shapes: the drafter's levels too
            made.latency = LatencyModel.default("cuda")
            if getattr(made, "objective", None) is not None:  # the cost-aware builder as it runs on a GPU
                made.objective.latency, made.objective.planned = made.latency, not read_per_level
            wrapped.extend(instrument_proposer(phases, replay, made))
            return made

        def run(proposer, prompt: list[int], max_new: int) -> tuple[Stats, list[int]]:
            stats, out = Stats(), []
            steps = engine.decode(target, proposer, prompt, Sampling(), max_new, stops, stats=stats)
            out.extend(next(steps))  # the prefill and the proposer's start: not a step
            phases.counting = True
            phases.wrap("engine", lambda: [out.extend(new) for new in steps])()
            phases.counting = False
            return stats, out

        def one_pass(replaying: bool) -> tuple[Counter, Counter, Counter, int, int, list]:
            replay.replaying, replay.at = replaying, 0
            phases.replaying, phases.at = replaying, 0
            made = proposer()
            run(made, prompts[0], 8)  # warm-up
            phases.reset()
            steps = tokens = 0
            texts = []
            levels.clear()
            for prompt in prompts:
                stats, out = run(made, prompt, max_new_tokens)
                steps, tokens = steps + stats.steps, tokens + stats.new_tokens
                texts.append(out)
                levels.extend(record["levels"] for record in made.trace if record["levels"])
            made.close()
            return Counter(phases.time), Counter(phases.reads), Counter(phases.calls), steps, tokens, texts

        levels: list[int] = []  # draft levels of each step that drafted, in the last pass
        if not in_run:
            phases.tape = []
        passes, costs = [], []
        for i in range(1 + (0 if in_run else repeat)):  # the record (timed itself with --in-run), the replays
            costs.append(phases.cost())  # measured right before each pass: it moves with the machine's state
            with phases:
                passes.append(one_pass(i > 0))
            if passes[-1][5] != passes[0][5]:
                raise SystemExit("host_overhead: the replay produced other tokens than the record")
        replay.calls.clear()
        timed, costs = (passes[1:], costs[1:]) if len(passes) > 1 else (passes, costs)
        for (times, _, calls, *_), cost in zip(timed, costs):  # the counting's own cost is not the host's
            for phase, n in calls.items():
                times[phase] -= n * cost
        totals = [sum(times[p] for p in PHASES) for times, *_ in timed]
        quietest = totals.index(min(totals))
        times, reads, calls, steps, tokens, _ = timed[quietest]
        return Measured(times, reads, calls, steps, tokens, levels, costs[quietest])
    finally:
        for owner, name, value in patched:
            setattr(owner, name, value)
        for model in wrapped:
            _unwrap_forward(model)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
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
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if args.cold_caches:
        print(cold_caches(thread_time if args.clock == "cpu" else perf_counter))
        return 0

    loaded = load_model(args.model, "cpu")
    dataset = resolve_dataset("spec-bench")  # $GRAFT_BENCH_DATA or the shared data beside the repository
    questions = load_questions(dataset, args.categories.split(","), limit=1)
    prompts = [encode(loaded.tokenizer, q.turns[0]) for q in questions]
    retrievers = [r for r in args.retrievers.split(",") if r]
    options = {}
    if "suffix-array" in retrievers:
        options["datastore"] = args.datastore or datastore("host-overhead", dataset.parents[1] / CORPUS)
    tmp = tempfile.TemporaryDirectory()  # the EAGLE-3 head's files, for every pass's proposer
    draft = None
    if args.drafter == "model":
        draft = args.draft or args.model
    elif args.drafter == "eagle3":
        draft = args.draft or random_head(Path(tmp.name), loaded.model, 32000, args.head_sharpness)
    config = MethodConfig(args.method, budget=args.budget, retrievers=retrievers, options=options, draft=draft, drafting=DraftSettings(depth=args.depth, draft_top_k=args.draft_top_k, prune_at=args.prune_at if args.method != "dense" else None, draft_ahead=args.draft_ahead))
    share = args.draft_share if args.draft_share is not None else (0.1 if args.drafter == "eagle3" else 0.35)
    m = measure(loaded, prompts, config, args.max_new_tokens, args.repeat, args.in_run, args.target_ms, share,
                args.read_per_level, thread_time if args.clock == "cpu" else perf_counter, args.write_kv, args.fixed_shapes)
    tmp.cleanup()
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
