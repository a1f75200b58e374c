"""What runs one generation of a benchmark column: the engine with a method's proposer, or a transformers
``generate`` peer; both measure their wall time and peak memory the same way."""

from __future__ import annotations

import sys
from contextlib import nullcontext
from dataclasses import dataclass, field
from functools import partial
from time import perf_counter
from typing import Any, Callable, Protocol, Sequence

import torch

from graft_cli.method import builder as methods
from graft_cli.bench.options import BenchOptions
from graft_cli.bench.plan import MethodSpec
from graft_cli.core import GraftError, Proposer, Stats, device_kind
from graft_cli.method.config import MethodConfig
from graft_cli.models import CausalLM
from graft_cli.runtime import loading
from graft_cli.runtime.attention_kernels import GroupedQueryAttention
from graft_cli.runtime.engine import decode
from graft_cli.runtime.fixed_target import make_target
from graft_cli.runtime.lossless import FixedMarginTarget, MarginTarget
from graft_cli.runtime.sampling import Sampling
from graft_cli.runtime.target import Target

HF_PLD_TOKENS = 10


@dataclass
class Turn:
    """One generation: the tokens (a stop token included when one ended it) and what it cost."""

    tokens: list[int]
    wall: float
    accept_lengths: list[int]
    steps: int = 0
    proposed: dict = field(default_factory=dict)
    accepted: dict = field(default_factory=dict)
    time_s: dict = field(default_factory=dict)
    peak_mem_mb: float | None = None
    budget_mean: float | None = None  # mean tree nodes chosen per step under --budget auto
    draft_forwards: int = 0  # forwards of the draft model or head
    margins: list[float] | None = None  # plain decoding: each token's top-2 logit margin (graft_cli/runtime/lossless.py)
    first_token_s: float | None = None  # seconds until the first new tokens came out (prefill and first step)
    first_tokens: int = 0  # how many came out then


class Runner(Protocol):
    name: str

    def run(self, ids: list[int], max_new_tokens: int) -> Turn: ...

    def reset(self) -> None:
        """Forget what the method learnt in this run (a ``--repeats`` pass starts where the run started)."""

    def close(self) -> None:
        """After the last run: the method's parts save what they keep on disk."""


class MemoryPeak:
    """Peak memory of one generation: the process's resident set on a CPU (Linux resets its high-water mark
    through /proc/self/clear_refs; elsewhere the process-wide peak is reported), allocated memory on CUDA."""

    def __init__(self, device: str) -> None:
        self.cuda = device.startswith("cuda")
        self.peak: float | None = None

    def __enter__(self) -> MemoryPeak:
        if self.cuda:
            torch.cuda.reset_peak_memory_stats()
        else:
            try:
                with open("/proc/self/clear_refs", "w") as f:
                    f.write("5")
            except OSError:
                pass
        return self

    def __exit__(self, *exc: object) -> None:
        if self.cuda:
            self.peak = torch.cuda.max_memory_allocated() / 2**20
            return
        try:
            with open("/proc/self/status") as f:
                for line in f:
                    if line.startswith("VmHWM:"):
                        self.peak = int(line.split()[1]) / 1024
                        return
        except OSError:
            pass
        try:
            import resource  # lazy: a POSIX module (absent on Windows, where the ImportError below answers None)

            self.peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / (1024 if sys.platform != "darwin" else 2**20)
        except (ImportError, OSError):
            self.peak = None


def _sync(device: str) -> None:
    """Wait for the GPU's queued work: a wall time read before it would stop short of the last forward."""
    if device.startswith("cuda"):
        torch.cuda.synchronize()


class EngineRunner:
    """An engine method: ``decode`` with the method's proposer, reused across prompts (its retrievers and
    calibration stay warm, as in a ``graft generate --jsonl`` session)."""

    def __init__(self, name: str, target: Target, build: Callable[[], Proposer], stop: set[int], device: str) -> None:
        self.name, self.target, self.build, self.stop, self.device = name, target, build, stop, device
        self.proposer = build()

    def run(self, ids: list[int], max_new_tokens: int) -> Turn:
        stats = Stats()
        tokens: list[int] = []
        first_token_s, first_tokens = None, 0
        with MemoryPeak(self.device) as mem:
            t0 = perf_counter()
            for step in decode(self.target, self.proposer, ids, Sampling(), max_new_tokens, self.stop, None, stats):
                if not tokens:
                    first_token_s, first_tokens = perf_counter() - t0, len(step)
                tokens += step
            _sync(self.device)
            wall = perf_counter() - t0
        budgets = stats.budgets
        return Turn(
            tokens=tokens,
            wall=wall,
            accept_lengths=list(stats.accept_lengths),
            steps=stats.steps,
            proposed=dict(stats.proposed),
            accepted=dict(stats.accepted),
            time_s={k: round(v, 4) for k, v in stats.times.items()},
            peak_mem_mb=mem.peak,
            budget_mean=round(sum(budgets) / len(budgets), 2) if budgets else None,
            draft_forwards=stats.draft_forwards,
            margins=self.target.margins() if isinstance(self.target, MarginTarget) else None,
            first_token_s=first_token_s,
            first_tokens=first_tokens,
        )

    def reset(self) -> None:
        """A new proposer: retrievers, calibration and cost model as they were before the first question."""
        self.proposer.close()
        self.proposer = self.build()

    def close(self) -> None:
        self.proposer.close()


class _StepCounter:
    """A generate() streamer that only counts the tokens of each step (the first put is the prompt)."""

    def __init__(self) -> None:
        self.lengths: list[int] = []
        self.prompt_seen = False
        self.first_at: float | None = None  # perf_counter() when the first new tokens came

    def put(self, value: torch.Tensor) -> None:
        if not self.prompt_seen:
            self.prompt_seen = True
            return
        if self.first_at is None:
            self.first_at = perf_counter()
        self.lengths.append(int(value.numel()))

    def end(self) -> None:
        pass


class PeerRunner:
    """``model.generate(do_sample=False)`` with extra arguments: prompt lookup or an assistant model."""

    def __init__(self, name: str, model: Any, stop: set[int], device: str, **kwargs: Any) -> None:
        self.name, self.model, self.stop, self.device, self.kwargs = name, model, stop, device, kwargs
        self.pad = sorted(stop)[0] if stop else 0
        assistant = kwargs.get("assistant_model")
        self._lookahead = assistant.generation_config.num_assistant_tokens if assistant is not None else None

    def run(self, ids: list[int], max_new_tokens: int) -> Turn:
        x = torch.tensor([ids], device=self.device)
        streamer = _StepCounter()
        # on a CPU under graft's own attention setting (attention_kernels.py), so that no side reads a copy of
        # the cache per head that the other does not
        grouped = GroupedQueryAttention() if device_kind(self.device) == "cpu" else nullcontext()
        with MemoryPeak(self.device) as mem, torch.inference_mode(), grouped:
            t0 = perf_counter()
            out = self.model.generate(
                input_ids=x,
                attention_mask=torch.ones_like(x),
                max_new_tokens=max_new_tokens,
                do_sample=False,
                temperature=None,
                top_p=None,
                top_k=None,
                eos_token_id=sorted(self.stop) or None,
                pad_token_id=self.pad,
                streamer=streamer,
                **self.kwargs,
            )
            _sync(self.device)
            wall = perf_counter() - t0
        tokens = out[0, len(ids) :].tolist()
        for i, t in enumerate(tokens):
            if t in self.stop:
                tokens = tokens[: i + 1]
                break
        lengths = streamer.lengths
        # the engine's first token comes from the prefill and is not a verification step; generate's plain loop
        # streams it as a step of its own, so drop it there for a comparable tau
        if not self.kwargs and lengths:
            lengths = lengths[1:]
        started = streamer.first_at is not None
        return Turn(tokens=tokens, wall=wall, accept_lengths=lengths, steps=len(lengths), peak_mem_mb=mem.peak,
                    first_token_s=streamer.first_at - t0 if started else None,
                    first_tokens=streamer.lengths[0] if started else 0)

    def reset(self) -> None:
        """Assisted generation's heuristic schedule carries the assistant's lookahead from one generate() to the
        next (in its generation config): put it back."""
        if self._lookahead is not None:
            self.kwargs["assistant_model"].generation_config.num_assistant_tokens = self._lookahead

    def close(self) -> None:
        """generate() keeps nothing else across runs."""


@dataclass
class Columns:
    """The benchmark's columns that run here, in order: each method spec with its runner."""

    specs: list[MethodSpec]
    runners: list[Runner]

    @property
    def names(self) -> list[str]:
        return [s.name for s in self.specs]


def build_runners(specs: Sequence[MethodSpec], loaded: loading.Loaded, draft_loaded: loading.Loaded | None,
                  opts: BenchOptions, explicit: bool, warn: Callable[[str], None],
                  peer_loaded: loading.Loaded | None = None) -> Columns:
    """A runner per method spec; with ``all`` (not ``explicit``), engine methods that cannot be built here (a
    datastore or a draft model missing) are left out with a warning instead of failing the run. ``peer_loaded``:
    the target on transformers' modules for transformers' own columns, where ``loaded`` runs on graft's."""
    stop = loading.stop_ids(loaded)
    target = make_target(loaded.model, opts.graphs)
    columns = Columns([], [])
    for spec in specs:
        if spec.kind == "peer":
            runner: Runner = _peer_runner(spec, peer_loaded or loaded, draft_loaded, stop)
        else:
            config = opts.method_config(spec)  # outside the try: a bad --method-opt fails the run, even with all
            try:
                runner = _engine_runner(spec, config, loaded, target, stop, opts.graphs)
            except GraftError as e:
                if explicit or spec.method == "ar":
                    raise GraftError(f"method {spec.name}: {e}") from e
                warn(f"skipping {spec.name}: {e}")
                continue
        columns.specs.append(spec)
        columns.runners.append(runner)
    return columns


def _peer_runner(spec: MethodSpec, loaded: loading.Loaded, draft_loaded: loading.Loaded | None,
                 stop: set[int]) -> PeerRunner:
    """transformers' own speculative decoding as a column: prompt lookup, an assistant model, or neither."""
    kwargs: dict = {}
    if spec.method == "hf-pld":
        kwargs["prompt_lookup_num_tokens"] = HF_PLD_TOKENS
    elif spec.method == "hf-assisted":
        if draft_loaded is None:
            raise GraftError("hf-assisted needs a draft model: give --draft MODEL")
        kwargs["assistant_model"] = draft_loaded.model
    return PeerRunner(spec.name, loaded.model, stop, loaded.device, **kwargs)


def _engine_runner(spec: MethodSpec, config: MethodConfig, loaded: loading.Loaded, target: Target,
                   stop: set[int], graphs: str = "auto") -> EngineRunner:
    """An engine method as a column, its proposer built now (a GraftError when it cannot be built here)."""
    # plain decoding records its margins: what tells a floating-point tie from a real difference
    runner_target = target
    if spec.method == "ar":
        runner_target = make_target(loaded.model, graphs, eager=MarginTarget, fixed=FixedMarginTarget)
    return EngineRunner(spec.name, runner_target, partial(methods.build, config, loaded, runner_target), stop,
                        loaded.device)


def weights_dtype(loaded: loading.Loaded) -> str:
    """A loaded model's weights' dtype as ``--dtype`` names it, e.g. float32."""
    return str(next(loaded.model.parameters()).dtype).replace("torch.", "")


def modules_of(loaded: loading.Loaded) -> str:
    """Whose modules run a loaded model: ``own`` (graft's forward) or ``transformers``."""
    return "own" if isinstance(loaded.model, CausalLM) else "transformers"


class shared_models:
    """While active, ``graft_cli.runtime.loading.load_model`` returns the already loaded model for the same
    (spec, device, dtype, modules): drafter methods that load their ``--draft`` themselves share the one copy
    hf-assisted uses, so every model is loaded once however many methods and budgets run. (Drafters do not
    modify the model: they keep their own caches.) The modules count: a target on graft's own forward is never
    handed to a drafter that loads the same model on transformers' (``load_model``'s default), as ``graft
    generate``'s drafter would."""

    def __init__(self, *loaded: loading.Loaded | None) -> None:
        self.cache: dict[tuple[str, str, str, str], loading.Loaded] = {}
        for item in loaded:
            if item is not None:
                self.add(item)

    def add(self, item: loading.Loaded) -> None:
        dtype, modules = weights_dtype(item), modules_of(item)
        for device in (item.device, item.device.split(":")[0], "auto"):
            for d in (dtype, "auto"):
                self.cache.setdefault((str(item.spec), device, d, modules), item)

    def __enter__(self) -> shared_models:
        self.original = loading.load_model

        def load_model(spec: str, device: str = "auto", dtype: str = "auto", device_map: str | dict | None = None,
                       forward: str = "transformers") -> loading.Loaded:
            if device_map is not None:  # a sharded model is the bench's own target, loaded once
                return self.original(spec, device, dtype, device_map, forward=forward)
            key = (str(spec), str(device), str(dtype), "transformers" if forward == "transformers" else "own")
            if key not in self.cache:
                item = self.original(spec, device, dtype, forward=forward)
                self.add(item)
                self.cache[key] = item
            return self.cache[key]

        loading.load_model = load_model
        return self

    def __exit__(self, *exc: object) -> None:
        loading.load_model = self.original
