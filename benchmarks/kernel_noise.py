"""How far plain decoding's logits and tree verification's drift apart, per dtype: the figure behind the tie
tolerances of graft_cli/lossless.py.

Greedy-decodes N tokens one at a time (one token, no mask: plain decoding's kernels), then feeds the same tokens
again as ONE chain-shaped tree after the prompt (many tokens under a tree mask: verification's kernels), and
compares the logits row by row: the largest deviation, the median per row, the smallest top-2 margin met, and how
many argmaxes flipped.

    python benchmarks/kernel_noise.py --model smollm2-135m-instruct --dtypes float32,bfloat16,float16
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from graft_cli.loading import encode, load_model  # noqa: E402
from graft_cli.target import Target  # noqa: E402
from graft_cli.tree import ROOT, Tree  # noqa: E402

PROMPT = "Write a short story about a robot who learns to paint, in five sentences."


def noise(spec: str, device: str, dtype: str, n: int) -> str:
    loaded = load_model(spec, device, dtype)
    ids = encode(loaded.tokenizer, PROMPT)
    plain = Target(loaded.model)
    rows = [plain.prefill(ids).logits[-1].float()]
    tokens = [int(rows[-1].argmax())]
    for _ in range(n - 1):
        rows.append(plain.verify(tokens[-1], Tree()).logits[-1].float())
        tokens.append(int(rows[-1].argmax()))
    chain, parent = Tree(), ROOT
    for token in tokens[1:]:
        parent = chain.add(parent, token, "chain", 0.5)
    tree = Target(loaded.model)
    tree.prefill(ids)
    got = tree.verify(tokens[0], chain).logits.float()[:-1]  # row i: after tokens[:i + 1]
    want = torch.stack(rows[1:])
    deviation = (got - want).abs()
    top = want.topk(2, dim=-1).values
    return (f"{dtype}: max |dlogit| {float(deviation.max()):.3g}, median of the per-row max "
            f"{float(deviation.max(-1).values.median()):.3g}, smallest top-2 margin {float((top[:, 0] - top[:, 1]).min()):.3g}, "
            f"argmax flips {int((got.argmax(-1) != want.argmax(-1)).sum())}/{n - 1}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtypes", default="float32,bfloat16,float16")
    parser.add_argument("--tokens", type=int, default=48)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    for dtype in args.dtypes.split(","):
        print(noise(args.model, args.device, dtype, args.tokens), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
