"""Structured output side by side: 24 extraction and tool-call tasks (benchmarks/structured_tasks.jsonl), each
answered by `ar` under its grammar, graft under it, and graft free, in one process over one loaded model.

    python -m benchmarks.structured --out DIR [--model smollm2-135m-instruct] [--draft MODEL] [--threads 1]
        [--max-new-tokens 128] [--limit N] [--dtype float32|mixed] [--forward auto|own|transformers]

Per configuration: tokens per second (all tokens over all seconds; and over the seconds after the prefill, which
is the same work for all three while their answers differ in length), tau (tokens per target forward), the share of
tokens drafted because the grammar forced them, the grammar's host time per step, and valid answers (JSON of the
task's schema; a call of one of its functions with the arguments it requires). Whether graft's constrained tokens
are ar's, task by task. A tool task goes through the chat template's tools where it knows them (Qwen2.5's, in its
tags), else its functions are listed in the prompt and the call is one bare JSON object. Tasks run in turn, the
three configurations rotating which goes first, so a shared machine's drift hits them alike. The model runs as
``graft generate`` runs it on a CPU (``--forward auto``: graft's own forward for Llama and Qwen2).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from time import perf_counter

import torch

from graft_cli.api import Generator
from graft_cli.method.config import configure
from graft_cli.runtime.loading import load_model
from graft_cli.server.tools import Tools, parse_calls

TASKS = Path(__file__).with_name("structured_tasks.jsonl")
CONFIGS = ("ar constrained", "graft constrained", "graft free")


def request(task: dict, tagged: bool | None) -> tuple[list[dict], dict]:
    """A task's messages and the generation settings of its constrained form (``tagged``: None when the template
    knows no tools)."""
    if task["kind"] == "extraction":
        ask = f"{task['prompt']}\nAnswer with one JSON object of this schema: {json.dumps(task['schema'])}"
        return [{"role": "user", "content": ask}], {"json_schema": task["schema"]}
    tools = Tools(tuple(task["tools"]), "required", bool(tagged))
    if tagged is None:
        listed = json.dumps(task["tools"])
        ask = f"{task['prompt']}\nCall one of these functions: {listed}\nReply with JSON: {{\"name\": ..., \"arguments\": {{...}}}}"
        return [{"role": "user", "content": ask}], {"grammar": tools.grammar()}
    return [{"role": "user", "content": task["prompt"]}], {"grammar": tools.grammar(), "tools": tools.rendered()}


def valid(task: dict, text: str) -> bool:
    """A whole answer of the task's shape: the schema's required keys (no others), or one call of a listed
    function with its required arguments."""
    if task["kind"] == "extraction":
        try:
            value = json.loads(text)
        except json.JSONDecodeError:
            return False
        return isinstance(value, dict) and set(value) == set(task["schema"]["required"])
    calls = parse_calls(text)
    functions = {f["name"]: f for f in task["tools"]}
    return len(calls) == 1 and calls[0]["function"]["name"] in functions and set(
        json.loads(calls[0]["function"]["arguments"])) >= set(functions[calls[0]["function"]["name"]]["parameters"]["required"])


def run(generators: dict, task: dict, turn: int, tagged: bool | None, max_new_tokens: int) -> dict:
    messages, constrained = request(task, tagged)
    free = {key: value for key, value in constrained.items() if key == "tools"}
    settings = {"ar constrained": ("ar", constrained), "graft constrained": ("graft", constrained),
                "graft free": ("graft", free)}
    order = CONFIGS[turn % 3:] + CONFIGS[: turn % 3]
    out = {}
    for name in order:
        method, extra = settings[name]
        began = perf_counter()  # the whole call: the request's check (its grammar compiled) and encoding too
        done = generators[method].generate(messages=messages, max_new_tokens=max_new_tokens, **extra)
        request_s = perf_counter() - began
        stats = done.stats
        out[name] = {"tokens": done.token_ids, "text": done.text, "finish": done.finish_reason,
                     "new_tokens": stats.new_tokens, "wall_s": request_s, "before_s": request_s - stats.wall,
                     "phases": dict(stats.times), "steps": stats.steps,
                     "prefill_s": stats.times.get("prefill", 0.0),
                     "forced": stats.accepted.get("forced", 0), "copied": stats.accepted.get("copied", 0),
                     "grammar_s": stats.times.get("grammar", 0.0),
                     "valid": valid(task, done.text)}
    return out


def summary(results: list[dict]) -> list[dict]:
    rows = []
    for name in CONFIGS:
        runs = [r[name] for r in results]
        tokens, wall, steps, prefill = (sum(x[key] for x in runs) for key in ("new_tokens", "wall_s", "steps",
                                                                              "prefill_s"))
        rows.append({"config": name, "tokens_per_s": tokens / wall, "decode_per_s": tokens / (wall - prefill),
                     "tau": tokens / max(steps, 1),
                     "forced_share": sum(x["forced"] for x in runs) / tokens,
                     "copied_share": sum(x["copied"] for x in runs) / tokens,
                     "grammar_ms_per_step": 1000 * sum(x["grammar_s"] for x in runs) / max(steps, 1),
                     "valid": sum(x["valid"] for x in runs), "tasks": len(runs), "tokens": tokens, "wall_s": wall})
    return rows


def table(rows: list[dict], same: int, total: int) -> str:
    lines = ["| configuration | tok/s | decode tok/s | tau | forced share | copied share | grammar ms/step | valid |",
             "|---|---|---|---|---|---|---|---|"]
    lines += [f"| {r['config']} | {r['tokens_per_s']:.2f} | {r['decode_per_s']:.2f} | {r['tau']:.2f} | "
              f"{r['forced_share']:.0%} | {r['copied_share']:.0%} | "
              f"{r['grammar_ms_per_step']:.2f} | {r['valid']}/{r['tasks']} |" for r in rows]
    speed = {r["config"]: r["tokens_per_s"] for r in rows}
    wall = {r["config"]: r["wall_s"] for r in rows}
    decode = {r["config"]: r["decode_per_s"] for r in rows}
    lines.append(f"\ngraft constrained: {speed['graft constrained'] / speed['ar constrained']:.2f}x ar constrained, "
                 f"{speed['graft constrained'] / speed['graft free']:.2f}x graft free (decoding alone: "
                 f"{decode['graft constrained'] / decode['ar constrained']:.2f}x, "
                 f"{decode['graft constrained'] / decode['graft free']:.2f}x); "
                 f"graft's constrained tokens are ar's on {same}/{total} tasks; the requests took "
                 f"{wall['graft constrained']:.1f} s constrained, {wall['graft free']:.1f} s free "
                 f"({wall['graft free'] / wall['graft constrained']:.2f}x)")
    return "\n".join(lines)


PARTS = (("before decoding", None), ("prefill", "prefill"), ("drafting's start", "start"),
         ("propose", "propose"), ("verify", "verify"), ("update", "update"), ("grammar (host)", "grammar"))


def breakdown(results: list[dict]) -> str:
    """Where a request's time goes, per configuration: milliseconds per request, mean over the tasks. Before
    decoding: the request's check (its grammar compiled), its encoding and the matcher; the grammar's host time
    is inside propose (its checks, forced and copied drafts) and verify (the masks, the accepted tokens fed)."""
    lines = ["| configuration | request | " + " | ".join(name for name, _ in PARTS) + " | steps |",
             "|---|" + "---|" * (len(PARTS) + 2)]
    for name in CONFIGS:
        runs = [r[name] for r in results]

        def ms(key: str | None) -> float:
            return 1000 * sum(x["before_s"] if key is None else x["phases"].get(key, 0.0) for x in runs) / len(runs)

        lines.append(f"| {name} | {1000 * sum(x['wall_s'] for x in runs) / len(runs):.1f} | "
                     + " | ".join(f"{ms(key):.1f}" for _, key in PARTS)
                     + f" | {sum(x['steps'] for x in runs) / len(runs):.1f} |")
    return "\n".join(lines)


def mask_cost(loaded) -> str:
    """One row's mask, timed alone: every extraction task's answer of placeholder values fed token by token, the
    mask computed before each (the first rows of a grammar build its lexer's states, hence the mean)."""
    from graft_cli.grammar import GrammarTokenizer, json_schema

    grammars = GrammarTokenizer(loaded.tokenizer, loaded.model.get_input_embeddings().num_embeddings, set())
    placeholder = {"integer": 1, "number": 1.5, "boolean": True, "array": ["a", "b"], "string": "some text"}
    times = []
    for task in (json.loads(line) for line in TASKS.read_text().splitlines()):
        if task["kind"] != "extraction":
            continue
        matcher = grammars.matcher(json_schema(task["schema"]))
        answer = {key: spec["enum"][0] if "enum" in spec else placeholder[spec["type"]]
                  for key, spec in task["schema"]["properties"].items()}
        for token in loaded.tokenizer.encode(json.dumps(answer, separators=(", ", ": ")), add_special_tokens=False):
            began = perf_counter()
            matcher.compute_bitmask()
            times.append(perf_counter() - began)
            matcher.consume_token(token)
    times.sort()
    return (f"mask per row over {len(times)} rows: median {1e6 * times[len(times) // 2]:.1f} us, "
            f"p90 {1e6 * times[int(0.9 * len(times))]:.1f} us, mean {1e6 * sum(times) / len(times):.1f} us")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--draft", default=None, help="graft's draft model (the Qwen pair: qwen2.5-coder-0.5b-instruct)")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--mask-cost", action="store_true", help="time one row's mask alone, and stop")
    parser.add_argument("--limit", type=int, default=0, help="N tasks only, half of each kind (0: all)")
    parser.add_argument("--dtype", default="float32", help="float32, or mixed (a CPU's prompts in bf16)")
    parser.add_argument("--forward", default="auto", help="whose modules run the model, as generate's --forward")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    tasks = [json.loads(line) for line in TASKS.read_text().splitlines() if line.strip()]
    if args.limit:
        kinds = [[t for t in tasks if t["kind"] == kind] for kind in ("extraction", "tool_call")]
        tasks = kinds[0][: args.limit // 2] + kinds[1][: args.limit - args.limit // 2]
    loaded = load_model(args.model, "cpu", args.dtype, forward=args.forward)
    if args.mask_cost:
        print(mask_cost(loaded))
        return
    # no prefix cache: each answer pays its own prefill (a cache shared by the two graft columns would give the
    # prompt's rows to whichever of them runs second)
    generators = {"ar": Generator(loaded, configure("ar"), prefix_cache=0),
                  "graft": Generator(loaded, configure("graft", draft=args.draft), prefix_cache=0)}
    template = loaded.tokenizer.chat_template or ""
    tagged = None if "tools" not in template else "<tool_call>" in template
    run(generators, tasks[0], 0, tagged, 16)  # warm-up: first calls, the grammar tokenizer built
    results = []
    args.out.mkdir(parents=True, exist_ok=True)
    for turn, task in enumerate(tasks):
        results.append(run(generators, task, turn, tagged, args.max_new_tokens))
        with open(args.out / "tasks.jsonl", "a") as log:  # a run cut short still has its tasks
            log.write(json.dumps({"id": task["id"], **results[-1]}) + "\n")
        print(task["id"], {k: (v["new_tokens"], round(v["wall_s"], 2), v["valid"]) for k, v in results[-1].items()},
              flush=True)
    same = sum(r["ar constrained"]["tokens"] == r["graft constrained"]["tokens"] for r in results)
    rows = summary(results)
    (args.out / "structured.json").write_text(json.dumps({"model": args.model, "draft": args.draft, "rows": rows,
                                                          "same_tokens": same, "tasks": results}, indent=1))
    report = table(rows, same, len(results)) + "\n\nms per request (mean):\n\n" + breakdown(results)
    (args.out / "structured.md").write_text(report + "\n")
    print(report)


if __name__ == "__main__":
    main()
