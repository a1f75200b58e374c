"""A server that runs for days: 300 requests against one `graft serve`, with varied prompts (some sharing a system
prompt, some a chat's second turn), lengths and sampling settings (temperature, top-p, top-k, seed), streamed and
not, some cut off by their clients. It checks every whole answer against the same request's answer from plain
decoding in-process (greedy and seeded text does not depend on the method or on the caches), the server's resident
memory after the last request against after the 50th, and the most fixed-shape graph keys the server held.

    python -m benchmarks.soak [--requests 300] [--specs 40] [--graphs on] [--prefix-cache 64] [--out soak.json]

With ``--graphs on`` on a CPU the server's steps run at fixed shapes, eagerly, with the books a GPU keeps of its
graphs (``CountedGraphs``), so its graph keys are counted as a GPU's would be. The prefix cache's budget
is small by default so that it is full well before the 50th request: the memory compared is then what leaks, not
the cache filling up.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import openai

from benchmarks.server_process import free_port, running

MODEL = "smollm2-135m-instruct"
DATA = Path(__file__).resolve().parents[2] / "shared" / "data" / "bench"
SYSTEM = ("You are the assistant of a travel agency. Answer in at most three sentences, politely, and never invent "
          "prices, dates or policies you were not given. ") * 4


def specs(count: int, seed: int = 0) -> list[dict]:
    """``count`` distinct requests: a question alone, after the shared system prompt, or as a second turn."""
    rng = random.Random(seed)
    questions = [json.loads(line)["turns"] for line in (DATA / "mt_bench_question.jsonl").read_text().splitlines()]
    out = []
    for i in range(count):
        turns = rng.choice(questions)
        shape = rng.choice(["alone", "system", "second turn"])
        messages = [{"role": "user", "content": turns[0][:400]}]
        if shape == "system":
            messages.insert(0, {"role": "system", "content": SYSTEM})
        elif shape == "second turn":
            messages += [{"role": "assistant", "content": "Here is a first answer."},
                         {"role": "user", "content": turns[1][:300]}]
        temperature = rng.choice([0.0, 0.0, 0.3, 0.7, 1.0])
        out.append(dict(messages=messages, max_tokens=rng.choice([8, 16, 32]), temperature=temperature,
                        top_p=rng.choice([1.0, 0.9, 0.95]), top_k=rng.choice([0, 20, 50]), seed=rng.randrange(2**31)))
    return out


def references(all_specs: list[dict]) -> list[str]:
    """Each request's text from plain decoding in-process, no caches: what every answer must be."""
    import graft_cli

    with graft_cli.load(MODEL, method="ar", device="cpu", prefix_cache=0) as g:
        return [g.generate(messages=s["messages"], max_new_tokens=s["max_tokens"], temperature=s["temperature"],
                           top_p=s["top_p"], top_k=s["top_k"], seed=s["seed"]).text for s in all_specs]


def ask(client: openai.OpenAI, spec: dict, mode: str) -> str | None:
    """One request as a client sends it: whole, streamed, or streamed and dropped after two chunks (None)."""
    kwargs = dict(model=MODEL, messages=spec["messages"], max_tokens=spec["max_tokens"],
                  temperature=spec["temperature"], top_p=spec["top_p"], seed=spec["seed"],
                  extra_body={"top_k": spec["top_k"]})
    if mode == "whole":
        return client.chat.completions.create(**kwargs).choices[0].message.content
    stream = client.chat.completions.create(stream=True, **kwargs)
    pieces = []
    for i, chunk in enumerate(stream):
        if mode == "dropped" and i == 2:
            stream.close()
            return None
        if chunk.choices:
            pieces.append(chunk.choices[0].delta.content or "")
    return "".join(pieces)


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def soak(args: argparse.Namespace) -> dict:
    all_specs = specs(args.specs)
    print(f"soak: {len(all_specs)} distinct requests, their plain-decoding texts first ...", file=sys.stderr)
    truth = references(all_specs)
    port, entries = free_port(), Path(tempfile.mkdtemp()) / "graph_keys.json"
    argv = [sys.executable, "-m", "benchmarks.soak", "--serve", str(entries), "--port", str(port), "--graphs",
            args.graphs, "--prefix-cache", str(args.prefix_cache), "--max-queue", "64"]
    with running(argv, port, env=dict(os.environ, OMP_NUM_THREADS=str(args.threads))) as (url, proc):
        result = drive(url, proc.pid, all_specs, truth, args)
    result["graph_keys_most"] = json.loads(entries.read_text()) if entries.exists() else None
    return result


def drive(url: str, pid: int, all_specs: list[dict], truth: list[str], args: argparse.Namespace) -> dict:
    """Send the soak's requests to the server at ``url`` (process ``pid``) and gather its figures."""
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=600)
    rng = random.Random(1)
    plan = [(rng.randrange(len(all_specs)), rng.choices(["whole", "streamed", "dropped"], [45, 45, 10])[0])
            for _ in range(args.requests)]
    done, wrong, rss, lock = [0], [], {}, threading.Lock()

    def one(item: tuple[int, str]) -> None:
        index, mode = item
        text = ask(client, all_specs[index], mode)
        with lock:
            done[0] += 1
            if text is not None and text != truth[index]:
                wrong.append({"spec": index, "mode": mode, "got": text, "want": truth[index]})
            if done[0] in (50, args.requests):
                rss[done[0]] = rss_mib(pid)

    started = time.perf_counter()
    with ThreadPoolExecutor(args.clients) as pool:
        list(pool.map(one, plan))
    seconds = time.perf_counter() - started
    metrics = urllib.request.urlopen(f"{url}/metrics").read().decode()
    figures = {k: v for k, v in (line.rsplit(" ", 1) for line in metrics.splitlines() if line[:1] != "#")}
    return dict(requests=args.requests, distinct=len(all_specs), clients=args.clients, seconds=round(seconds, 1),
                dropped=sum(mode == "dropped" for _, mode in plan), wrong=wrong,
                rss_mib_after_50=round(rss[50], 1), rss_mib_after_last=round(rss[args.requests], 1),
                rss_change=round(rss[args.requests] / rss[50] - 1, 4),
                prefix_hits=figures.get("graft_prefix_cache_hits_total"),
                cached_tokens=figures.get('graft_tokens_total{kind="cached"}'),
                prompt_tokens=figures.get('graft_tokens_total{kind="prompt"}'))


def serve_stubbed(entries: Path, flags: list[str]) -> None:
    """`graft serve FLAGS` in this process, the target's graphs counted as a GPU's (CountedGraphs); the most keys
    any Graphs held is written to ``entries`` when it exits."""
    import atexit

    from graft_cli.bench.synthetic import CountedGraphs
    from graft_cli.cli import main as graft_main
    from graft_cli.runtime import fixed_target, graphs

    most: dict[str, int] = {}
    run = graphs.Graphs.run

    def counted(self, key, region):
        out = run(self, key, region)
        name = f"graphs {id(self)}"
        most[name] = max(most.get(name, 0), len(self.calls))
        return out

    graphs.Graphs.run = counted
    original = fixed_target.make_target

    def make(model, switch="auto", chunk=fixed_target.PREFILL_CHUNK, progress=None, **kinds):
        target = original(model, switch, chunk, progress, **kinds)
        if isinstance(target, fixed_target.FixedShapeTarget):
            target.graphs = CountedGraphs()
        return target

    import graft_cli.api.generator as generator
    generator.make_target = make
    atexit.register(lambda: entries.write_text(json.dumps(max(most.values(), default=0))))
    sys.argv = ["graft", "serve", *flags]
    graft_main()


def main() -> None:
    if len(sys.argv) > 2 and sys.argv[1] == "--serve":
        serve_stubbed(Path(sys.argv[2]), sys.argv[3:])
        return
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=300)
    ap.add_argument("--specs", type=int, default=40, help="distinct requests the soak draws from")
    ap.add_argument("--clients", type=int, default=2, help="clients sending at once")
    ap.add_argument("--graphs", default="on", help="the server's --graphs (on: fixed shapes, capture stubbed)")
    ap.add_argument("--prefix-cache", type=float, default=64, help="the server's --prefix-cache MiB")
    ap.add_argument("--threads", type=int, default=1, help="the server's OMP_NUM_THREADS")
    ap.add_argument("--out", help="write the figures as JSON here too")
    args = ap.parse_args()
    result = soak(args)
    text = json.dumps(result, indent=1)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")
    if result["wrong"] or result["rss_change"] > 0.10:
        raise SystemExit(1)


if __name__ == "__main__":
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    main()
