"""Replay the greedy outputs of a ``graft bench`` run through any method, without the target model: its τ, draft
forwards per step and decoding speedup over ``ar``, the verification costed by the target's latency profile.

Greedy decoding is deterministic and every method is lossless, so ``ar``'s tokens are what every method outputs,
and a proposer's trees depend only on the context: at each step the tree is walked along those tokens (the
accepted path, then the next token as the bonus), the proposer observes the step, and the step costs the
proposer's measured time (drafting included) plus the profile's verification latency for the tree. Comparing
drafting policies this way needs only the draft model's forwards, and the verification costs no noise.

    python benchmarks/replay.py docs/bench/qwen-grid/runs.0-of-2.jsonl --dataset docs/bench/qwen-grid/prompts.jsonl \\
        --model qwen2.5-coder-1.5b-instruct --draft qwen2.5-coder-0.5b-instruct --limit 4 \\
        --method 'dense=dense budget=16' --method 'graft=graft budget=16 prune_at=0:0.5,2:0.4,floor:0.3'
    python benchmarks/replay.py docs/bench/pld/runs.jsonl --categories summarization,rag --method 'pld=pld budget=16' \
        --curve 1:1,2:1.21,4:1.39,8:1.67,16:2.13

Each ``--method`` is ``NAME=METHOD FIELD=VALUE ...`` as in ``graft bench --variant``, plus ``budget=N|auto``.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from pathlib import Path
from time import perf_counter
from typing import Iterator

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from graft_cli import graft  # noqa: E402
from graft_cli.bench.datasets import load_questions, resolve_dataset  # noqa: E402
from graft_cli.bench.plan import MethodSpec, method_config  # noqa: E402
from graft_cli.budget import LatencyModel  # noqa: E402
from graft_cli.cli_bench import _variant  # noqa: E402
from graft_cli.loading import encode, load_model  # noqa: E402
from graft_cli.methods import build  # noqa: E402
from graft_cli.profile import latency_model, parse_budget  # noqa: E402
from graft_cli.stats import Stats  # noqa: E402
from graft_cli.tree import ROOT as TREE_ROOT  # noqa: E402
from graft_cli.tree import Tree  # noqa: E402
from plugins.base import Step  # noqa: E402


class Clock:
    """The proposer's ``perf_counter`` during a replay: real time plus the modelled verifications so far, so a
    cost-aware proposer measures a verification at what the curve says it costs (its draft forwards stay real)."""

    def __init__(self) -> None:
        self.verified = 0.0

    def __call__(self) -> float:
        return perf_counter() + self.verified


def replay(proposer, prompt: list[int], output: list[int], verify_s, steps_out: list | None = None) -> dict:
    """Decode ``output`` after ``prompt`` with ``proposer``: seconds proposing, seconds verifying (from
    ``verify_s(fed tokens)``), steps and draft forwards; ``steps_out`` collects one record per step (tree size,
    tokens accepted, draft forwards, proposing seconds, and the proposer's own trace record)."""
    clock = graft.perf_counter = Clock()
    context = [*prompt, output[0]]  # the prefill gives the first token
    proposer.start(prompt, Step(context, [output[0]], Tree(), list(range(len(prompt)))), len(prompt) + len(output) + 256)
    stats = Stats()
    done, propose, verify, steps = 1, 0.0, 0.0, 0
    while done < len(output):
        t0, forwards = perf_counter(), stats.draft_forwards
        tree = proposer.propose(context, stats)
        propose += perf_counter() - t0
        record = {"nodes": len(tree), "forwards": stats.draft_forwards - forwards, "propose_s": perf_counter() - t0}
        node, path = TREE_ROOT, []
        while done + len(path) < len(output):
            child = tree.child(node, output[done + len(path)])
            if child is None:
                break
            path.append(child)
            node = child
        new = output[done : done + len(path) + 1]
        verify += verify_s(len(tree) + 1)
        clock.verified += verify_s(len(tree) + 1)
        steps += 1
        done += len(new)
        context = context + new
        proposer.observe(Step(context, new, tree, [0] + [i + 1 for i in path]))
        if steps_out is not None:
            steps_out.append({**record, "tokens": len(new), **(proposer.trace[-1] if proposer.trace else {})})
    return {"tokens": len(output) - 1, "propose": propose, "verify": verify, "steps": steps,
            "draft_forwards": stats.draft_forwards}


def ar_turns(paths: list[Path], questions: dict, tokenizer) -> Iterator[tuple[dict, list[int], dict]]:
    """(record, prompt ids, turn) for every turn of the ``ar`` runs in ``paths`` whose question is in
    ``questions`` (keyed by JSON id), the prompt rebuilt as the bench built it (earlier turns and answers included)."""
    for path in paths:
        for line in path.read_text().splitlines():
            record = json.loads(line)
            question = questions.get(json.dumps(record["question_id"]))
            if record["method"] != "ar" or question is None:
                continue
            messages = []
            for text, turn in zip(question.turns, record["turns"]):
                messages.append({"role": "user", "content": text})
                prompt = encode(tokenizer, messages)
                if len(prompt) != turn["prompt_tokens"]:
                    raise SystemExit(f"question {record['question_id']}: the prompt does not match the run's")
                yield record, prompt, turn
                messages.append({"role": "assistant", "content": turn["text"]})


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("runs", type=Path, nargs="+", help="runs*.jsonl of a graft bench run that includes ar")
    ap.add_argument("--method", action="append", required=True, metavar="'NAME=METHOD FIELD=VALUE ...'")
    ap.add_argument("--dataset", default="spec-bench")
    ap.add_argument("--model", default="smollm2-135m-instruct", help="the run's target: tokenizer and latency profile")
    ap.add_argument("--draft", default=None)
    ap.add_argument("--categories", default=None)
    ap.add_argument("--limit", type=int, default=None, help="first N questions of each category")
    ap.add_argument("--curve", default=None, help="N:COST,...: verification cost in one-token forwards instead of "
                    "the target's measured profile (the proposers choose their trees by it too)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--steps", type=Path, default=None, help="write every step here (JSON lines)")
    ap.add_argument("--per-question", action="store_true", help="print a row per question and method too")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    loaded = load_model(args.model, "cpu", "float32")
    latency = latency_model(loaded)
    loaded.model.to("meta")  # never run: its config, dtype and tokenizer are what the proposers read
    one = latency(1)  # the unit of the speedup, and of --curve
    if args.curve:
        latency = LatencyModel({int(n): float(c) * one for n, c in (p.split(":") for p in args.curve.split(","))})
    wanted = args.categories.split(",") if args.categories else None
    questions = {json.dumps(q.question_id): q
                 for q in load_questions(resolve_dataset(args.dataset), wanted, args.limit)}
    proposers = {}
    for text in args.method:
        name, variant = _variant(text)
        opts = dict(variant.opts)
        spec = MethodSpec(name, variant.method, "engine", parse_budget(opts.pop("budget", None)), opts)
        proposers[name] = build(method_config(spec, {}, args.draft), loaded)
        if args.curve and hasattr(proposers[name], "latency"):  # it chooses its retrieved nodes by the same curve
            proposers[name].latency = latency

    totals: dict[tuple[str, str], dict] = defaultdict(lambda: defaultdict(float))
    steps_file = args.steps.open("w") if args.steps else None
    for record, prompt, turn in ar_turns(args.runs, questions, loaded.tokenizer):
        for name, proposer in proposers.items():  # one proposer per method for the run, as in the bench
            steps: list[dict] = []
            for key, value in replay(proposer, prompt, turn["tokens"], latency, steps).items():
                for row in ("all", record["question_id"]):
                    totals[record["category"], row, name][key] += value
            for i, step in enumerate(steps):
                if steps_file:
                    steps_file.write(json.dumps({"question": record["question_id"], "method": name, "step": i,
                                                 **step}, default=dict) + "\n")
    print("category | question | method | decoding speedup over ar | tau | draft forwards/step | propose s/step | "
          "verify s/step")
    for (category, row, name), t in sorted(totals.items(), key=lambda kv: str(kv[0])):
        if row == "all" or args.per_question:
            print(f"{category} | {row} | {name} | {t['tokens'] * one / (t['propose'] + t['verify']):.3f} | "
                  f"{t['tokens'] / t['steps']:.2f} | {t['draft_forwards'] / t['steps']:.2f} | "
                  f"{t['propose'] / t['steps']:.3f} | {t['verify'] / t['steps']:.3f}")


if __name__ == "__main__":
    main()
