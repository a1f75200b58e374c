"""What the prefix cache does, in-process, one run each, side by side on one model and thread:

* ``chats``: MT-Bench's two-turn questions as a chat; turn 2 resends turn 1 and its answer. Time to first token
  and end-to-end tokens per second of turn 2, the cache on against off.
* ``agents``: requests that share one long agent policy and tool list (benchmarks/agent_policy.md, ~2,000 tokens),
  each with its own question: graft with the prefix and response caches against ar without them, ar with the
  prefix cache and graft without it, each question sent to the four in turn; end-to-end tokens per second, and a
  hit's time to first token against a miss's.
* ``agents-tools``: the same policy as an agent framework sends it: its tools as the request's ``tools`` and
  multi-turn episodes of tool calls and replies that quote their results, each request resending the history
  (benchmarks/agent_tools.py; ``--questions``: episodes, 4 at most); the same four runs side by side.
* ``spec-bench``: Spec-Bench questions, no shared prefixes: graft with the cache on against off (what it costs).

Every pair is checked for the same tokens (greedy). ``--target``/``--draft``: the Qwen pair, for example.

    python -m benchmarks.prefix_cache chats|agents|agents-tools|spec-bench [--questions 8] [--tokens 64] [--target NAME]
        [--draft NAME] [--dtype float32] [--threads 1] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

from benchmarks import agent_tools
from benchmarks.agent_tools import renders_tools
from graft_cli.api import Generator
from graft_cli.method.config import configure, with_response_cache
from graft_cli.runtime.loading import load_model
from graft_cli.runtime.lossless import first_difference

DATA = Path(__file__).resolve().parents[2] / "shared" / "data" / "bench"
POLICY = Path(__file__).with_name("agent_policy.md")
CALL_TOKENS = 160  # a tool call's limit: its grammar ends it (a booking's arguments take ~40 tokens)
AGENT_QUESTIONS = [
    "My booking is QX7K2P, last name Moreau. Can I move my Lisbon flight to Friday?",
    "How much does it cost to bring skis on a Classic fare?",
    "My flight was four hours late because of a storm. Do I get compensation?",
    "Can my 6 kg cat travel with me in the cabin, and how do I add her?",
    "I bought a Basic fare yesterday for a flight in three weeks. Can I cancel it?",
    "My bag did not arrive in Porto. What can I claim while I wait?",
    "Can my 10-year-old daughter fly alone to visit her grandmother?",
    "I want a seat in the exit row. Is that possible on a Basic fare?",
    "What is the difference between Classic and Flex if I might change my dates?",
    "Please upgrade my booking ZT4M9A, last name Okafor, to Flex.",
    "Is there a limit on how many bags I can check on a Flex fare?",
    "My connection was missed because the first flight was delayed. What now?",
]


def generator(args: argparse.Namespace, method: str, prefix: bool, responses: bool = False) -> Generator:
    """A Generator for ``method`` (graft with ``--draft`` when given), with or without the caches, over the one
    model every run shares (``args.loaded``): the same weights packed alike. Four copies of the 1.5B Qwen do not
    fit in 24 GB, and a copy loaded short of memory keeps its weights unpacked, whose kernels round otherwise."""
    draft = args.draft if method == "graft" else None
    config = configure(method, draft=draft)
    if responses:
        config = with_response_cache(config)
    return Generator(args.loaded, config, prefix_cache=1024 if prefix else 0)


def timed(g, messages: list[dict], tokens: int, **settings) -> dict:
    """One greedy request streamed: its tokens, time to its first piece, wall seconds, cached prompt tokens.
    ``settings``: the request's other options (its tools, a call's grammar)."""
    started = time.perf_counter()
    first = None
    stream = g.stream(messages=messages, max_new_tokens=tokens, **settings)
    for _ in stream:
        first = first or time.perf_counter() - started
    wall = time.perf_counter() - started
    done = stream.completion
    return dict(ids=done.token_ids, text=done.text, ttft=first or wall, wall=wall, new=len(done.token_ids),
                cached=done.stats.cached_tokens, prompt=done.prompt_tokens, steps=done.stats.steps,
                gained=sum(done.stats.accept_lengths))


def summary(runs: list[dict]) -> dict:
    """A run's figures; ``decode_tokens_per_s``: the tokens after each first one over the time after it (what
    the prefill, cached or not, leaves out)."""
    new, wall = sum(r["new"] for r in runs), sum(r["wall"] for r in runs)
    decoding = sum(r["wall"] - r["ttft"] for r in runs)
    return dict(requests=len(runs), new_tokens=new, wall_s=round(wall, 2), tokens_per_s=round(speed(runs), 2),
                decode_tokens_per_s=round((new - len(runs)) / max(decoding, 1e-9), 2),
                ttft_s=round(sum(r["ttft"] for r in runs) / len(runs), 3),
                cached_tokens=sum(r["cached"] for r in runs), prompt_tokens=sum(r["prompt"] for r in runs),
                tau=round(sum(r["gained"] for r in runs) / max(1, sum(r["steps"] for r in runs)), 2))


def speed(runs: list[dict]) -> float:
    """End-to-end tokens per second of some requests."""
    return sum(r["new"] for r in runs) / max(sum(r["wall"] for r in runs), 1e-9)


def chats(args: argparse.Namespace) -> dict:
    questions = [json.loads(line)["turns"] for line in (DATA / "mt_bench_question.jsonl").read_text().splitlines()]
    out, ids = {}, {}
    for label, prefix in (("cache off", False), ("cache on", True)):
        g = generator(args, "graft", prefix)
        turns2 = []
        for turns in questions[: args.questions]:
            messages = [{"role": "user", "content": turns[0]}]
            first = timed(g, messages, args.tokens)
            messages += [{"role": "assistant", "content": first["text"]}, {"role": "user", "content": turns[1]}]
            turns2.append(timed(g, messages, args.tokens))
        g.close()
        out[label], ids[label] = summary(turns2), [r["ids"] for r in turns2]
    out["identical"] = ids["cache off"] == ids["cache on"]
    return out


def agents(args: argparse.Namespace) -> dict:
    """The four runs side by side: each question goes to every run in turn, so that a machine whose speed drifts
    over the benchmark slows every run alike."""
    policy = POLICY.read_text()
    runs, generators = four_runs(args)
    done: dict[str, list[dict]] = {label: [] for label in runs}
    for question in (AGENT_QUESTIONS * 4)[: args.questions]:
        messages = [{"role": "system", "content": policy}, {"role": "user", "content": question}]
        for label, g in generators.items():
            done[label].append(timed(g, messages, args.tokens))
    return compared(runs, generators, done)


def agents_tools(args: argparse.Namespace) -> dict:
    """The four runs on multi-turn episodes with tools (benchmarks/agent_tools.py), each request sent to every
    run in turn; the history grows by the first run's answer (every run must give the same tokens)."""
    runs, generators = four_runs(args)
    native = renders_tools(next(iter(generators.values())).loaded.tokenizer)
    done: dict[str, list[dict]] = {label: [] for label in runs}
    calls = 0
    for episode in agent_tools.episodes(native, args.questions):
        while (turn := episode.next_turn()) is not None:
            limit = CALL_TOKENS if turn.call else args.tokens
            for label, g in generators.items():
                done[label].append(timed(g, turn.messages, limit, tools=turn.tools, grammar=turn.grammar))
            episode.answered(done["ar"][-1]["text"])
            calls += turn.call is not None
    out = compared(runs, generators, done)
    return dict(tools="as tools (the chat template)" if native else "in the system prompt (the template has none)",
                calls=calls, replies=len(done["ar"]) - calls, **out)


def four_runs(args: argparse.Namespace) -> tuple[dict, dict]:
    """ar and graft, each without the caches and with them (ar: the prefix cache; graft: both)."""
    runs = {"ar": ("ar", False, False), "ar + prefix cache": ("ar", True, False),
            "graft": ("graft", False, False), "graft + prefix + response caches": ("graft", True, True)}
    return runs, {label: generator(args, *how) for label, how in runs.items()}


def compared(runs: dict, generators: dict, done: dict[str, list[dict]]) -> dict:
    """Each run's summary and its speed against ar's, a hit's time to first token against the miss's, and
    whether every run gave the same tokens."""
    out = {}
    for label, g in generators.items():
        g.close()
        out[label] = summary(done[label])
        if runs[label][1]:  # the first request misses, the rest hit the policy
            out[label]["ttft_miss_s"] = round(done[label][0]["ttft"], 3)
            out[label]["ttft_hit_s"] = round(sum(r["ttft"] for r in done[label][1:]) / max(1, len(done[label]) - 1), 3)
    base = out["ar"]["tokens_per_s"]
    for label in runs:
        out[label]["speedup_vs_ar"] = round(out[label]["tokens_per_s"] / base, 2)
    graft, ar = done["graft + prefix + response caches"], done["ar + prefix cache"]
    out["graft + caches vs ar + prefix cache"] = round(out["graft + prefix + response caches"]["tokens_per_s"]
                                                       / out["ar + prefix cache"]["tokens_per_s"], 2)
    # the same, over the requests that hit (the first one misses in both: a server's steady state leaves it out)
    out["graft + caches vs ar + prefix cache, hits"] = round(speed(graft[1:]) / max(speed(ar[1:]), 1e-9), 2)
    ids = {label: [r["ids"] for r in runs_done] for label, runs_done in done.items()}
    out["identical"] = all(v == ids["ar"] for v in ids.values())
    out["parted"] = parted(ids)
    return out


def parted(ids: dict[str, list[list[int]]]) -> dict[str, dict]:
    """Where each run's tokens first part from ``ar``'s: the request and the token (none: the same tokens)."""
    out = {}
    for label, requests in ids.items():
        for number, (got, want) in enumerate(zip(requests, ids["ar"])):
            differs = first_difference(got, want, None, 0.0)
            if differs is not None:
                out[label] = {"request": number, "token": differs.position}
                break
    return out


def spec_bench(args: argparse.Namespace) -> dict:
    records = [json.loads(line) for line in (DATA / "spec_bench_question.jsonl").read_text().splitlines()]
    step = max(1, len(records) // args.questions)
    prompts = [r["turns"][0] for r in records[::step][: args.questions]]
    out, ids = {}, {}
    for label, prefix in (("cache off", False), ("cache on", True)):
        g = generator(args, "graft", prefix)
        done = [timed(g, [{"role": "user", "content": p}], args.tokens) for p in prompts]
        g.close()
        out[label], ids[label] = summary(done), [r["ids"] for r in done]
    out["identical"] = ids["cache off"] == ids["cache on"]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("workload", choices=["chats", "agents", "agents-tools", "spec-bench"])
    ap.add_argument("--questions", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--target", default="smollm2-135m-instruct")
    ap.add_argument("--draft", default=None, help="graft's draft model (the Qwen pair: qwen2.5-coder-0.5b-instruct)")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    args.loaded = load_model(args.target, "cpu", args.dtype, forward="auto")
    result = {"chats": chats, "agents": agents, "agents-tools": agents_tools,
              "spec-bench": spec_bench}[args.workload](args)
    result = dict(workload=args.workload, target=args.target, draft=args.draft, dtype=args.dtype,
                  threads=args.threads, questions=args.questions, tokens=args.tokens, **result)
    text = json.dumps(result, indent=1)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")
    if not result["identical"]:
        print("prefix_cache: the tokens differ between the runs", file=sys.stderr)
        raise SystemExit(1)


if __name__ == "__main__":
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    main()
