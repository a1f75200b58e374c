"""What low precision buys on this CPU: a linear layer of the default model's shapes (and the 1.5B Qwen's largest)
at 1, 16, 64 and 512 rows through the kernels graft runs it on (oneDNN's packed fp32 and, where the CPU has bf16
units, packed bf16; graft_cli/runtime/cpu_linear.py), 4-bit weights with per-32 scales (``--dtype q4``,
graft_cli/models/four_bit.py), 8-bit ones (Q8_0) as that kernel keeps them, and weight-only int8, then plain decoding and graft in fp32 and bf16 on one prompt
through graft's own forward, with whether graft's tokens are plain decoding's in the same dtype (or where they
part at a floating-point tie, and its margin), then a bf16 prompt's prefill through the row-invariant attention
graft runs (graft_cli/models/invariant.py) against torch's flash kernel, with whether each gives the same rows
when the prompt is split elsewhere (as a prefix-cache hit splits it), and one layer's attention of a
512-token chunk after long contexts (the heads of SmolLM2 and of the 1.5B Qwen) through both.

    python -m benchmarks.cpu_precision [--threads 1] [-n 32] [--parts products,decoding,prefill,attention]

The CPU's matrix units are printed first (graft_cli/core/cpu_units.py): bf16 pays only with AMX or AVX512-BF16.
Over a dataset: ``graft bench --dtype bfloat16`` lists every tie with its margin.
"""

from __future__ import annotations

import argparse
import time

import torch

from graft_cli.core import Stats
from graft_cli.core.cpu_units import cpu_units
from graft_cli.core.threads import use_threads
from graft_cli.method import builder as methods
from graft_cli.method.config import configure
from graft_cli.models.four_bit import four_bit_linear
from graft_cli.runtime.engine import decode
from graft_cli.runtime.cpu_linear import use_cpu_linears
from graft_cli.runtime.loading import encode, load_model, stop_ids
from graft_cli.runtime.lossless import MarginTarget, first_difference, tie_tolerance
from graft_cli.runtime.sampling import Sampling
from graft_cli.runtime.target import Target

SHAPES = {"attention 576x576": (576, 576), "mlp up 576x1536": (1536, 576), "lm head 576x49152": (49152, 576),
          "qwen-1.5b mlp 1536x17920": (17920, 1536)}  # the 1.5B Qwen's gate and up projections, stacked
ROWS = (1, 16, 64, 512)
PROMPT = "Write a Python function that reads a JSON file and returns its contents."


def seconds(fn, repeats: int = 20, budget: float = 1.0) -> float:
    """The best of up to ``repeats`` timings of ``fn()`` (after one warm-up; fewer once ``budget`` seconds are
    spent): the least disturbed by other work."""
    fn()
    best, spent = float("inf"), 0.0
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        took = time.perf_counter() - t0
        best, spent = min(best, took), spent + took
        if spent > budget:
            break
    return best


def four_bit(out: int, inp: int, planes: int = 1) -> torch.nn.Module:
    """A linear over random 4-bit values and block scales, as ``--dtype q4`` runs a GGUF's (bf16 inputs);
    ``planes`` 2: an 8-bit weight (Q8_0) as it keeps one."""
    columns = planes * inp
    parts = (torch.randint(0, 256, (out, columns // 2), dtype=torch.uint8), torch.rand(out, columns // 32) / 100,
             -torch.rand(out, columns // 32) / 20)
    return four_bit_linear([parts], None, inp)


def products() -> None:
    print(f"{'layer':<20} {'rows':>5} {'fp32 ms':>8} {'bf16/fp32':>10} {'q4/fp32':>8} {'q8/fp32':>8} {'int8w/fp32':>11}")
    for name, (out, inp) in SHAPES.items():
        layer, half = torch.nn.Linear(inp, out, bias=False), torch.nn.Linear(inp, out, bias=False).bfloat16()
        use_cpu_linears(layer, pack=True)
        use_cpu_linears(half, pack=True)  # packed where the CPU has bf16 units, else left plain as graft leaves it
        w = layer.weight.detach()
        scales = w.abs().amax(1) / 127
        wq = (w / scales[:, None]).round().to(torch.int8)
        q4, q8 = four_bit(out, inp), four_bit(out, inp, planes=2)
        for rows in ROWS:
            x = torch.randn(rows, inp)
            xb = x.bfloat16()
            fp32 = seconds(lambda: layer(x))
            bf16 = seconds(lambda: half(xb))
            four, eight = seconds(lambda: q4(xb)), seconds(lambda: q8(xb))
            int8 = seconds(lambda: torch._weight_int8pack_mm(x, wq, scales))
            print(f"{name:<20} {rows:>5} {fp32 * 1e3:>8.3f} {bf16 / fp32:>9.2f}x {four / fp32:>7.2f}x {eight / fp32:>7.2f}x "
                  f"{int8 / fp32:>10.2f}x", flush=True)


def run(loaded, method: str, ids: list[int], n: int) -> tuple[list[int], float, list[float]]:
    """One greedy generation after a 4-token warm-up: its tokens, tokens/s, and (for ``ar``) the margin between
    the top two logits at each token, what tells a floating-point tie from a mismatch."""
    target = MarginTarget(loaded.model) if method == "ar" else Target(loaded.model)
    proposer = methods.build(configure(method), loaded, target)
    for warm_up in (True, False):
        stats = Stats()
        steps = decode(target, proposer, ids, Sampling(), 4 if warm_up else n, stop_ids(loaded), None, stats)
        tokens = [t for step in steps for t in step]
    proposer.close()
    return tokens, stats.tokens_per_s, target.margins() if method == "ar" else []


def decoding(n: int) -> None:
    """ar and graft in fp32 and bf16; graft's bf16 tokens judged against plain bf16 decoding's as graft bench
    judges them (graft_cli/runtime/lossless.py)."""
    for dtype in ("float32", "bfloat16"):
        loaded = load_model("smollm2-135m-instruct", "cpu", dtype, forward="auto")
        ids = encode(loaded.tokenizer, PROMPT)
        with torch.inference_mode():
            ar, ar_speed, margins = run(loaded, "ar", ids, n)
            graft, graft_speed, _ = run(loaded, "graft", ids, n)
        diff = first_difference(graft, ar, margins, tie_tolerance(dtype))
        verdict = "same tokens" if diff is None else \
            f"{'tie' if diff.tie else 'MISMATCH'} at token {diff.position} (ar's top-2 margin {diff.margin})"
        print(f"{dtype:>9}: ar {ar_speed:6.2f} tok/s, graft {graft_speed:6.2f} tok/s; {verdict}", flush=True)


def prefill(lengths: tuple[int, ...] = (500, 1500, 4000)) -> None:
    """A bf16 prompt of each length prefilled in graft's 512-token chunks, its attention row-invariant and then
    torch's flash kernel (the layout withheld from every chunk); each also split at two thirds of its length, its
    rows then compared bit for bit with the whole prompt's."""
    from unittest import mock

    from graft_cli.models import decoder
    from graft_cli.runtime.kv_cache import PositionCache
    from graft_cli.runtime.target import PREFILL_CHUNK

    loaded = load_model("smollm2-135m-instruct", "cpu", "bfloat16", forward="own")
    model, text = loaded.model, " ".join(PROMPT for _ in range(600))

    def rows(ids: list[int], split: int) -> tuple[torch.Tensor, float]:
        """The cache's rows for ``ids`` fed as ``[0, split)`` then the rest, each in chunks; and the seconds."""
        cache = PositionCache(model.config.num_hidden_layers)
        cache.reserve(len(ids))
        t0 = time.perf_counter()
        for first, last in ((0, split), (split, len(ids))):
            for start in range(first, last, PREFILL_CHUNK):
                model(input_ids=torch.tensor([ids[start : min(last, start + PREFILL_CHUNK)]]), cache=cache,
                      logits_to_keep=1, visible=start)
        return cache.block[..., : len(ids), :], time.perf_counter() - t0

    invariant_layout = decoder.layout_for

    def flash(x: torch.Tensor, mask: torch.Tensor | None, visible: int | None, past: int):
        """No layout for a prompt's chunk: its attention goes to SDPA, as before the layout covered prompts."""
        return None if mask is None and x.shape[1] > 1 else invariant_layout(x, mask, visible, past)

    print(f"{'tokens':>6} {'invariant s':>12} {'flash s':>8} {'ratio':>6}  same rows when split: invariant / flash")
    tokens = loaded.tokenizer.encode(text)
    rows(tokens[:600], 300)  # a warm-up: first calls pay for kernels' set-up
    for length in lengths:
        ids = tokens[:length]
        whole, took = rows(ids, length)  # split at the end: not split
        split, _ = rows(ids, length * 2 // 3)
        with mock.patch.object(decoder, "layout_for", flash):
            flash_whole, flash_took = rows(ids, length)
            flash_split, _ = rows(ids, length * 2 // 3)
        print(f"{length:>6} {took:>12.2f} {flash_took:>8.2f} {took / flash_took:>5.2f}x  "
              f"{torch.equal(whole, split)} / {torch.equal(flash_whole, flash_split)}", flush=True)


def attention(pasts: tuple[int, ...] = (4000, 8000, 16000, 30000)) -> None:
    """One layer's bf16 attention of a 512-row chunk after ``pasts`` cached keys: the row-invariant path graft runs
    against torch's flash kernel, for SmolLM2's heads (9 over 3, 64 wide) and the 1.5B Qwen's (12 over 2, 128)."""
    from graft_cli.models.attention import attend
    from graft_cli.models.invariant import causal_rows

    print(f"{'heads':>10} {'past keys':>9} {'invariant ms':>13} {'flash ms':>9} {'ratio':>6}")
    for heads, kv_heads, dim in ((9, 3, 64), (12, 2, 128)):
        for past in pasts:
            query = torch.randn(1, heads, 512, dim).bfloat16()
            key, value = (torch.randn(1, kv_heads, past + 512, dim).bfloat16() for _ in range(2))
            ours = seconds(lambda: causal_rows(query, key, value, dim**-0.5), repeats=3, budget=3.0)
            flash = seconds(lambda: attend(query, key, value, None, past, dim**-0.5), repeats=3, budget=3.0)
            print(f"{heads:>4}/{kv_heads}x{dim:<3} {past:>9} {ours * 1e3:>13.0f} {flash * 1e3:>9.0f} "
                  f"{ours / flash:>5.2f}x", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("-n", type=int, default=32, help="tokens decoded per run")
    parser.add_argument("--parts", default="products,decoding,prefill,attention",
                        help="any of products, decoding, prefill, attention")
    args = parser.parse_args()
    use_threads(args.threads)
    print(f"{cpu_units().summary()}; torch {torch.__version__} ({torch.backends.cpu.get_cpu_capability()}), "
          f"{args.threads} thread(s)")
    if "products" in args.parts:
        with torch.inference_mode():
            products()
    if "decoding" in args.parts:
        decoding(args.n)
    if "prefill" in args.parts:
        with torch.inference_mode():
            prefill()
    if "attention" in args.parts:
        with torch.inference_mode():
            attention()


if __name__ == "__main__":
    main()
