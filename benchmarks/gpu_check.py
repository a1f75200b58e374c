"""The CUDA path, checked in one run on a machine with a GPU.

1. Lossless on the GPU: tiny random Llama and Qwen2 models in bf16, greedy output of random candidate trees
   (deep, wide, degenerate) against plain decoding, token for token, with SDPA tree verification.
2. FlashAttention prefill (when flash-attn is installed): the prefill's logits against SDPA's.
3. Verification latency against tree size (1 to 128 tokens) of a Llama-3-8B-shaped model with random weights
   built from a config (no download), over a 512-token KV cache: a short table.

    python benchmarks/gpu_check.py                 # on a CUDA machine
    python benchmarks/gpu_check.py --device cpu --shape tiny --sizes 1,4,16   # a smoke run anywhere

Without CUDA (and without --device cpu) it says so and exits 0.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch
from transformers import AutoModelForCausalLM, LlamaConfig

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from graft_cli.engine import decode  # noqa: E402
from graft_cli.graft import GraftProposer  # noqa: E402
from graft_cli.sampling import Sampling  # noqa: E402
from graft_cli.target import Target  # noqa: E402
from graft_cli.tree import ROOT, Tree  # noqa: E402
from tests.test_engine import OracleTreeProposer  # noqa: E402
from tests.tiny import VOCAB, tiny_model  # noqa: E402

SHAPES = {
    "llama3-8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                      num_key_value_heads=8, vocab_size=128256, rope_theta=500000.0),
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=VOCAB),
}


def tokens(model, proposer, prompt, n):
    return [t for step in decode(Target(model), proposer, prompt, Sampling(), n, set()) for t in step]


def check_lossless(device: str, dtype: torch.dtype) -> bool:
    ok = True
    for kind in ("llama", "qwen2"):
        same = total = 0
        for seed in range(4):
            model = tiny_model(kind, seed=seed).to(device=device, dtype=dtype)
            prompt = np.random.default_rng(seed).integers(0, VOCAB, 12).tolist()
            truth = tokens(model, GraftProposer(0), prompt, 48)
            for shape in ("deep", "wide", "empty", "random"):
                total += 1
                same += tokens(model, OracleTreeProposer(truth, len(prompt), seed, shape), prompt, 48) == truth
        print(f"lossless {kind} {dtype}: {same}/{total} runs token-identical to plain decoding")
        ok &= same == total
    return ok


def check_flash_prefill(device: str, dtype: torch.dtype) -> None:
    model = tiny_model("llama").to(device=device, dtype=dtype)
    target = Target(model)
    if target.prefill_attention is None:
        print("flash prefill: not used (needs CUDA, fp16/bf16 and the flash-attn package)")
        return
    prompt = list(range(1, 64))
    flash = target.prefill(prompt).logits[-1].float()
    target.prefill_attention = None
    sdpa = target.prefill(prompt).logits[-1].float()
    print(f"flash prefill: max |logit difference| against SDPA {float((flash - sdpa).abs().max()):.4f}")


def random_tree(size: int, vocab: int, rng: np.random.Generator) -> Tree:
    tree = Tree()
    while len(tree) < size:
        parent = ROOT if not len(tree) or rng.random() < 0.2 else int(rng.integers(len(tree)))
        tree.add(parent, int(rng.integers(vocab)), "bench", 0.5)
    return tree


def latency_table(shape: str, device: str, dtype: torch.dtype, sizes: list[int], past: int, repeats: int) -> None:
    config = LlamaConfig(**SHAPES[shape], max_position_embeddings=4096, attn_implementation="sdpa")
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype).eval()
    target, rng = Target(model), np.random.default_rng(0)
    target.prefill(rng.integers(0, config.vocab_size, past).tolist())
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    print(f"\nverification latency, {shape} ({sum(p.numel() for p in model.parameters()) / 1e9:.2f}B params, "
          f"{dtype}, {device}), {past}-token cache, median of {repeats}")
    print("| tree tokens (root included) | ms | vs 1 token |\n|---|---|---|")
    base = None
    for size in sizes:
        times = []
        for _ in range(repeats + 1):  # the first run warms up
            tree = random_tree(size - 1, config.vocab_size, rng)
            sync()
            t0 = time.perf_counter()
            target.verify(int(rng.integers(config.vocab_size)), tree)
            sync()
            times.append(time.perf_counter() - t0)
            target.keep([], size)  # drop the whole fed block: the cache is back to `past`
        ms = statistics.median(times[1:]) * 1000
        base = base or ms
        print(f"| {size} | {ms:.2f} | {ms / base:.2f}x |")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--shape", choices=sorted(SHAPES), default="llama3-8b")
    parser.add_argument("--sizes", default="1,2,4,8,16,32,48,64,96,128")
    parser.add_argument("--past", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=10)
    args = parser.parse_args(argv)
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print("no CUDA device here: nothing to check (run this on a machine with a GPU)")
        return 0
    dtype = torch.bfloat16 if args.device.startswith("cuda") else torch.float32
    ok = check_lossless(args.device, dtype)
    check_flash_prefill(args.device, dtype)
    latency_table(args.shape, args.device, dtype, [int(s) for s in args.sizes.split(",")], args.past, args.repeats)
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
