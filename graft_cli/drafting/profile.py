"""``--budget auto``: measure what verification costs on this device, then let each step pick its tree size.

The target's forward latency is measured once per model, device and dtype against the number of tokens fed
(the root plus the tree), over a KV cache of a few hundred tokens, and cached as JSON under
``graft_home()/profiles/``. :class:`AutoBudget` wraps any proposer: it lets the proposer grow a tree up to a
generous cap, then keeps the best-scored nodes that maximise expected accepted tokens per second of
verification, ``(1 + sum of kept scores) / latency(kept + 1)``. Node scores are the proposers' acceptance
estimates, which the proposer keeps calibrated from the running acceptance statistics.
"""

from __future__ import annotations

import json
import os
import re
import sys
import time
from pathlib import Path
from statistics import median
from typing import Sequence

import torch

from datastores.atomic import write_text_atomic
from graft_cli.catalog.checksums import model_checksum
from graft_cli.catalog.home import graft_home
from graft_cli.core import defaults_for, Needs, Proposer, ROOT, Step, Tree
from graft_cli.drafting.budget import LatencyModel
from graft_cli.models.four_bit import precision
from graft_cli.runtime.limits import limits
from graft_cli.runtime.loading import Loaded
from graft_cli.runtime.target import Target

CONTEXT = 320  # tokens in the KV cache while measuring
LONG_CONTEXT = 2048  # ... and again, for what the context adds (two sizes)
LONG_SIZES = (1, 16)
REPEATS = 5
NOISY = 0.5  # timings spread above this: warn that the machine was busy
PROFILE_VERSION = 6  # 6: large weights on every thread; 5: threads by the work (core/threads.py); 4: the context term


def device_label(device: str) -> str:
    """What the profile depends on besides the model: the accelerator's name, or the CPU thread count."""
    if device.startswith("cuda"):
        index = torch.device(device).index or 0
        name = torch.cuda.get_device_name(index)
        return "cuda-" + re.sub(r"[^A-Za-z0-9]+", "-", name).strip("-")
    return f"cpu-{torch.get_num_threads()}t"


def profile_path(checksum: str, device: str, dtype: str) -> Path:
    return graft_home() / "profiles" / f"{checksum}-{device}-{dtype}.json"


def measure(model: torch.nn.Module, sizes: Sequence[int], context: int = CONTEXT, repeats: int = REPEATS) -> dict[int, list[float]]:
    """Seconds of one verification forward feeding ``n`` tokens (a chain tree of n-1 nodes): ``repeats``
    timings per n.

    Sizes are interleaved within every repeat so that machine drift hits all of them alike; each forward is
    rolled back so the cache holds ``context`` tokens every time.
    """
    vocab = model.config.vocab_size
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab, (context + max(sizes),), generator=gen).tolist()
    target = Target(model)
    target.prefill(ids[:context], capacity=context + max(sizes))
    cuda = target.device.type == "cuda"
    trees = {}
    for n in sizes:
        tree = Tree()
        tree.add_path(ids[context + 1 : context + n], [0.5] * (n - 1), "profile", ROOT)
        trees[n] = tree
    times: dict[int, list[float]] = {n: [] for n in sizes}
    for rep in range(repeats + 1):  # the first round warms up and is not counted
        for n in sizes:
            if cuda:
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            target.verify(ids[context], trees[n])
            if cuda:
                torch.cuda.synchronize()
            elapsed = time.perf_counter() - t0
            target.keep([], n)
            if rep:
                times[n].append(elapsed)
    return times


def summarize(times: dict[int, list[float]]) -> tuple[dict[int, float], float]:
    """The latency curve from raw timings, and how noisy they were.

    Other work on the machine only ever adds time, so each size's fastest run is its cost estimate; a wider
    forward never costs less than a narrower one, so the curve is made non-decreasing. Noise: the largest
    (median - fastest) / fastest over the sizes.
    """
    curve, noise, floor = {}, 0.0, 0.0
    for n in sorted(times):
        fastest = min(times[n])
        noise = max(noise, (median(times[n]) - fastest) / fastest if fastest > 0 else 0.0)
        floor = max(floor, fastest)
        curve[n] = floor
    return curve, noise


def load_profile(path: Path) -> dict | None:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(data, dict) or data.get("version") != PROFILE_VERSION or not data.get("latency_s"):
        return None
    return data


def profile(loaded: Loaded, refresh: bool = False, quiet: bool = False) -> dict:
    """The latency profile of ``loaded`` on its device: read from the cache, else measured and cached
    (``refresh`` or ``GRAFT_REPROFILE=1`` measures again)."""
    device = loaded.device
    dtype = precision(loaded.model)
    label = device_label(device)
    path = profile_path(model_checksum(loaded.path), label, dtype)
    if not refresh and os.environ.get("GRAFT_REPROFILE") != "1":
        cached = load_profile(path)
        if cached is not None:
            return cached
    sizes = defaults_for(device).profile_sizes
    if not quiet:
        print(f"graft: measuring verification latency of {loaded.spec} on {label} (once; cached in {path})",
              file=sys.stderr)
    t0 = time.perf_counter()
    raw = measure(loaded.model, sizes, repeats=REPEATS)
    latency, noise = summarize(raw)
    per_context = [0.0, 0.0]
    reach = limits(loaded.model.config).reach
    if reach is None or reach >= LONG_CONTEXT + max(LONG_SIZES):
        long, _ = summarize(measure(loaded.model, LONG_SIZES, context=LONG_CONTEXT, repeats=REPEATS))
        one, wide = (long[n] - latency[n] for n in LONG_SIZES)  # what LONG_CONTEXT - CONTEXT tokens added
        span = LONG_CONTEXT - CONTEXT
        per_context = [max(0.0, one / span), max(0.0, (wide - one) / (span * (LONG_SIZES[1] - 1)))]
    if noise > NOISY and not quiet:
        print(f"graft: warning: the machine was busy while measuring (timings spread {noise:.0%}); the profile "
              f"may be off: remeasure later with GRAFT_REPROFILE=1", file=sys.stderr)
    data = {
        "version": PROFILE_VERSION,
        "model": str(loaded.spec),
        "path": str(loaded.path),
        "device": label,
        "dtype": dtype,
        "context_tokens": CONTEXT,
        "repeats": REPEATS,
        "torch": torch.__version__,
        "measured_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "measure_s": round(time.perf_counter() - t0, 2),
        "latency_s": {str(n): round(t, 6) for n, t in latency.items()},
        # seconds each context token past context_tokens adds: to every forward, and per fed token after the first
        "per_context_s": [float(f"{x:.4g}") for x in per_context],
        "noise": round(noise, 3),
        "timings_s": {str(n): [round(t, 6) for t in ts] for n, ts in raw.items()},
    }
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        write_text_atomic(path, json.dumps(data, indent=1) + "\n")
    except OSError as e:
        print(f"graft: warning: cannot cache the latency profile in {path}: {e.strerror or e}", file=sys.stderr)
    return data


def latency_model(loaded: Loaded, refresh: bool = False, quiet: bool = False) -> LatencyModel:
    data = profile(loaded, refresh, quiet)
    return LatencyModel({int(n): float(t) for n, t in data["latency_s"].items()}, tuple(data["per_context_s"]),
                        int(data["context_tokens"]))


class AutoBudget:
    """A proposer whose every tree is cut to the size with the best expected accepted tokens per second. It wraps
    another and is that proposer to the loop: what the inner one needs from a step is what this one needs."""

    def __init__(self, inner: Proposer, latency: LatencyModel) -> None:
        self.inner, self.latency = inner, latency
        self.recorder = inner.recorder  # one clock and one set of counters for both
        self.drafter = inner.drafter
        self.chosen: list[int] = []  # tree nodes kept per step, across every generation

    @property
    def needs(self) -> Needs:
        return self.inner.needs

    def start(self, prompt: Sequence[int], prefill: Step, capacity: int) -> None:
        self.inner.start(prompt, prefill, capacity)

    def propose(self, context: Sequence[int]) -> Tree:
        self.latency.context = len(context)
        clock = self.recorder.clock
        t0 = clock()
        tree = self.inner.propose(context)
        spent = clock() - t0  # seconds, as the measured curve: the step's time, so each node costs less of it
        scores = [tree.nodes[i].score for i in tree.ranked()]
        keep = self.latency.best_count(0, 0.0, scores, overhead=spent)
        self.chosen.append(keep)
        self.recorder.stats.budgets.append(keep)
        return tree.select(keep)

    def observe(self, step: Step) -> None:
        self.inner.observe(step)

    def price(self, scores: Sequence[float]) -> int:
        return self.latency.best_count(0, 0.0, scores)

    def close(self) -> None:
        self.inner.close()
