"""benchmarks/gpu_check.py's rows for the fixed-shape path (graft_cli/runtime/fixed_target.py): what it is worth
on a GPU and that it changes no token. ``--smoke`` runs the same code on a CPU, where nothing is captured.

- ``bandwidth``: the card's streaming rate, measured in this run (a large copy: bytes read and written per second);
- ``fixed capture``: seconds to capture each verification bucket of an 8B-shaped model (Llama-3.1-8B's shapes,
  random weights in the run's dtype), the start-up cost of ``--graphs``;
- ``fixed plain decoding``: ms per token on the fixed-shape path, as a multiple of the weights' bytes over that
  bandwidth (its floor), and the eager path's beside it;
- ``fixed verify N tokens``: a step (verification, acceptance, compaction, the one read) of 1, 16, 32, 64 and 128
  tokens, against one token;
- ``fixed head level``, ``fixed draft`` and ``fixed EAGLE-3 step``: an 8B-shaped EAGLE-3 head's level of top-k
  rows, a whole draft of depth 6, and that draft with a verification of 64 tokens against a plain step;
- ``fixed host ms/step``: host time not overlapped with the device and blocking reads per step of graft with an
  EAGLE-3 head on the path (benchmarks/host_time/'s replay, its captured regions excluded);
- ``fixed-shape METHOD (float32)``: every method on the path (its draft levels included) against the eager path,
  token for token, on the tiny synthetic models.

The latency rows run each path side by side: captured (``--graphs on``), eager (``off``) and compiled
(``compiled``: graft_cli/runtime/compiled.py; the ``compiled`` buckets only), with the top ten kernels of a
one-token step and of a head level of each kept in ``table.details["profile"]`` (gpu_check's ``profile.txt``).

The rows need graft installed where they run (``pip install --no-deps .``: the methods find their drafters
through its entry points). gpu_profile.py shows where the device time of a step and of a head level goes.
"""

from __future__ import annotations

import sys
import tempfile
from dataclasses import replace
from functools import partial
from pathlib import Path
from typing import Callable

import numpy as np
import torch

from graft_cli.method import builder as methods
from graft_cli.method.config import configure
from graft_cli.bench.runners import shared_models
from graft_cli.core import DEFAULT_SCHEDULE, Needs, Step, Tree
from graft_cli.core.defaults import CUDA
from graft_cli.drafting import GraftProposer
from graft_cli.heads import Eagle3Head, HeadConfig, expected_shapes
from graft_cli.runtime.engine import decode
from graft_cli.runtime.compiled import Compiler, Compiling
from graft_cli.runtime.fixed_target import FixedShapeTarget, drafter_shapes, make_target
from graft_cli.runtime.graphs import CudaCapture
from graft_cli.runtime.loading import load_model
from graft_cli.runtime.sampling import Sampling
from graft_cli.runtime.target import Target
from graft_cli.bench.synthetic import method_configs, random_tree, synthetic_models, text_store
from plugins.eagle3 import Eagle3Drafter

from benchmarks.gpu_setup import Scale, Table, big_model, kernel_table, syncer, timed
from benchmarks.host_time import measure

SIZES = (1, 16, 32, 64, 128)  # tokens a verification feeds, root included
COMPILED = (1, 64)  # ... on the compiled path by default: on a GPU host each is an inductor compile of the model
VARIANTS = ("on", "off", "compiled")  # --graphs: each row's paths, side by side (the compiled last: the slowest
# to start, so that a run stopped while it compiles has already printed the others' progress)
NAMES = {"compiled": "compiled", "on": "captured", "off": "eager"}
GPU_COPY, SMOKE_COPY = 1 << 30, 1 << 24  # bytes the bandwidth is measured over


def bandwidth(table: Table, device: str) -> float:
    """Bytes per second a large device-to-device copy moves (read plus written)."""
    size = GPU_COPY if device.startswith("cuda") else SMOKE_COPY
    src = torch.empty(size, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    ms = timed(lambda: dst.copy_(src), syncer(device), 10)
    rate = 2 * size / (ms / 1000)
    table.add("bandwidth", None, f"{rate / 1e9:.0f} GB/s streaming ({size >> 20} MiB copied, median of 10)")
    return rate


def fixed_target(model: torch.nn.Module, switch: str, backend: str) -> Target:
    """The target ``--graphs switch`` makes (``compiled``: its regions compiled by ``backend``)."""
    if switch != "compiled":
        return make_target(model, switch)
    capture = CudaCapture() if next(model.parameters()).device.type == "cuda" else None
    return FixedShapeTarget(model, capture=Compiling(capture, Compiler(backend)))


def compile_note(target: Target) -> str:
    """What the compiled rows must say when compiling failed (they then time the uncompiled path)."""
    compiler = target.graphs.compiler if isinstance(target, FixedShapeTarget) else None
    return f" (COMPILING FAILED: {compiler.broken})" if compiler is not None and compiler.broken else ""


def check_fixed_latency(table: Table, model: torch.nn.Module, device: str, scale: Scale, rate: float,
                        compiled: tuple[int, ...]) -> None:
    """Capture time per bucket, plain decoding against its floor, verification by tree size: captured, eager, and
    compiled (only the ``compiled`` sizes, none: not run; each is a compilation of the whole model)."""
    sync, rng, past, repeats = syncer(device), np.random.default_rng(0), scale.past, scale.repeats
    vocab = model.config.vocab_size
    prompt = rng.integers(0, vocab, past).tolist()
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    floor = weights / rate * 1000
    figures, notes = {}, {}
    for switch in VARIANTS if compiled else VARIANTS[:2]:
        target = fixed_target(model, switch, scale.compiler)
        target.prefill(prompt, capacity=past + 4 * 64 + 256)
        step = verify_step(target)
        sizes = compiled if switch == "compiled" else SIZES
        figures[switch] = {size: timed(lambda: step(random_tree(size - 1, vocab, rng), reset=True), sync, repeats)
                           for size in sizes}
        figures[switch]["plain"] = timed(lambda: [step(Tree()) for _ in range(16)], sync, repeats) / 16
        ms, kernels = kernel_table(partial(step, Tree(), reset=True), device)
        table.details.setdefault("profile", {})[f"one-token step, {NAMES[switch]}: {ms:.3f} ms"] = kernels
        notes[switch] = compile_note(target)
        print(f"  {NAMES[switch]} ms: {figures[switch]}", file=sys.stderr, flush=True)  # a run stopped part-way
        if switch == "on":
            captured = {key[1]: s for key, s in target.graphs.seconds.items() if key[0] == "verify"}
            shown = ", ".join(f"{size}: {captured[size]:.2f} s" for size in SIZES if size in captured)
            table.add("fixed capture", None, f"{shown or 'nothing captured (no CUDA)'} per verification bucket; "
                      f"{len(target.graphs.failed)} failed")
    on, off, fused = figures["on"], figures["off"], figures.get("compiled", {})
    shown = f"{fused['plain']:.2f} ms = {fused['plain'] / floor:.2f}x{notes['compiled']}" if fused else "not run"
    table.add("fixed plain decoding", None, f"{on['plain']:.2f} ms/token = {on['plain'] / floor:.2f}x the floor "
              f"({weights / 1e9:.2f} GB of weights at the measured bandwidth: {floor:.2f} ms); compiled {shown}; "
              f"eager {off['plain']:.2f}")
    for size in SIZES:
        shown = f"{fused[size]:.2f} ms, {fused[size] / fused[1]:.2f}x one" if size in fused else "not compiled"
        table.add(f"fixed verify {size} tokens", None, f"{on[size]:.2f} ms, {on[size] / on[1]:.2f}x one token; "
                  f"compiled {shown}; eager {off[size]:.2f} ms ({past}-token cache, a step with acceptance and "
                  f"its read)")


def verify_step(target: Target) -> Callable[..., object]:
    """One verification step of ``target`` as decoding runs it (acceptance, compaction and the read included);
    ``reset``: the cache back to its length before, so that a timing loop keeps one context."""
    rule = target.rule(Sampling(), None, Needs(), 0)

    def step(tree: Tree, reset: bool = False) -> object:
        length = target.length
        out = target.step([7], tree, rule)
        if reset:
            target.length = length
            target.cache.settle(length)
        return out
    return step


def random_head(target: torch.nn.Module, draft_vocab: int) -> Eagle3Head:
    """An EAGLE-3 head shaped for ``target`` (its width, heads and MLP), random weights on its device and dtype."""
    c = target.config
    embed = target.get_input_embeddings().weight
    cfg = HeadConfig(c.hidden_size, c.num_attention_heads, c.num_key_value_heads,
                     c.hidden_size // c.num_attention_heads, c.intermediate_size, c.vocab_size, draft_vocab, 1e4,
                     1e-5, "silu")
    gen = torch.Generator(device=embed.device).manual_seed(0)
    weights = {}
    for name, shape in expected_shapes(cfg, c.hidden_size).items():
        noise = torch.randn(shape, generator=gen, device=embed.device, dtype=embed.dtype)
        weights[name] = torch.ones_like(noise) if name.endswith("norm.weight") else noise / shape[-1] ** 0.5
    return Eagle3Head(cfg, weights, embed, torch.zeros(draft_vocab, dtype=torch.long, device=embed.device))


def head_drafter(model: torch.nn.Module, head: Eagle3Head, capture: object, past: int,
                 top_k: int) -> Eagle3Drafter:
    """A dense drafter of depth 6 over ``head`` that has read a ``past``-token prompt (random target features),
    its levels at fixed shapes recorded by ``capture`` (:func:`drafter_shapes`' capture; False: eager levels)."""
    drafter = Eagle3Drafter(head, model, depth=6, top_k=top_k)
    if capture is not False:
        drafter.fix_levels(capture)
    device, width = head.device, model.config.hidden_size
    hidden = [torch.randn((past, width), device=device, dtype=head.dtype) for _ in range(drafter.num_states)]
    prompt = [i % model.config.vocab_size for i in range(past)]
    drafter.start(prompt, Step(prompt + [1], [1], Tree(), list(range(past)), None, hidden), past + 4096)
    drafter.draft(prompt + [1], 60)  # the prompt read: every later draft feeds one row first
    drafter.observe(Step(prompt + [1, 2], [2], Tree(), [0], None, [h[:1] for h in hidden]))
    return drafter


def check_head(table: Table, model: torch.nn.Module, device: str, scale: Scale, draft_vocab: int, top_k: int,
               compiled: bool) -> None:
    """An 8B-shaped head's level of ``top_k`` rows, a whole draft of depth 6, and a whole EAGLE-3 step (that
    draft, then a verification of 64 tokens): captured, eager, and (``compiled``) compiled."""
    sync, head, past, repeats = syncer(device), random_head(model, draft_vocab), scale.past, scale.repeats
    figures, notes, rng = {}, {"compiled": ""}, np.random.default_rng(1)
    variants = VARIANTS if compiled else VARIANTS[:2]
    for switch in variants:
        target = fixed_target(model, switch, scale.compiler)
        target.prefill(rng.integers(0, model.config.vocab_size, past).tolist(), capacity=past + 4 * 64 + 256)
        shapes = drafter_shapes(target)
        head.reset(past + 4096)
        drafter = head_drafter(model, head, False if shapes is None else shapes.capture, past, top_k)
        features, context = drafter.pending_features, [i % model.config.vocab_size for i in range(past)] + [1, 2]
        step, tree = verify_step(target), random_tree(63, model.config.vocab_size, rng)

        def draft() -> None:
            drafter.pending_features, drafter.pending_tokens = list(features), [3]
            drafter.draft(context, 60)
            drafter._drop_tree([])

        whole = timed(draft, sync, repeats)
        both = timed(lambda: (draft(), step(tree, reset=True)), sync, repeats)
        level = partial(first_level, drafter, head)
        with torch.inference_mode():  # as the draft's own levels run
            figures[switch] = (timed(level, sync, repeats), whole, both,
                               timed(lambda: step(Tree(), reset=True), sync, repeats))
        ms, kernels = kernel_table(level, device)
        table.details.setdefault("profile", {})[f"head level, {NAMES[switch]}: {ms:.3f} ms"] = kernels
        notes[switch] = compile_note(target)
        print(f"  {NAMES[switch]} head ms: {figures[switch]}", file=sys.stderr, flush=True)
    params = sum(w.numel() for w in head.w.values()) / 1e9
    shown = {part: "; ".join(f"{NAMES[s]} {figures[s][part]:.3f} ms" for s in variants) for part in range(3)}
    table.add("fixed head level", None, f"{shown[0]} for {top_k} rows ({params:.2f}B-parameter head, "
              f"{past}-token context){notes['compiled']}")
    table.add("fixed draft", None, f"{shown[1]} for a whole draft of depth 6 (top-k {top_k}, levels on the "
              f"fixed-shape path)")
    table.add("fixed EAGLE-3 step", None, f"{shown[2]} for that draft and a verification of 64 tokens; "
              + "; ".join(f"{NAMES[s]} {figures[s][2] / figures[s][3]:.2f}x its plain step" for s in variants))


def check_host(table: Table, device: str, dtype: str, target_dir: Path, head_dir: Path, prompts: list[list[int]],
               new_tokens: int) -> None:
    """Host time not overlapped with the device, and blocking reads, per step of graft with an EAGLE-3 head on
    the fixed-shape path at the CUDA defaults (benchmarks/host_time/)."""
    loaded = load_model(str(target_dir), device, dtype)
    config = configure("graft", budget=60, retrievers=["prompt", "recycling"], draft=f"eagle3:{head_dir}", depth=7,
                       draft_top_k=8, prune_at=f"{DEFAULT_SCHEDULE},floor:{CUDA.prune_floor}")
    m = measure(loaded, prompts, config, new_tokens, repeat=1 if device == "cpu" else 3, fixed=True)
    table.add("fixed host ms/step", None, f"{m.exposed_ms:.2f} ms not overlapped ({m.host_ms:.2f} ms with the draft "
              f"queued ahead, which the verification overlaps), {m.syncs:.2f} blocking reads per step (graft with an "
              f"EAGLE-3 head, {m.steps} steps; targets 0.5 ms and 1 read)")


def check_methods(table: Table, device: str, target_dir: Path, head_dir: Path, root: Path, prompts: list[list[int]],
                  new_tokens: int, depth: int | None) -> None:
    """Every method on the fixed-shape path (its draft levels too) against the eager path, greedy, in fp32."""
    loaded = load_model(str(target_dir), device, "float32")
    reference = [_tokens(Target(loaded.model), GraftProposer(0), p, new_tokens) for p in prompts]
    store = text_store(root, target_dir, [" ".join(f"t{t}" for t in p + out) for p, out in zip(prompts, reference)])
    with shared_models(loaded):
        for name, config in method_configs(target_dir, head_dir, store, depth).items():
            config = replace(config, curve="cuda" if device.startswith("cuda") else "cpu")
            same, fixed = 0, make_target(loaded.model, "on")
            for prompt in prompts:
                eager = _tokens(Target(loaded.model), methods.build(config, loaded), prompt, new_tokens)
                same += eager == _tokens(fixed, methods.build(config, loaded, fixed), prompt, new_tokens)
            graphs = fixed.graphs
            table.add(f"fixed-shape {name} (float32)", same == len(prompts),
                      f"{same}/{len(prompts)} token-identical to the eager path; {len(graphs.captured)} graphs "
                      f"captured, {len(graphs.failed)} failed")


def _tokens(target: Target, proposer, prompt: list[int], n: int) -> list[int]:
    return [t for step in decode(target, proposer, prompt, Sampling(), n, set()) for t in step]


def check_all(table: Table, device: str, dtype: str, scale: Scale, prompts: list[list[int]],
              compiled: tuple[int, ...] = COMPILED, tokens: bool = True) -> None:
    """Every row above, within the check's budget (``scale``: gpu_check's GPU or smoke sizes; ``compiled``: the
    verification sizes the compiled rows compile; ``tokens``: the host and token rows on the tiny models too)."""
    rate = bandwidth(table, device)
    model = big_model(scale.latency_shape, device, getattr(torch, dtype))
    check_fixed_latency(table, model, device, scale, rate, compiled)
    vocab = 32000 if device.startswith("cuda") else scale.latency_shape["vocab_size"] // 2
    check_head(table, model, device, scale, vocab, 8, bool(compiled))
    del model
    if not tokens:
        return
    with tempfile.TemporaryDirectory(prefix="graft-gpu-fixed-") as tmp:
        target_dir, head_dir = synthetic_models(Path(tmp), scale.vocab, scale.hidden, scale.layers)
        check_host(table, device, dtype, target_dir, head_dir, prompts, scale.new_tokens)
        check_methods(table, device, target_dir, head_dir, Path(tmp), prompts[:4], min(scale.new_tokens, 64),
                      scale.depth)


def first_level(drafter: Eagle3Drafter, head: Eagle3Head) -> None:
    """The tree's first level again, the head's cache cropped back after it."""
    rows, device = drafter.top_k, head.device
    drafter._grow(torch.arange(rows, device=device), torch.ones((rows, head.cfg.hidden), device=device,
                  dtype=head.dtype), 2, torch.ones((rows, rows), dtype=torch.bool, device=device).tril())
    head.crop(drafter.committed)
