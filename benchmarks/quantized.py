"""``--dtype q4`` against bf16 on one model: plain decoding and graft (and graft with a draft model, where one is
named) over the GGUF's 4-bit weights and over bf16 copies of the same GGUF, on the same Spec-Bench questions as
the same tokens, greedy, one thread, side by side in one process.

    python -m benchmarks.quantized [--model qwen2.5-coder-1.5b-instruct] [--draft qwen2.5-coder-0.5b-instruct]
                                   [--questions 4] [-n 64] [--threads 1] [--out FILE]

The questions are benchmarks/llama_cpp.py's (the first of each Spec-Bench category). They are interleaved: every
run takes question 1, then every run question 2, so a machine whose speed drifts slows them alike. Per run:
decoding's tokens per second after the first token, the prefill's, and on how many questions its tokens are
plain decoding's at the same precision (the contract); per precision the seconds its model took to load. The
memory each precision holds is ``python -m benchmarks.startup --dtype ...``'s (one model per process).
"""

from __future__ import annotations

import argparse
import json
import sys
import time

from benchmarks.llama_cpp import graft_run, prompts
from benchmarks.llama_cpp_output import Row

PRECISIONS = ("bfloat16", "q4")


def generators(model: str, draft: str | None) -> tuple[dict, dict]:
    """Every (method, precision) run's Generator, warmed once, and each precision's load seconds."""
    from graft_cli.api.generator import Generator
    from graft_cli.method.config import configure
    from graft_cli.runtime.loading import load_model

    methods = {"ar": configure("ar"), "graft": configure("graft")}
    if draft:
        methods["graft + draft"] = configure("graft", draft=draft)
    runs, loads = {}, {}
    for precision in PRECISIONS:
        started = time.perf_counter()
        loaded = load_model(model, "cpu", precision, forward="auto")
        loads[precision] = round(time.perf_counter() - started, 2)
        for name, config in methods.items():
            runs[(name, precision)] = Generator(loaded, config, prefix_cache=0)
    for generator in runs.values():
        generator.generate("Say hello.", max_new_tokens=8)
    return runs, loads


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="qwen2.5-coder-1.5b-instruct")
    parser.add_argument("--draft", default=None, help="a draft model for a third method, graft with --draft")
    parser.add_argument("--questions", type=int, default=4)
    parser.add_argument("-n", type=int, default=64)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", default=None, help="write the results as JSON here too")
    args = parser.parse_args()
    from graft_cli.core.cpu_units import cpu_units
    from graft_cli.core.threads import use_threads

    use_threads(args.threads)
    runs, loads = generators(args.model, args.draft)
    chosen = prompts(next(iter(runs.values())).loaded.tokenizer, "spec-bench", args.questions)
    rows = {key: Row(key[0], key[1], args.threads) for key in runs}
    for prompt in chosen:
        ids = {}
        for key, generator in runs.items():
            timing, _, ids[key] = graft_run(generator, prompt, args.n)
            rows[key].timings.append(timing)
        for (name, precision), row in rows.items():
            row.same_text += ids[(name, precision)] == ids[("ar", precision)]
        print(f"  question {prompt.question_id} ({prompt.category}) done", file=sys.stderr, flush=True)
    print(f"{cpu_units().summary()}; {args.model}, {len(chosen)} questions, {args.n} new tokens, "
          f"{args.threads} thread(s); load seconds {loads}")
    print("| method | precision | decode tok/s | vs ar same precision | prefill tok/s | tokens = ar's |")
    print("|---|---|---|---|---|---|")
    for (name, precision), row in rows.items():
        ar = rows[("ar", precision)].decode_tok_s
        print(f"| {name} | {precision} | {row.decode_tok_s:.1f} | {row.decode_tok_s / ar:.2f}x | "
              f"{row.prefill_tok_s:.0f} | {row.same_text}/{len(chosen)} |")
    if args.out:
        result = {"cpu": cpu_units().summary(), "model": args.model, "draft": args.draft, "loads_s": loads,
                  "rows": [r.as_dict() for r in rows.values()]}
        with open(args.out, "w") as file:
            json.dump(result, file, indent=1)


if __name__ == "__main__":
    main()
