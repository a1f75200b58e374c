"""What the server itself costs: one request's wall time through `graft serve` (the openai client, streamed and
whole) against the same generation in-process through the API, alternated, on the same model and settings.

    python -m benchmarks.serve_cost [--model smollm2-135m-instruct] [--tokens 128] [--rounds 3]

Prints the per-token overhead of HTTP and streaming. serve_cache.py sends one request twice through the same
server (``served``) with its response cache.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import time
from statistics import median
from typing import Iterator

import openai

import graft_cli
from benchmarks.server_process import free_port, running

PROMPT = "Write a Python function that checks whether a string is a palindrome, with a docstring and tests."


@contextlib.contextmanager
def served(model: str, flags: list[str]) -> Iterator[openai.OpenAI]:
    """A client of `graft serve --model MODEL FLAGS` on a free port, once it answers; the server stops after."""
    port = free_port()
    argv = [sys.executable, "-m", "graft_cli", "serve", "--model", model, "--port", str(port), *flags]
    with running(argv, port) as (url, _):
        yield openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=600)


def through_server(client: openai.OpenAI, model: str, tokens: int, stream: bool) -> tuple[float, int, dict]:
    """Seconds, new tokens and graft's own figures of one greedy request for PROMPT."""
    t0 = time.perf_counter()
    messages = [{"role": "user", "content": PROMPT}]
    if stream:
        last = None
        for chunk in client.chat.completions.create(model=model, messages=messages, max_tokens=tokens, temperature=0,
                                                    stream=True, stream_options={"include_usage": True}):
            last = chunk
        return time.perf_counter() - t0, last.usage.completion_tokens, last.model_extra["graft"]
    answer = client.chat.completions.create(model=model, messages=messages, max_tokens=tokens, temperature=0)
    return time.perf_counter() - t0, answer.usage.completion_tokens, answer.model_extra["graft"]


def request_options(description: str) -> argparse.ArgumentParser:
    """The model and the request's new tokens, which both serve scripts take."""
    ap = argparse.ArgumentParser(description=description)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--tokens", type=int, default=128)
    return ap


def main() -> None:
    ap = request_options(__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    local = graft_cli.load(args.model, method="graft", retrievers=["prompt", "recycling"])
    walls: dict[str, list[float]] = {"in-process": [], "server, whole": [], "server, streamed": []}
    tokens = 0
    try:
        with served(args.model, ["--no-response-cache"]) as client:
            through_server(client, args.model, 8, False)  # warm both sides
            local.generate(PROMPT, max_new_tokens=8)
            for _ in range(args.rounds):
                t0 = time.perf_counter()
                tokens = len(local.generate(PROMPT, max_new_tokens=args.tokens).token_ids)
                walls["in-process"].append(time.perf_counter() - t0)
                walls["server, whole"].append(through_server(client, args.model, args.tokens, False)[0])
                walls["server, streamed"].append(through_server(client, args.model, args.tokens, True)[0])
    finally:
        local.close()
    base = median(walls["in-process"])
    print(f"{tokens} tokens, greedy, method graft, median of {args.rounds} alternated rounds:")
    for name, values in walls.items():
        extra = (median(values) - base) / tokens * 1e3
        print(f"  {name:17} {median(values):7.3f} s   overhead {extra:+.2f} ms/token")


if __name__ == "__main__":
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    main()
