"""The CUDA path, checked end to end in one run: everything a user runs, on one GPU, in bf16, in under 10 minutes.

1. Every method as ``graft generate`` builds it (``methods.build`` over ``loading.load_model``): ar, pld,
   recycling, rest (a suffix-array datastore built from this run's own plain-decoding output, so it retrieves),
   dense and pruned with a draft model, graft with a draft model, Graft(TAIL) (``--chain``), an EAGLE-3 head with
   random weights, and transformers' own ``generate`` (hf). The target is a synthetic Llama (random weights from a
   config, saved and loaded like any downloaded model); the draft model is the target itself, so drafts are long
   and mostly accepted, and the head is random, so its trees are mostly wrong: both sides of verification run.
   * greedy: every method's tokens against ar's with the tie-aware report of ``graft bench``
     (graft_cli/runtime/lossless.py): a difference where ar's top two logits were within the dtype's tolerance is a
     floating-point tie (shown with its margin), any other one fails;
   * sampling: the distribution of the first speculated token (the second generated) against the exact one
     computed from the target, by total variation below the 99.9% quantile of pure sampling noise.
2. FlashAttention prefill (when flash-attn is installed) against SDPA's logits.
3. Verification latency by tree size (1 to 256 tokens) of a Llama-3-8B-shaped model, random weights from a
   config, over a 512-token KV cache; then trees whose size and cache length change every call, as decoding
   runs them, under graft's attention kernels and with cuDNN's attention allowed (it plans per shape:
   graft_cli/runtime/attention_kernels.py). Before it, which SDPA kernel a tree's masked attention gets.
4. Host milliseconds and device reads per step of graft with a draft model at the CUDA defaults, the forwards
   played back (benchmarks/host_time/).
5. The fixed-shape path (``--graphs``, benchmarks/gpu_fixed.py): the card's bandwidth, capture time per bucket,
   plain decoding against its bandwidth floor, verification by tree size, an 8B-shaped EAGLE-3 head level,
   draft and whole step, each compiled (``--graphs compiled``), captured and eager, with the top ten kernels of a
   one-token step and a head level of each (``profile.txt``), host time and reads per step with a head, and
   every method's tokens against the eager path in fp32.

    python -m benchmarks.gpu_check            # on a CUDA machine; prints one table, exit 1 if a check failed
    python -m benchmarks.gpu_check --smoke    # the same code on the CPU with tiny models (CI: under a minute)
    python -m benchmarks.gpu_check --skip sampling,latency --out DIR   # a shorter second look, kept in DIR

In bf16 the synthetic model's logits (around 16-32, where bf16 steps by 0.125) tie often, and a tie ends what
the greedy check can compare. So a bf16/fp16 run follows with the same greedy check in fp32 on the same device
(``exact``: 4 prompts of 64 tokens), where ties are rare and every token is compared. ``--out DIR`` keeps
``gpu_check.json``: the table, each method's whole summary (steps, draft forwards, nodes verified and accepted by
source, seconds by phase) and the host row's phases, for finding where a step's time went.

Without CUDA and without --smoke it says so and exits 0.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from contextlib import nullcontext
from dataclasses import replace
from pathlib import Path
from typing import Callable

import numpy as np
import torch
from torch.nn.attention import SDPBackend

from graft_cli.core import DEFAULT_SCHEDULE
from graft_cli.method import builder as methods
from graft_cli.runtime.attention_kernels import attention_kernels
from graft_cli.bench.datasets import Question
from graft_cli.bench.execution import Conversation, execute, warm_up
from graft_cli.bench.results import summarize
from graft_cli.bench.runners import EngineRunner, PeerRunner, shared_models
from graft_cli.runtime.engine import decode
from graft_cli.runtime.loading import load_model, stop_ids
from graft_cli.runtime.lossless import MarginTarget, report
from graft_cli.method.config import MethodConfig, configure
from graft_cli.core.defaults import CUDA
from graft_cli.runtime.sampling import Sampling, probabilities
from graft_cli.bench.synthetic import method_configs, random_tree, synthetic_models, text_store
from graft_cli.runtime.target import Target

from benchmarks import gpu_fixed
from benchmarks.gpu_setup import GPU, SMOKE, Scale, Table, big_model, syncer
from benchmarks.host_time import measure

PARTS = ("greedy", "sampling", "exact", "latency", "host", "fixed", "tokens", "compiled")  # what --skip leaves out
# (tokens: the fixed-shape path's host and token rows on the tiny models; compiled: its compiled rows)
EXACT = (4, 64)  # prompts and new tokens of the fp32 greedy pass that follows a bf16/fp16 run
SAMPLING = Sampling(temperature=0.8, top_k=8, top_p=0.95)  # every part of the distribution code, a small support


# --- 1. every method ---------------------------------------------------------------------------------------------
def synthetic_dirs(root: Path, scale: Scale) -> tuple[Path, Path]:
    """The target (saved like a download, with a word-level tokenizer) and a random EAGLE-3 head for it."""
    return synthetic_models(root, scale.vocab, scale.hidden, scale.layers)


def prompts(scale: Scale) -> list[Question]:
    """Prompts with a repeated stretch (a b a), so that prompt lookup has something to find."""
    rng = np.random.default_rng(0)
    out = []
    for i in range(scale.prompts):
        a, b = rng.integers(0, scale.vocab, 8).tolist(), rng.integers(0, scale.vocab, 8).tolist()
        out.append(Question(i, "synthetic", [" ".join(f"t{t}" for t in a + b + a)]))
    return out


def runners(loaded, configs: dict[str, MethodConfig]) -> list:
    """The bench's own runners: ar records its margins, hf is transformers' generate."""
    stop, device = stop_ids(loaded), loaded.device
    out = []
    with shared_models(loaded):  # the draft model is the target: one copy
        for name, config in configs.items():
            target = MarginTarget(loaded.model) if name == "ar" else Target(loaded.model)
            out.append(EngineRunner(name, target, lambda c=config: methods.build(c, loaded), stop, device))
    out.append(PeerRunner("hf", loaded.model, stop, device))
    return out


def build_store(root: Path, target: Path, records: list[dict], questions: list[Question]) -> Path:
    """A suffix-array datastore over the prompts and ar's answers (what REST retrieves from)."""
    return text_store(root, target, [q.turns[0] for q in questions] + [t["text"] for r in records for t in r["turns"]])


def check_greedy(table: Table, loaded, conv, questions, scale: Scale, names: list[str], runs: list) -> None:
    records = execute(questions, runs, conv, scale.new_tokens)
    dtype = str(next(loaded.model.parameters()).dtype).replace("torch.", "")
    lossless = report(records, dtype)
    summary = summarize(records, names, ["synthetic"])["overall"]
    table.details.setdefault("greedy", {})[dtype] = summary
    for name in names:
        found = [d for d in lossless["mismatches"] + lossless["ties"] if d["method"] == name]
        ties = [f"q{d['question_id']} token {d['position']} margin {d['ar_margin']:.3g}" for d in found if d["tie"]]
        bad = [f"q{d['question_id']} token {d['position']} margin {d['ar_margin']}" for d in found if not d["tie"]]
        s = summary[name]
        steps = max(1, s["steps"])
        figures = (f"{len(questions) - len(found)}/{len(questions)} identical, {len(ties)} ties"
                   f"{' (' + '; '.join(ties) + ')' if ties else ''}{', MISMATCH ' + '; '.join(bad) if bad else ''}; "
                   f"τ {s['tau']:.2f}, {s['speedup'] or 0:.2f}x ar, {1000 * s['wall_s'] / steps:.2f} ms/step, "
                   f"propose {1000 * s['time_s'].get('propose', 0.0) / steps:.2f} ms/step")
        table.add(f"greedy {name} ({dtype})" if name != "ar" else f"greedy ar ({dtype}, the reference)",
                  not bad if name != "ar" else None, figures)


def first_speculated(model, ids: list[int], sampling: Sampling) -> np.ndarray:
    """The exact distribution of the second generated token (the first one a tree speculates): the sum over the
    first token t of p(t) p(. | t), in one batched forward."""
    device = next(model.parameters()).device
    with torch.inference_mode():
        p1 = probabilities(model(torch.tensor([ids], device=device)).logits[0, -1], sampling).float()
        vocab = p1.shape[0]
        batch = torch.cat([torch.tensor(ids, device=device).expand(vocab, -1),
                           torch.arange(vocab, device=device)[:, None]], dim=1)
        p2 = torch.stack([probabilities(row, sampling).float() for row in model(batch).logits[:, -1]])
    return (p1[:, None] * p2).sum(0).double().cpu().numpy()


def check_sampling(table: Table, loaded, conv, questions, scale: Scale, runs: list) -> None:
    sampling = SAMPLING
    ids = conv.encode([{"role": "user", "content": questions[0].turns[0]}])
    exact = first_speculated(loaded.model, ids, sampling)
    exact /= exact.sum()
    rng = np.random.default_rng(0)
    noise = [0.5 * np.abs(rng.multinomial(scale.samples, exact) / scale.samples - exact).sum() for _ in range(2000)]
    bound = float(np.quantile(noise, 0.999))
    for runner in runs:
        if not isinstance(runner, EngineRunner):
            continue  # transformers' generate is checked under greedy only
        counts = np.zeros_like(exact)
        for seed in range(scale.samples):  # one seed per run: a seed fixes the sampled text (graft_cli/sampling.Noise)
            out = [t for step in decode(runner.target, runner.proposer, ids, sampling, 2, set(), seed) for t in step]
            counts[out[1]] += 1
        tv = 0.5 * np.abs(counts / scale.samples - exact).sum()
        table.add(f"sampling {runner.name}", tv <= bound,
                  f"total variation {tv:.3f} of the first speculated token from the exact distribution "
                  f"({scale.samples} runs; noise alone stays under {bound:.3f} 99.9% of the time)")


def check_methods(table: Table, device: str, dtype: str, scale: Scale, skip: set[str], flash: bool = True) -> None:
    with tempfile.TemporaryDirectory(prefix="graft-gpu-check-") as tmp:
        root = Path(tmp)
        target_dir, head = synthetic_dirs(root, scale)
        loaded = load_model(str(target_dir), device, dtype)
        conv = Conversation(loaded.tokenizer, stop_ids(loaded))
        questions = prompts(scale)
        first = runners(loaded, {"ar": configure("ar")})
        store = build_store(root, target_dir, execute(questions, first, conv, scale.new_tokens), questions)
        runs = runners(loaded, method_configs(target_dir, head, store, scale.depth))
        names = [r.name for r in runs]
        warm_up(runs, conv)
        if "greedy" not in skip:
            check_greedy(table, loaded, conv, questions, scale, names, runs)
        if "sampling" not in skip:
            check_sampling(table, loaded, conv, questions, scale, runs)
        if flash:
            check_flash_prefill(table, loaded.model)
        for r in runs:
            if isinstance(r, EngineRunner):
                r.close()


# --- 2. FlashAttention prefill -----------------------------------------------------------------------------------
def check_flash_prefill(table: Table, model) -> None:
    target = Target(model)
    if target.prefill_attention is None:
        table.add("flash prefill", None, "not used (needs CUDA, fp16/bf16 and the flash-attn package)")
        return
    prompt = list(range(1, 64))
    flash = target.prefill(prompt).logits[-1].float()
    target.prefill_attention = None
    sdpa = target.prefill(prompt).logits[-1].float()
    diff = float((flash - sdpa).abs().max())
    table.add("flash prefill", diff < 1.0, f"max |logit difference| against SDPA {diff:.4f}")


# --- 3. verification latency -------------------------------------------------------------------------------------
def check_latency(table: Table, shape: dict, device: str, dtype: torch.dtype, scale: Scale) -> None:
    model = big_model(shape, device, dtype)
    config, target, rng = model.config, Target(model), np.random.default_rng(0)
    target.prefill(rng.integers(0, config.vocab_size, scale.past).tolist(), capacity=scale.past + max(scale.sizes))
    sync = syncer(device)
    params = sum(p.numel() for p in model.parameters()) / 1e9
    base = None
    for size in scale.sizes:
        times = []
        for _ in range(scale.repeats + 1):  # the first run warms up
            tree = random_tree(size - 1, config.vocab_size, rng)
            sync()
            t0 = time.perf_counter()
            target.verify(int(rng.integers(config.vocab_size)), tree)
            sync()
            times.append(time.perf_counter() - t0)
            target.keep([], size)  # drop the whole fed block: the cache is back to `past`
        ms = statistics.median(times[1:]) * 1000
        base = base or ms
        table.add(f"verify {size} tokens", None, f"{ms:.2f} ms, {ms / base:.2f}x one token ({params:.2f}B params, "
                  f"{str(dtype).replace('torch.', '')}, {scale.past}-token cache, median of {scale.repeats})")
    check_new_shapes(table, target, config.vocab_size, scale, sync)
    del model, target


def check_new_shapes(table: Table, target: Target, vocab: int, scale: Scale, sync: Callable[[], None]) -> None:
    """Verification as decoding runs it: the tree's size and the cache's length change every call, so a kernel
    that plans per problem shape (cuDNN's attention) plans every call. Timed under graft's kernels
    (graft_cli/runtime/attention_kernels.py) and again with cuDNN's attention allowed, on the same shapes."""
    largest = max(scale.sizes) // 4
    past = list(range(1, scale.past + 1))
    medians = []
    for kernels in (target.kernels, nullcontext()):
        target.kernels, rng, times = kernels, np.random.default_rng(1), []
        target.prefill(past, capacity=scale.past + (2 * scale.repeats + 1) * (largest + 1))
        for _ in range(2 * scale.repeats):
            size = int(rng.integers(2, largest + 1))
            tree = random_tree(size - 1, vocab, rng)
            sync()
            t0 = time.perf_counter()
            target.verify(int(rng.integers(vocab)), tree)
            sync()
            times.append(time.perf_counter() - t0)
            target.keep(list(range(int(rng.integers(1, size + 1)))), size)  # a step's accepted rows stay
        medians.append(statistics.median(times) * 1000)
    table.add("verify, a new shape each call", None,
              f"{medians[0]:.2f} ms under graft's attention kernels, {medians[1]:.2f} ms with cuDNN's attention "
              f"allowed ({medians[1] / medians[0]:.2f}x; trees of 2-{largest} tokens, median of {2 * scale.repeats})")


def check_attention_kernel(table: Table, device: str, dtype: torch.dtype) -> None:
    """Which SDPA kernel a tree's masked attention gets: torch's own choice, and under graft's switch."""
    def named(choice: int) -> str:
        return SDPBackend(choice).name.lower().replace("_attention", "")

    q = torch.randn(1, 8, 7, 64, device=device, dtype=dtype)
    kv = torch.randn(1, 8, 519, 64, device=device, dtype=dtype)
    mask = torch.zeros(1, 1, 7, 519, device=device, dtype=dtype)
    default = torch._fused_sdp_choice(q, kv, kv, mask)
    with attention_kernels(torch.device(device)):
        graft = torch._fused_sdp_choice(q, kv, kv, mask)
    name = str(dtype).replace("torch.", "")
    table.add("attention kernel", None if device == "cpu" else graft != SDPBackend.CUDNN_ATTENTION.value,
              f"a 7-row tree mask over 519 keys in {name}: torch picks {named(default)}, graft's "
              f"forwards {named(graft)}")


# --- 4. host overhead --------------------------------------------------------------------------------------------
def check_host_overhead(table: Table, device: str, dtype: str, scale: Scale) -> None:
    """Host milliseconds and device reads per step of graft with a draft model at the CUDA defaults (budget 60,
    depth 7, draft top-k 8, prompt lookup and recycling), the forwards played back (benchmarks/host_time/):
    on a GPU, what the host costs each verification. Reported, not checked: a speed is a benchmark's."""
    with tempfile.TemporaryDirectory(prefix="graft-gpu-check-") as tmp:
        target_dir, _ = synthetic_dirs(Path(tmp), scale)
        loaded = load_model(str(target_dir), device, dtype)
        conv = Conversation(loaded.tokenizer, stop_ids(loaded))
        ids = [conv.encode([{"role": "user", "content": q.turns[0]}]) for q in prompts(scale)]
        config = configure("graft", budget=60, retrievers=["prompt", "recycling"], draft=str(target_dir), depth=7,
                           draft_top_k=8, prune_at=f"{DEFAULT_SCHEDULE},floor:{CUDA.prune_floor}")
        m = measure(loaded, ids, config, scale.new_tokens, repeat=1 if device == "cpu" else 3)
    def per_step(counts, unit: float = 1.0) -> dict[str, float]:
        return {phase: round(unit * value / m.steps, 4) for phase, value in counts.items()}

    table.details["host"] = {"steps": m.steps, "ms": per_step(m.time, 1e3), "torch_calls": per_step(m.calls),
                             "reads": per_step(m.reads)}
    table.add("host ms/step", None, f"{m.host_ms:.2f} ms, {m.syncs:.2f} device reads per step (graft, draft model, "
              f"{m.steps} steps, forwards played back; targets 1.5 ms and 3 reads)")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="the same checks on the CPU with tiny models")
    parser.add_argument("--device", default=None, help="default: cuda (cpu with --smoke)")
    parser.add_argument("--dtype", choices=("bfloat16", "float16", "float32"), default=None,
                        help="default: bfloat16 on the GPU, float32 with --smoke")
    parser.add_argument("--prompts", type=int, default=None, help="prompts per method (default: 8; 3 with --smoke)")
    parser.add_argument("--new-tokens", type=int, default=None, help="per prompt (default: 128; 24 with --smoke)")
    parser.add_argument("--skip", default="", help=f"checks to leave out, comma-separated: {','.join(PARTS)}")
    parser.add_argument("--out", type=Path, default=None, help="a folder to keep gpu_check.json and profile.txt in")
    parser.add_argument("--compiled-sizes", default=",".join(map(str, gpu_fixed.COMPILED)),
                        help="verification sizes the compiled rows compile (each a compilation of the whole model)")
    args = parser.parse_args(argv)
    skip = {s for s in args.skip.split(",") if s}
    if skip - set(PARTS):
        parser.error(f"--skip: unknown {', '.join(sorted(skip - set(PARTS)))} (choose from {', '.join(PARTS)})")
    device = args.device or ("cpu" if args.smoke else "cuda")
    if device.startswith("cuda") and not torch.cuda.is_available():
        print("no CUDA device here: nothing to check (run this on a machine with a GPU, or give --smoke)")
        return 0
    scale = SMOKE if args.smoke else GPU
    scale = replace(scale, dtype=args.dtype or scale.dtype, prompts=args.prompts or scale.prompts,
                    new_tokens=args.new_tokens or scale.new_tokens)
    dtype = scale.dtype
    if args.smoke:
        torch.set_num_threads(1)  # tiny models run fastest on one thread
    table, started, compiled = Table(), time.perf_counter(), compiled_sizes(args.compiled_sizes)
    try:
        run_parts(table, device, scale, skip, compiled)
    except KeyboardInterrupt:  # `timeout -s INT`: what was measured is still printed and kept
        table.add("stopped", False, f"interrupted after {time.perf_counter() - started:.0f} s")
    name = torch.cuda.get_device_name() if device.startswith("cuda") else "CPU"
    title = (f"gpu_check{' --smoke' if args.smoke else ''} on {name} ({device}, {dtype}): "
             f"{'all checks passed' if table.ok else 'A CHECK FAILED'} in {time.perf_counter() - started:.0f} s")
    table.print(title)
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        kept = {"title": title, "argv": sys.argv[1:] if argv is None else argv,
                "torch": torch.__version__, "rows": table.rows, **table.details}
        write(args.out / "gpu_check.json", json.dumps(kept, indent=1))
        write(args.out / "profile.txt", "".join(f"== {name}\n{text}\n" for name, text in
                                                table.details.get("profile", {}).items()))
    return 0 if table.ok else 1


def run_parts(table: Table, device: str, scale: Scale, skip: set[str], compiled: tuple[int, ...]) -> None:
    """Every part not in ``skip``, in order, into ``table``."""
    dtype = scale.dtype
    if not {"greedy", "sampling"} <= skip:
        check_methods(table, device, dtype, scale, skip)
    if "exact" not in skip and dtype != "float32":  # bf16's coarse logits tie often: fp32 checks every token
        exact = replace(scale, dtype="float32", prompts=min(scale.prompts, EXACT[0]),
                        new_tokens=min(scale.new_tokens, EXACT[1]))
        check_methods(table, device, "float32", exact, skip | {"sampling"}, flash=False)
    if "latency" not in skip:
        check_attention_kernel(table, device, getattr(torch, dtype))
        check_latency(table, scale.latency_shape, device, getattr(torch, dtype), scale)
    if "host" not in skip:
        check_host_overhead(table, device, dtype, scale)
    if "fixed" not in skip:  # the fixed-shape path: benchmarks/gpu_fixed.py
        gpu_fixed.check_all(table, device, dtype, scale, [[int(word[1:]) for word in q.turns[0].split()]
                                                          for q in prompts(scale)],
                            () if "compiled" in skip else compiled, "tokens" not in skip)


def compiled_sizes(text: str) -> tuple[int, ...]:
    """``--compiled-sizes``: bucket sizes of the fixed-shape path, comma-separated."""
    sizes = tuple(int(word) for word in text.split(",") if word.strip().isdigit())
    if not sizes or set(sizes) - set(gpu_fixed.SIZES):
        raise SystemExit(f"gpu_check: --compiled-sizes takes some of {','.join(map(str, gpu_fixed.SIZES))}")
    return sizes


def write(path: Path, text: str) -> None:
    """``text`` into ``path`` whole (a run stopped part-way leaves the last file, never half of one)."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    tmp.replace(path)


if __name__ == "__main__":
    raise SystemExit(main())
