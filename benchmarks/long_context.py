"""Long-context bench datasets from real text found on every machine: Python standard-library modules.

Writes the JSONL ``graft bench --dataset`` reads: "explain this module and list its public functions" over a
module's source cut to about 2K, 4K and 8K tokens of the model's chat-templated prompt. The 8K set stays inside
SmolLM2's 8192 positions with 256 new tokens and a CPU tree (``graft_cli/runtime/limits.py``). long_steps.py and
prefill.py time the model on the same text.

    python -m benchmarks.long_context --out /tmp/long-context [--sizes 16k=16000]
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import json
from pathlib import Path

from datastores.atomic import write_text_atomic
from graft_cli.runtime.loading import encode, load_model

MODULES = ("argparse", "difflib", "configparser", "calendar", "inspect", "tarfile", "typing", "pathlib")
SIZES = {"2k": 2048, "4k": 4096, "8k": 7800}  # 8k: 7800 + 256 new tokens + a 16-node tree < 8192 positions
ASK = "Explain what this module does and list its public functions.\n\n```python\n{}\n```"


def module_source(name: str) -> list[str]:
    """The lines of a standard-library module's source: real code, the same on every machine."""
    return inspect.getsource(importlib.import_module(name)).splitlines()


def cut(tokenizer, lines: list[str], tokens: int) -> tuple[str, int]:
    """The prompt over the longest prefix of ``lines`` whose templated prompt has at most ``tokens`` tokens."""
    lo, hi = 1, len(lines)
    while lo < hi:  # binary search on the line count
        mid = (lo + hi + 1) // 2
        if len(encode(tokenizer, ASK.format("\n".join(lines[:mid])))) <= tokens:
            lo = mid
        else:
            hi = mid - 1
    prompt = ASK.format("\n".join(lines[:lo]))
    return prompt, len(encode(tokenizer, prompt))


def datasets(model: str, out: Path, sizes: dict[str, int]) -> None:
    """One ``long-context-LABEL.jsonl`` per size under ``out``, a prompt per module long enough for it."""
    tokenizer = load_model(model, device="cpu").tokenizer
    out.mkdir(parents=True, exist_ok=True)
    sources = {name: module_source(name) for name in MODULES}
    for label, tokens in sizes.items():
        records = []
        for name, lines in sources.items():
            prompt, length = cut(tokenizer, lines, tokens)
            if length < 0.9 * tokens:  # the module is too short for this size
                continue
            records.append({"question_id": f"{name}-{label}", "category": f"long-{label}", "turns": [prompt]})
            print(f"{label} {name}: {length} tokens")
        write_text_atomic(out / f"long-context-{label}.jsonl", "".join(json.dumps(r) + "\n" for r in records))
        print(f"wrote {out / f'long-context-{label}.jsonl'} ({len(records)} prompts)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--out", type=Path, default=Path("long-context"))
    parser.add_argument("--sizes", default="", help="LABEL=TOKENS,... instead of 2k, 4k and 8k (e.g. 16k=16000 "
                        "for a model with a longer window)")
    args = parser.parse_args()
    sizes = {label: int(n) for label, n in (item.split("=") for item in args.sizes.split(","))} if args.sizes else SIZES
    datasets(args.model, args.out, sizes)


if __name__ == "__main__":
    main()
