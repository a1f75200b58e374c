"""`make demo`'s last step: one prompt generated with plain decoding (`ar`) and with Graft, side by side in one
process, so the speed-up is measured on the same machine at the same moment and the two texts can be compared.
Both run on a fixed number of threads (one by default): with torch's default, a machine shared with another busy
process slowed plain decoding 27-fold and the printed ratio meant nothing. The model runs in ``--dtype auto``'s
precision (bf16 on a CPU with AMX or AVX512-BF16), where a difference at a floating-point tie is reported as one,
with plain decoding's margin there, as ``graft bench`` does (graft_cli/runtime/lossless.py).

    python -m benchmarks.demo --datastore stdlib-demo --prompt "..."
"""

from __future__ import annotations

import argparse

import torch

from graft_cli.method import builder as methods
from graft_cli.method.config import MethodConfig, configure
from graft_cli.runtime.engine import decode
from graft_cli.runtime.loading import encode, load_model, stop_ids
from graft_cli.runtime.lossless import MarginTarget, first_difference, tie_tolerance
from graft_cli.runtime.sampling import Sampling
from graft_cli.core import Stats
from graft_cli.core.threads import use_threads
from graft_cli.runtime.target import Target


def generate(loaded, config: MethodConfig, ids: list[int], n: int,
             target: Target | None = None) -> tuple[list[int], Stats]:
    stats = Stats()
    proposer = methods.build(config, loaded)
    target = target or Target(loaded.model)
    steps = decode(target, proposer, ids, Sampling(), n, stop_ids(loaded), None, stats)
    tokens = [t for step in steps for t in step]
    proposer.close()
    return tokens, stats


def verdict(graft: list[int], ar: list[int], margins: list[float], dtype: torch.dtype) -> tuple[str, bool]:
    """The line that says whether graft's text is plain decoding's, and whether that keeps the contract."""
    tolerance = tie_tolerance(dtype)
    diff = first_difference(graft, ar, margins, tolerance)
    if diff is None:
        return "identical text: yes", True
    if diff.tie:
        return (f"identical text: up to a floating-point tie in {str(dtype).replace('torch.', '')} at token "
                f"{diff.position} (plain decoding's top-2 logit margin there {diff.margin:.4g} <= {tolerance:g})"), True
    return "identical text: NO", False


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--datastore", default=None)
    parser.add_argument("--prompt", required=True)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--threads", type=int, default=1, help="CPU threads of both runs (default: 1)")
    args = parser.parse_args()
    use_threads(args.threads)
    loaded = load_model(args.model, "auto", forward="auto")  # the forward graft generate runs
    ids = encode(loaded.tokenizer, args.prompt)
    with torch.inference_mode():
        generate(loaded, configure("ar"), ids, 8)  # warm-up: the first forwards are slower
        reference = MarginTarget(loaded.model)
        ar, ar_stats = generate(loaded, configure("ar"), ids, args.max_new_tokens, reference)
        graft, graft_stats = generate(loaded, configure("graft", datastore=args.datastore), ids, args.max_new_tokens)
    text = loaded.tokenizer.decode(graft, skip_special_tokens=True)
    print(f"prompt: {args.prompt}\n\n{text}\n")
    for name, stats in (("ar", ar_stats), ("graft", graft_stats)):
        print(f"{name:>5}: {stats.new_tokens} tokens in {stats.wall:.2f} s, {stats.tokens_per_s:.1f} tokens/s"
              f" ({stats.tau:.2f} tokens per forward)")
    print(f"speed-up: {graft_stats.tokens_per_s / ar_stats.tokens_per_s:.2f}x")
    line, kept = verdict(graft, ar, reference.margins(), next(loaded.model.parameters()).dtype)
    print(line)
    if not kept:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
