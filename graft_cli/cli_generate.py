"""``graft generate``: text streams to stdout as it is accepted; stats and progress go to stderr."""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path
from typing import Iterator, Optional

import typer

from graft_cli.catalog.entries import DEFAULT_MODEL
from graft_cli.cli_options import (
    DEVICE, Budget, Datastore, Device, DeviceMap, Draft, Dtype, MaxNewTokens, Model, RetrieverOpt, Truncate,
    retriever_options,
)
from graft_cli.core import DEFAULT_SCHEDULE, DraftSettings, GraftError
from graft_cli.core.defaults import MAX_LEVELS, both

SPECULATION, SAMPLING, OUTPUT = "Speculation", "Sampling", "Output"


def generate(
    prompt: Optional[str] = typer.Option(None, "--prompt", "-p", help="Prompt text."),
    prompt_file: Optional[str] = typer.Option(None, "--prompt-file", "-f", help="Read the prompt from FILE ('-' = stdin)."),
    jsonl: bool = typer.Option(False, "--jsonl", help="Input is JSONL: {id, prompt} or {id, messages} per line; output is JSONL."),
    model: Model = DEFAULT_MODEL,
    method: str = typer.Option("graft", "--method", rich_help_panel=SPECULATION, help="graft, dense, pruned, rest, recycling, pld or ar (see docs/architecture.md)."),
    draft: Draft = None,
    budget: Budget = None,
    tree: Optional[str] = typer.Option(None, "--tree", rich_help_panel=SPECULATION, help="How graft with a drafter shapes its tree: 'cost' (default: each step by expected tokens per second, docs/architecture.md) or 'fixed' (--depth levels and --prune-at checkpoints)."),
    depth: Optional[int] = typer.Option(None, "--depth", min=1, rich_help_panel=SPECULATION, help=f"Draft tree levels at most (default: {both('depth')}; {MAX_LEVELS} with --tree cost)."),
    draft_top_k: Optional[int] = typer.Option(None, "--draft-top-k", min=1, rich_help_panel=SPECULATION, help=f"Draft nodes expanded per level and children per node (default: {both('draft_top_k')})."),
    prune_at: Optional[str] = typer.Option(None, "--prune-at", rich_help_panel=SPECULATION, help=f"Pruning checkpoints LEVEL:THRESHOLD[:SHARE],... (default {DEFAULT_SCHEDULE}; 'none': no pruning)."),
    chain: bool = typer.Option(False, "--chain", rich_help_panel=SPECULATION, help="Draft a single chain; with graft: Graft(TAIL), retrieved tokens fill the tail."),
    draft_vocab: Optional[int] = typer.Option(None, "--draft-vocab", min=0, rich_help_panel=SPECULATION, help="A draft model scores only N tokens: the most frequent by `graft models vocab` (else the lowest ids), the special ones and the prompt's (default: the ranked tokens covering 99.99% of the corpus on a CPU, all on a GPU or without a ranking; 0: all)."),
    draft_window: Optional[int] = typer.Option(None, "--draft-window", rich_help_panel=SPECULATION, help=f"A draft model reads at most the first 4 and last N-4 prompt tokens (default: {both('draft_window')}; 0: the whole prompt). Retrieval reads all of it."),
    draft_weights: Optional[str] = typer.Option(None, "--draft-weights", rich_help_panel=SPECULATION, help=f"A draft model's linear weights: 'fp16' (FBGEMM's fp16 kernel, fp32 arithmetic: a CPU draft forward then reads half the bytes) or 'full' (the model's dtype); default: {both('draft_weights')}. The target is never touched."),
    rope_theta: Optional[float] = typer.Option(None, "--rope-theta", rich_help_panel=SPECULATION, help="RoPE base of an EAGLE-3 head (default: its config's, else 10000)."),
    adjacency_file: Optional[str] = typer.Option(None, "--adjacency-file", rich_help_panel=SPECULATION, help="Keep the recycling adjacency table in FILE across runs (safetensors)."),
    retrievers: Optional[str] = typer.Option(None, "--retrievers", rich_help_panel=SPECULATION, help="Comma-separated retriever plugins."),
    datastore: Datastore = None,
    retriever_opt: RetrieverOpt = [],
    raw: bool = typer.Option(False, "--raw", help="Do not apply the chat template."),
    max_new_tokens: MaxNewTokens = 256,
    temperature: float = typer.Option(0.0, "--temperature", "-t", min=0.0, rich_help_panel=SAMPLING, help="0 = greedy."),
    top_p: float = typer.Option(1.0, "--top-p", min=0.0, max=1.0, rich_help_panel=SAMPLING, help="Sample from the smallest set of tokens whose probability reaches P (1 = all)."),
    top_k: int = typer.Option(0, "--top-k", min=0, rich_help_panel=SAMPLING, help="Sample from the K most likely tokens only (0 = all)."),
    seed: Optional[int] = typer.Option(None, "--seed", rich_help_panel=SAMPLING, help="Same seed, same text, with every method (default: a random seed)."),
    device: Device = "auto",
    dtype: Dtype = "auto",
    device_map: DeviceMap = None,
    truncate: Truncate = None,
    stats: bool = typer.Option(False, "--stats", rich_help_panel=OUTPUT, help="Print decoding statistics to stderr."),
    prefill_chunk: int = typer.Option(512, "--prefill-chunk", min=1, rich_help_panel=DEVICE, help="Prompt tokens per prefill forward (bounds the prefill's peak memory; a progress bar shows on a terminal when the prefill takes over 2 s)."),
) -> None:
    """Generate text from a prompt, losslessly faster."""
    from graft_cli import methods
    from graft_cli.method_config import MethodConfig, parse_budget
    from graft_cli.runtime.limits import parse_truncate
    from graft_cli.runtime.loading import load_model, parse_device_map
    from graft_cli.runtime.sampling import Sampling

    try:
        sampling = Sampling(temperature, top_k, top_p)
    except ValueError as e:
        raise GraftError(str(e)) from e
    if prompt is not None and prompt_file is not None:
        raise GraftError("give either --prompt or --prompt-file, not both")
    if jsonl:
        lines = _read_text(prompt_file or "-").splitlines()
    else:
        text = prompt if prompt is not None else _read_text(prompt_file) if prompt_file else None
        if text is None:
            raise GraftError("no prompt: give --prompt TEXT or --prompt-file FILE ('-' for stdin)")
        if not text.strip():
            raise GraftError("the prompt is empty")
    options = retriever_options(retriever_opt, datastore)
    if adjacency_file:
        options["adjacency_file"] = adjacency_file
    drafting = DraftSettings(depth=depth, draft_top_k=draft_top_k, prune_at=prune_at, chain=chain,
                             rope_theta=rope_theta, draft_vocab=draft_vocab, draft_window=draft_window,
                             draft_weights=draft_weights)
    config = MethodConfig(method, parse_budget(budget), retrievers.split(",") if retrievers else None, options, draft,
                          drafting, tree=tree)
    methods.check(config)  # before the model loads: a wrong flag or store name should not cost seconds
    methods.check_datastore(config)
    truncate = parse_truncate(truncate)
    loaded = load_model(model, device, dtype, parse_device_map(device_map))
    session = _Session(loaded, config, sampling, max_new_tokens, seed, prefill_chunk)
    session.raw, session.truncate = raw, truncate
    try:
        _check_options(options, method)
        if jsonl:
            _run_jsonl(session, lines, raw, stats)
        else:
            run = session.run(text, stream=True)
            if stats:
                print(f"graft: {run.summary()}", file=sys.stderr)
    except BrokenPipeError:  # `graft generate ... | head`: the reader has what it wanted
        _silence_stdout()
        raise typer.Exit(0)
    finally:
        session.proposer.close()  # retrievers that keep state on disk (--adjacency-file) save it now


def _silence_stdout() -> None:
    """Point stdout at /dev/null so that the interpreter's last flush does not fail on the closed pipe again."""
    import os

    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)


def _check_options(options, method: str) -> None:
    """Every retriever option must be read by a retriever of this method (a typo is never silently ignored)."""
    flags = {"datastore": "--datastore", "adjacency_file": "--adjacency-file"}
    unread = options.unread()
    if unread:
        key = unread[0]
        what = flags.get(key, f"--retriever-opt {key}={options.peek(key)}")
        read = ", ".join(sorted(options.read)) or "none"
        raise GraftError(f"{what}: no retriever of --method {method} reads it (the options they read: {read})")


def _run_jsonl(session: "_Session", lines: list[str], raw: bool, stats: bool) -> None:
    """One output line per input line; a bad line gets an error record ``{"id", "line", "error"}`` on stdout (and
    a line on stderr) and the others still run. Any bad line makes the exit code 2 at the end."""
    failed = 0
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        record = None
        try:
            record = _parse_json(line)
            prompt = _prompt_of(record)
            run = session.run(prompt, stream=False, raw=raw)
        except GraftError as e:
            failed += 1
            rid = record.get("id") if isinstance(record, dict) else None
            print(json.dumps({"id": rid, "line": number, "error": str(e)}, ensure_ascii=False), flush=True)
            print(f"graft: error: line {number}: {e}", file=sys.stderr)
            continue
        out = {"id": record.get("id"), "text": session.last_text, "stats": run.as_dict()}
        print(json.dumps(out, ensure_ascii=False), flush=True)
        if stats:
            print(f"graft: {record.get('id')}: {run.summary()}", file=sys.stderr)
    if failed:
        raise GraftError(f"{failed} of the input lines failed (their error records are on stdout)")


class _Session:
    """One loaded model and method, reused across prompts (so retrievers and calibration stay warm)."""

    def __init__(self, loaded, config, sampling, max_new_tokens: int, seed: int | None, prefill_chunk: int) -> None:
        from graft_cli import methods
        from graft_cli.method_config import tree_reach
        from graft_cli.runtime.loading import stop_ids
        from graft_cli.prefill_bar import PrefillBar
        from graft_cli.runtime.target import Target

        self.loaded, self.sampling, self.max_new_tokens = loaded, sampling, max_new_tokens
        self.limits, self.depth, self.truncate = loaded.limits, tree_reach(config, loaded.device), None
        self.seed = seed if seed is not None else random.randrange(2**31)
        self.target = Target(loaded.model, prefill_chunk, PrefillBar())
        self.proposer = methods.build(config, loaded)
        self.stop = stop_ids(loaded)
        self.raw = False
        self.last_text = ""

    def run(self, prompt, stream: bool, raw: bool | None = None):
        from graft_cli.runtime.engine import decode
        from graft_cli.runtime.loading import encode
        from graft_cli.core import Stats

        ids = encode(self.loaded.tokenizer, prompt, self.raw if raw is None else raw)
        ids = self.limits.fit(ids, self.max_new_tokens, self.depth, self.truncate)  # before any forward
        stats = Stats()
        text = _Detokenizer(self.loaded.tokenizer, self.stop)
        steps = decode(self.target, self.proposer, ids, self.sampling, self.max_new_tokens, self.stop, self.seed, stats)
        for piece in text.feed(steps):
            if stream:
                sys.stdout.write(piece)
                sys.stdout.flush()
        if stream:
            sys.stdout.write("\n")
            sys.stdout.flush()
        self.last_text = text.text
        return stats


class _Detokenizer:
    """Turns token steps into text pieces, holding back a piece while it ends inside a UTF-8 character."""

    def __init__(self, tokenizer, stop: set[int]) -> None:
        self.tokenizer, self.stop = tokenizer, stop
        self.ids: list[int] = []
        self.text = ""

    def feed(self, steps: Iterator[list[int]]) -> Iterator[str]:
        for new in steps:
            self.ids.extend(t for t in new if t not in self.stop)
            full = self.tokenizer.decode(self.ids, skip_special_tokens=True)
            if full.endswith("\ufffd"):
                continue
            piece, self.text = full[len(self.text) :], full
            if piece:
                yield piece


def _read_text(source: str) -> str:
    try:
        data = sys.stdin.buffer.read() if source == "-" else Path(source).read_bytes()
    except FileNotFoundError:
        raise GraftError(f"prompt file not found: {source}") from None
    except OSError as e:
        raise GraftError(f"cannot read {source}: {e.strerror}") from None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise GraftError(f"{'stdin' if source == '-' else source} is not valid UTF-8 (byte {e.start})") from None


def _parse_json(line: str):
    try:
        return json.loads(line)
    except json.JSONDecodeError as e:
        raise GraftError(f"invalid JSON ({e.msg})") from None


def _prompt_of(record) -> str | list[dict]:
    """A JSONL record's non-empty "prompt" (text) or "messages" (a non-empty list of {"role", "content"} texts,
    which win when both are given)."""
    if not isinstance(record, dict) or not ("prompt" in record or "messages" in record):
        raise GraftError('expected an object with "prompt" (text) or "messages" (a list)')
    if "prompt" in record and record.get("messages") in (None, []):  # an empty "messages" beside a prompt: the prompt
        prompt = record["prompt"]
        if not isinstance(prompt, str):
            raise GraftError(f'"prompt" must be text, not {type(prompt).__name__}')
        if not prompt.strip():
            raise GraftError("the prompt is empty")
        return prompt
    messages = record["messages"]
    if not isinstance(messages, list) or not messages:
        raise GraftError('"messages" must be a non-empty list')
    for i, m in enumerate(messages):
        if not (isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)):
            raise GraftError(f'messages[{i}] must be an object with "role" and "content" texts')
    return messages
