"""What the server itself costs: one request's wall time through `graft serve` (the openai client, streamed and
whole) against the same generation in-process through the API, alternated, on the same model and settings.

    python -m benchmarks.serve_cost [--model smollm2-135m-instruct] [--tokens 128] [--rounds 3]

Prints the per-token overhead of HTTP and streaming, and the response cache's effect on the same request twice.
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from statistics import median

import openai

import graft_cli

PROMPT = "Write a Python function that checks whether a string is a palindrome, with a docstring and tests."


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(model: str, flags: list[str]) -> tuple[subprocess.Popen, str]:
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "graft_cli", "serve", "--model", model, "--port", str(port),
                             *flags], stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    for _ in range(600):
        try:
            urllib.request.urlopen(f"{url}/health", timeout=1)
            return proc, url
        except OSError:
            time.sleep(0.2)
    proc.kill()
    raise SystemExit("graft serve did not start")


def through_server(client: openai.OpenAI, model: str, tokens: int, stream: bool) -> tuple[float, int, dict]:
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


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    proc, url = start_server(args.model, ["--no-response-cache"])
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=600)
    local = graft_cli.load(args.model, method="graft", retrievers=["prompt", "recycling"])
    walls: dict[str, list[float]] = {"in-process": [], "server, whole": [], "server, streamed": []}
    tokens = 0
    try:
        through_server(client, args.model, 8, False)  # warm both sides
        local.generate(PROMPT, max_new_tokens=8)
        for _ in range(args.rounds):
            t0 = time.perf_counter()
            tokens = len(local.generate(PROMPT, max_new_tokens=args.tokens).token_ids)
            walls["in-process"].append(time.perf_counter() - t0)
            walls["server, whole"].append(through_server(client, args.model, args.tokens, False)[0])
            walls["server, streamed"].append(through_server(client, args.model, args.tokens, True)[0])
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait()
        local.close()
    base = median(walls["in-process"])
    print(f"{tokens} tokens, greedy, method graft, median of {args.rounds} alternated rounds:")
    for name, values in walls.items():
        extra = (median(values) - base) / tokens * 1e3
        print(f"  {name:17} {median(values):7.3f} s   overhead {extra:+.2f} ms/token")
    cache_twice(args)


def cache_twice(args: argparse.Namespace) -> None:
    """The same request twice through a server with its response cache: tau and tokens/s of each."""
    proc, url = start_server(args.model, [])
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=600)
    try:
        for label in ("first", "second"):
            wall, n, figures = through_server(client, args.model, args.tokens, False)
            print(f"  response cache, {label} request: tau {figures['tau']:.2f}, {n / wall:.1f} tok/s, "
                  f"accepted {figures['accepted']}")
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait()


if __name__ == "__main__":
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    main()
