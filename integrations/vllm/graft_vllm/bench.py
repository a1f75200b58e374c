"""Side by side, one engine at a time, each in a process of its own: vLLM without speculation, with its ``ngram``
and with graft's proposer, on workloads that quote a corpus, and on one that repeats itself; tokens per second,
accepted tokens per draft, and whether every output is the one without speculation.

    python -m graft_vllm.bench --out vllm-bench.json     # docs/vllm.md's table (minutes on a 2-core CPU)

Why a process per engine: engines built one after another in one process did not run alike (under load the last
one built ran faster per step), and vLLM 0.32 cannot start an engine in a process that has imported ``ngram``'s
numba. The modes take turns in the order listed; the datastore is built once, by the first process.

The tests (integrations/vllm/tests) use the same workloads, smaller.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import sysconfig
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Sequence

import graft_vllm
from graft_cli.plugin import graft_home

MODEL = graft_home() / "models" / "smollm2-135m-instruct"  # graft's default model, as `graft models pull` keeps it
# standard-library modules the corpus workload quotes: the whole files are the datastore, their heads the prompts
MODULES = ("bisect", "heapq", "colorsys", "fnmatch", "glob", "string", "textwrap", "queue", "keyword", "shlex",
           "base64", "abc")
SPEC_BENCH = Path(__file__).resolve().parents[3] / ".." / "shared" / "data" / "bench" / "spec_bench_question.jsonl"
NGRAM = {"method": "ngram", "prompt_lookup_min": 2, "prompt_lookup_max": 4}


@dataclass
class Mode:
    """One engine configuration: ``method`` none, ngram or graft; graft's settings as its environment."""

    name: str
    method: str
    env: dict[str, str] = field(default_factory=dict)


@dataclass
class Result:
    mode: str
    workload: str
    concurrency: int
    tokens: int
    seconds: float
    drafts: int
    accepted: int
    drafted: int
    outputs: list[list[int]]

    @property
    def per_draft(self) -> float:
        return self.accepted / self.drafts if self.drafts else 0.0


def corpus_files(modules: Sequence[str] = MODULES) -> list[Path]:
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    return [stdlib / f"{m}.py" for m in modules]


def quoting_prompts(files: Sequence[Path], lines: int = 24) -> list[str]:
    """Each file's first ``lines`` lines: the model goes on writing the file, which the datastore holds whole."""
    return ["".join(f.read_text().splitlines(keepends=True)[:lines]) for f in files]


def build_store(files: Sequence[Path], out: Path, model: Path = MODEL) -> Path:
    """A suffix-array datastore of ``files`` at ``out``, built by graft's own command (once: kept where it is)."""
    if out.exists():
        return out
    subprocess.run([sys.executable, "-m", "graft_cli", "index", "build", *map(str, files), "--out", str(out),
                    "--model", str(model), "--jobs", "1", "--force"], check=True, capture_output=True)
    return out


def chat_prompts(count: int, tokenizer: Any, path: Path = SPEC_BENCH) -> list[str]:
    """``count`` Spec-Bench questions (every tenth, so the categories mix) in the model's chat template."""
    questions = [json.loads(line)["turns"][0] for line in path.read_text().splitlines() if line.strip()]
    picked = questions[:: max(1, len(questions) // count)][:count]
    return [tokenizer.apply_chat_template([{"role": "user", "content": q}], tokenize=False,
                                          add_generation_prompt=True) for q in picked]


def ordered(modes: Sequence[Mode]) -> list[Mode]:
    """``ngram`` last: its proposer imports numba, and vLLM 0.32 fails to start another engine in a process that
    has (its kernel dispatcher trips over an llvmlite object while it scans the loaded modules)."""
    return sorted(modes, key=lambda mode: mode.method == "ngram")


def engine(mode: Mode, tokens: int, model: Path = MODEL) -> Any:
    """An in-process vLLM engine for ``mode``: float32, eager, its statistics on."""
    from vllm import LLM  # lazy: vLLM loads only when an engine is made

    for key in [k for k in os.environ if k.startswith("GRAFT_VLLM_")]:  # the last mode's settings go
        del os.environ[key]
    os.environ.update(mode.env)
    spec = None
    if mode.method == "ngram":
        spec = {**NGRAM, "num_speculative_tokens": tokens}
    elif mode.method == "graft":
        spec = graft_vllm.speculative_config(tokens)
    return LLM(str(model), dtype="float32", enforce_eager=True, max_model_len=2048, seed=0,
               speculative_config=spec, disable_log_stats=False, max_num_seqs=8)


def counters(llm: Any) -> dict[str, int]:
    wanted = {"vllm:spec_decode_num_drafts": "drafts", "vllm:spec_decode_num_draft_tokens": "drafted",
              "vllm:spec_decode_num_accepted_tokens": "accepted"}
    found = {name: 0 for name in wanted.values()}
    for metric in llm.get_metrics():
        if metric.name in wanted:
            found[wanted[metric.name]] = int(metric.value)
    return found


def measure(llm: Any, mode: str, workload: str, prompts: Sequence[str], concurrency: int,
            max_tokens: int) -> Result:
    """The prompts ``concurrency`` at a time, greedy; the counters' growth over this run only."""
    from vllm import SamplingParams  # lazy: as LLM above

    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=False)
    before, outputs = counters(llm), []
    start = time.perf_counter()
    for i in range(0, len(prompts), concurrency):
        done = llm.generate(list(prompts[i : i + concurrency]), params, use_tqdm=False)
        outputs += [list(o.outputs[0].token_ids) for o in done]
    seconds = time.perf_counter() - start
    after = counters(llm)
    grown = {k: after[k] - before[k] for k in after}
    return Result(mode, workload, concurrency, sum(map(len, outputs)), seconds, grown["drafts"], grown["accepted"],
                  grown["drafted"], outputs)


def run(modes: Sequence[Mode], workloads: dict[str, tuple[list[str], int]], concurrencies: Sequence[int],
        max_tokens: int, tokens: int, single: int | None = None) -> list[Result]:
    """Every mode over every workload (its prompts, and how many rounds of them: the last is measured at every
    concurrency, the ones before warm what a mode learns across requests); one at a time, only the first ``single``
    prompts when given."""
    results = []
    for mode in ordered(modes):
        llm = engine(mode, tokens)
        measure(llm, mode.name, "warm-up", ["Hello"], 1, 4)  # compiles what the first request would
        for workload, (prompts, rounds) in workloads.items():
            for _ in range(rounds - 1):  # the rounds before the measured ones, all at once
                measure(llm, mode.name, workload, prompts, max(concurrencies), max_tokens)
            for concurrency in concurrencies:
                asked = prompts[:single] if concurrency == 1 and single else prompts  # one at a time: the first few
                results.append(measure(llm, mode.name, workload, asked, concurrency, max_tokens))
                print(table(results).splitlines()[-1], flush=True)  # as it comes: a long run shows its progress
        del llm
    return results


def run_apart(modes: Sequence[Mode], argv: Sequence[str], work: Path) -> list[Result]:
    """:func:`run` for each mode in a child process of this command (``argv``: its options), in turn."""
    results = []
    for mode in modes:
        out = work / f"{len(results)}-{mode.method}.json"
        subprocess.run([sys.executable, "-m", "graft_vllm.bench", *argv, "--mode", mode.name, "--out", str(out),
                        "--work", str(work)], check=True)
        results += [Result(**r) for r in json.loads(out.read_text())]
        print(table(results), flush=True)
    return results


def table(results: Sequence[Result]) -> str:
    """Markdown: per workload and concurrency, each mode's tok/s, accepted per draft, and same outputs as none."""
    plain = {(r.workload, r.concurrency): r for r in results if r.mode == "none"}
    lines = ["| workload | at once | mode | tok/s | drafts | accepted / draft | accepted / drafted | lossless |",
             "|---|---|---|---|---|---|---|---|"]
    for r in results:
        base = plain.get((r.workload, r.concurrency))
        same = "yes" if base is not None and base.outputs == r.outputs else "NO" if base is not None else "-"
        share = f"{r.accepted / r.drafted:.2f}" if r.drafted else "-"
        lines.append(f"| {r.workload} | {r.concurrency} | {r.mode} | {r.tokens / r.seconds:.1f} | {r.drafts} | "
                     f"{r.per_draft:.2f} | {share} | {same} |")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--tokens", type=int, default=8, help="num_speculative_tokens")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--concurrency", default="1,8")
    parser.add_argument("--single", type=int, help="prompts asked one at a time (default: all)")
    parser.add_argument("--out", type=Path, help="JSON of every result (outputs included)")
    parser.add_argument("--mode", help=argparse.SUPPRESS)  # a child's one mode (run_apart)
    parser.add_argument("--work", type=Path, help=argparse.SUPPRESS)  # the parent's work directory
    args = parser.parse_args(argv)
    from transformers import AutoTokenizer  # lazy: only the command needs a tokenizer

    work = args.work or Path(os.environ.get("TMPDIR", "/tmp")) / f"graft-vllm-bench-{os.getpid()}"
    files = corpus_files()[: args.prompts]
    store = build_store(corpus_files(), work / "stdlib-store")
    chat = chat_prompts(args.prompts, AutoTokenizer.from_pretrained(str(MODEL)))
    workloads = {"stdlib (quoted)": (quoting_prompts(files), 1), "chat, repeated": (chat, 2)}
    modes = [Mode("none", "none"), Mode("ngram", "ngram"),
             Mode("graft: prompt", "graft", {"GRAFT_VLLM_RETRIEVERS": "prompt"}),
             Mode("graft: prompt + datastore", "graft",
                  {"GRAFT_VLLM_RETRIEVERS": "prompt,suffix-array", "GRAFT_VLLM_DATASTORE": str(store)}),
             Mode("graft: + response cache", "graft",
                  {"GRAFT_VLLM_RETRIEVERS": "prompt,suffix-array,responses", "GRAFT_VLLM_DATASTORE": str(store)})]
    if args.mode is None:
        child = ["--max-tokens", str(args.max_tokens), "--tokens", str(args.tokens), "--prompts", str(args.prompts),
                 "--concurrency", args.concurrency, *(["--single", str(args.single)] if args.single else [])]
        results = run_apart(modes, child, work)
    else:
        results = run([m for m in modes if m.name == args.mode], workloads,
                      [int(c) for c in args.concurrency.split(",")], args.max_tokens, args.tokens, args.single)
    print(table(results))
    if args.out:
        args.out.write_text(json.dumps([asdict(r) for r in results]))


if __name__ == "__main__":
    main()
