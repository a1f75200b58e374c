"""What llama.cpp's tools print, read back as figures, and the comparison's table: the parts of
``benchmarks/llama_cpp.py`` that need no llama.cpp build, so a test checks them on captured output.

Every engine's figures are reduced alike: **prefill** = prompt tokens / the prompt's forward time; **decode** =
tokens after the first / the time after the prefill (llama.cpp samples the first token from the prompt's logits,
so its ``eval`` counts one run fewer than tokens; graft's first token comes from its prefill too). Sums over the
questions, so a long prompt weighs as its tokens do.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field

PERF = re.compile(r"prompt eval time =\s*(?P<p_ms>[\d.]+) ms /\s*(?P<p_n>\d+) tokens.*?"
                  r"\beval time =\s*(?P<e_ms>[\d.]+) ms /\s*(?P<e_n>\d+) runs", re.S)
PROMPT_COUNT = re.compile(r"number of tokens in prompt = (\d+)")
PROMPT_ID = re.compile(r"^(?:[\d.]+ [IWE] )?\s*(\d+) -> '", re.M)  # after the log's time and level, if shown
LOOKUP = re.compile(r"encoded\s+(?P<p_n>\d+) tokens in\s+(?P<p_s>[\d.]+) seconds.*?"
                    r"decoded\s+(?P<d_n>\d+) tokens in\s+(?P<d_s>[\d.]+) seconds.*?"
                    r"n_drafted\s*=\s*(?P<drafted>\d+).*?n_accept\s*=\s*(?P<accepted>\d+)", re.S)


class OutputError(ValueError):
    """A tool's output lacks the lines its figures are read from (a crash, or a changed format)."""


@dataclass
class Timing:
    """One generation's figures, whichever engine made it."""

    prompt_tokens: int
    prefill_s: float
    new_tokens: int
    decode_s: float  # after the first token
    drafted: int = 0  # speculative engines: tokens proposed and accepted
    accepted: int = 0


@dataclass
class Row:
    """An engine, weights and thread count, summed over the questions."""

    engine: str
    weights: str
    threads: int
    timings: list[Timing] = field(default_factory=list)
    same_text: int = 0  # questions whose text is graft ar's in the same thread count

    @property
    def decode_tok_s(self) -> float:
        seconds = sum(t.decode_s for t in self.timings)
        return sum(max(t.new_tokens - 1, 0) for t in self.timings) / seconds if seconds else 0.0

    @property
    def prefill_tok_s(self) -> float:
        seconds = sum(t.prefill_s for t in self.timings)
        return sum(t.prompt_tokens for t in self.timings) / seconds if seconds else 0.0

    def as_dict(self) -> dict:
        return {"engine": self.engine, "weights": self.weights, "threads": self.threads,
                "decode_tok_s": round(self.decode_tok_s, 2), "prefill_tok_s": round(self.prefill_tok_s, 1),
                "same_text": self.same_text, "questions": len(self.timings),
                "timings": [vars(t) for t in self.timings]}


def completion_timing(stderr: str) -> Timing:
    """``llama-completion``'s closing performance lines: prompt eval (tokens, ms) and eval (runs, ms)."""
    match = PERF.search(stderr)
    if match is None:
        raise OutputError("llama-completion printed no 'prompt eval time' and 'eval time' lines")
    runs = int(match["e_n"])
    return Timing(int(match["p_n"]), float(match["p_ms"]) / 1e3, runs + 1, float(match["e_ms"]) / 1e3)


def lookup_timing(stderr: str) -> Timing:
    """``llama-lookup``'s own summary: tokens encoded and decoded with their seconds, drafted and accepted."""
    match = LOOKUP.search(stderr)
    if match is None:
        raise OutputError("llama-lookup printed no 'encoded ... decoded ... n_accept' summary")
    return Timing(int(match["p_n"]), float(match["p_s"]), int(match["d_n"]), float(match["d_s"]),
                  int(match["drafted"]), int(match["accepted"]))


def prompt_ids(stderr: str) -> list[int]:
    """The prompt's token ids as ``--verbose-prompt`` lists them: a count, then ``  id -> 'piece'`` per token (a
    piece may hold a line break, so the count says where the list ends)."""
    count = PROMPT_COUNT.search(stderr)
    if count is None:
        raise OutputError("llama-completion listed no prompt tokens (--verbose-prompt)")
    ids = [int(i) for i in PROMPT_ID.findall(stderr, count.end())][: int(count[1])]
    if len(ids) != int(count[1]):
        raise OutputError(f"llama-completion listed {len(ids)} of the prompt's {count[1]} tokens")
    return ids


def generated_text(stdout: str, tool: str, prompt: str, eos: str) -> str:
    """The text a tool generated, as graft reports it (no end-of-text token): ``llama-completion
    --no-display-prompt`` prints the text, `` [end of text]`` where the model ended it, and a blank line;
    ``llama-lookup`` a blank line, the prompt, the text (the end-of-text token's own text included) and two blank
    lines."""
    head, tail = ("", "\n\n") if tool == "llama-completion" else ("\n\n" + prompt, "\n\n\n\n")
    if not (stdout.startswith(head) and stdout.endswith(tail)):
        raise OutputError(f"{tool}'s output is not laid out as expected (prompt echo, closing blank lines)")
    text = stdout[len(head):len(stdout) - len(tail)]
    return text.removesuffix(" [end of text]\n").removesuffix(eos)


def bench_rates(json_text: str) -> list[dict]:
    """``llama-bench -o json``: one record per test, as (weights, threads, test, tokens/s); the weights are the
    last word of its model type (``llama ?B all F32``: F32)."""
    try:
        records = json.loads(json_text)
    except json.JSONDecodeError as e:
        raise OutputError(f"llama-bench printed no JSON ({e.msg})") from None
    out = []
    for r in records:
        test = f"pp{r['n_prompt']}" if r.get("n_prompt") else f"tg{r['n_gen']}"
        out.append({"weights": r.get("model_type", "").split()[-1] if r.get("model_type") else "?",
                    "threads": r["n_threads"], "test": test, "tok_s": round(float(r["avg_ts"]), 2),
                    "stddev": round(float(r.get("stddev_ts", 0.0)), 2)})
    return out


def first_difference(text: str, reference: str) -> int | None:
    """Where ``text`` parts from ``reference`` (a character offset); None where it holds the whole reference
    (``llama-lookup`` may run past the token limit by part of a draft: the longer text still agrees)."""
    if text.startswith(reference):
        return None
    common = next((i for i, (a, b) in enumerate(zip(text, reference)) if a != b), min(len(text), len(reference)))
    return common


def table(rows: list[Row], bench: list[dict], questions: int) -> str:
    """The markdown table: each row's decode and prefill rates, its ratio to llama.cpp's plain decoding of the
    same weights and thread count, and how many texts match graft ar's; llama-bench's synthetic rates after."""
    plain = {(r.weights, r.threads): r.decode_tok_s for r in rows if r.engine == "llama.cpp" and r.timings}
    lines = ["| engine | weights | threads | decode tok/s | vs llama.cpp same weights | vs llama.cpp Q8_0 "
             "| prefill tok/s | same text as graft ar |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        base = plain.get((r.weights, r.threads))
        q8 = plain.get(("Q8_0", r.threads))
        ratio = f"{r.decode_tok_s / base:.2f}x" if base else "-"
        vs_q8 = f"{r.decode_tok_s / q8:.2f}x" if q8 and r.weights != "Q8_0" else "-"
        lines.append(f"| {r.engine} | {r.weights} | {r.threads} | {r.decode_tok_s:.1f} | {ratio} | {vs_q8} "
                     f"| {r.prefill_tok_s:.0f} | {r.same_text}/{questions} |")
    if bench:
        lines += ["", "| llama-bench | weights | threads | tok/s |", "|---|---|---|---|"]
        lines += [f"| {b['test']} | {b['weights']} | {b['threads']} | {b['tok_s']:.1f} ± {b['stddev']:.1f} |"
                  for b in bench]
    return "\n".join(lines)
