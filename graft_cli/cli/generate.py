"""``graft generate``: text streams to stdout as it is accepted; stats and progress go to stderr."""

from __future__ import annotations

import json
import os
import random
import sys
from pathlib import Path
from typing import TYPE_CHECKING, List, Optional

import typer

from graft_cli.catalog.entries import DEFAULT_MODEL
from graft_cli.core.defaults import PREFIX_CACHE_MIB
from graft_cli.cli.options import (
    AdjacencyFile, Budget, Chain, Datastore, Depth, Device, DeviceMap, Forward, Draft, DraftAhead, DraftTopK, DraftVocab,
    DraftWeights, DraftWindow, Dtype, Graphs, MaxNewTokens, Method, Model, PrefillChunk, PrefixCache, PruneAt,
    RetrieverOpt, Retrievers, RopeTheta, Threads, TreeShape, Truncate, method_config,
)
from graft_cli.core import GraftError

if TYPE_CHECKING:
    from graft_cli.api import Generator
    from graft_cli.method.config import MethodConfig

INPUT, SAMPLING, OUTPUT = "Input", "Sampling", "Output"


def generate(
    text: Optional[str] = typer.Argument(None, metavar="PROMPT", help="The prompt (or --prompt, --prompt-file, stdin with -f -)."),
    prompt: Optional[str] = typer.Option(None, "--prompt", "-p", rich_help_panel=INPUT, help="Prompt text."),
    prompt_file: Optional[str] = typer.Option(None, "--prompt-file", "-f", rich_help_panel=INPUT, help="Read the prompt from FILE ('-' = stdin)."),
    jsonl: bool = typer.Option(False, "--jsonl", rich_help_panel=INPUT, help="Input is JSONL: {id, prompt} or {id, messages} per line; output is JSONL."),
    model: Model = DEFAULT_MODEL,
    method: Method = "graft",
    draft: Draft = None,
    budget: Budget = None,
    tree: TreeShape = None,
    depth: Depth = None,
    draft_top_k: DraftTopK = None,
    prune_at: PruneAt = None,
    chain: Chain = False,
    draft_vocab: DraftVocab = None,
    draft_window: DraftWindow = None,
    draft_weights: DraftWeights = None,
    draft_ahead: DraftAhead = None,
    rope_theta: RopeTheta = None,
    adjacency_file: AdjacencyFile = None,
    retrievers: Retrievers = None,
    datastore: Datastore = None,
    retriever_opt: RetrieverOpt = [],
    system: Optional[str] = typer.Option(None, "--system", "-s", rich_help_panel=INPUT, help="A system prompt, before the prompt in the chat template."),
    raw: bool = typer.Option(False, "--raw", rich_help_panel=INPUT, help="Do not apply the chat template."),
    max_new_tokens: MaxNewTokens = 256,
    temperature: float = typer.Option(0.0, "--temperature", "-t", min=0.0, rich_help_panel=SAMPLING, help="0 = greedy."),
    top_p: float = typer.Option(1.0, "--top-p", min=0.0, max=1.0, rich_help_panel=SAMPLING, help="Sample from the smallest set of tokens whose probability reaches P (1 = all)."),
    top_k: int = typer.Option(0, "--top-k", min=0, rich_help_panel=SAMPLING, help="Sample from the K most likely tokens only (0 = all)."),
    seed: Optional[int] = typer.Option(None, "--seed", rich_help_panel=SAMPLING, help="Same seed, same text, with every method (default: a random seed)."),
    stop: List[str] = typer.Option([], "--stop", rich_help_panel=OUTPUT, help="End the answer before this text (repeatable; backslash escapes as \\n, \\t, \\xHH are read)."),
    json_schema: Optional[str] = typer.Option(None, "--json-schema", rich_help_panel=OUTPUT, help="The answer is JSON valid under the schema in FILE ('-' = stdin; '{}' in it: any JSON)."),
    regex: Optional[str] = typer.Option(None, "--regex", rich_help_panel=OUTPUT, help="The answer matches this regular expression whole."),
    device: Device = "auto",
    dtype: Dtype = "auto",
    device_map: DeviceMap = None,
    forward: Forward = "auto",
    truncate: Truncate = None,
    stats: bool = typer.Option(False, "--stats", rich_help_panel=OUTPUT, help="Print decoding statistics to stderr."),
    prefill_chunk: PrefillChunk = 512,
    graphs: Graphs = "auto",
    threads: Threads = None,
    prefix_cache: PrefixCache = PREFIX_CACHE_MIB,
) -> None:
    """Generate text from a prompt, losslessly faster."""
    from graft_cli.api import open_generator
    from graft_cli.cli.prefill_bar import PrefillBar

    grammar = _grammar(json_schema, regex, prompt_file)  # a bad schema or pattern fails before the model loads
    text, lines = _prompt_input(text, prompt, prompt_file, jsonl)
    config = _config(locals(), jsonl)
    settings = dict(system=system, max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p, top_k=top_k,
                    seed=seed if seed is not None else random.randrange(2**31), stop=_stops(stop), raw=raw,
                    truncate=truncate, grammar=grammar)  # one seed for the whole run: a batch's lines sample as they would alone
    _run(open_generator(model, config, device, dtype, device_map, prefill_chunk, PrefillBar(), graphs,
                        threads=threads, prefix_cache=prefix_cache, forward=forward), text, lines, settings, stats)


def _run(generator: Generator, text: str | None, lines: list[str] | None, settings: dict, stats: bool) -> None:
    """The prompt, or the batch's lines, through ``generator``, closed at the end whatever happens."""
    try:
        if lines is not None:
            _run_jsonl(generator, lines, settings, stats)
        else:
            _run_one(generator, text, settings, stats)
    except BrokenPipeError:  # `graft generate ... | head`: the reader has what it wanted
        _silence_stdout()
        raise typer.Exit(0)
    finally:
        generator.close()  # retrievers that keep state on disk (--adjacency-file) save it now


def _prompt_input(text: str | None, prompt: str | None, prompt_file: str | None,
                  jsonl: bool) -> tuple[str | None, list[str] | None]:
    """The one prompt given (an argument, --prompt or --prompt-file), or with ``--jsonl`` the batch's lines: read
    and checked before the model loads."""
    given = [x for x in (text, prompt, prompt_file) if x is not None]
    if len(given) > 1:
        raise GraftError("give the prompt once: as an argument, --prompt or --prompt-file")
    if jsonl:
        return None, _read_text(prompt_file or "-").splitlines()
    text = prompt_file and _read_text(prompt_file) or (given[0] if given else None)
    if text is None:
        raise GraftError("no prompt: give it as an argument, --prompt TEXT or --prompt-file FILE ('-' for stdin)")
    if not text.strip():
        raise GraftError("the prompt is empty")
    return text, None


def _config(params: dict, jsonl: bool) -> MethodConfig:
    """The command's method; a batch repeats itself, so its answers are retrieved from too (unless --retrievers
    says otherwise)."""
    from graft_cli.method.config import with_response_cache

    config = method_config(params)
    return with_response_cache(config) if jsonl else config


def _stops(stop: list[str]) -> list[str]:
    """``--stop`` texts with their backslash escapes read, as llama.cpp reads them."""
    from graft_cli.cli.escapes import unescape

    return [unescape(s) for s in stop]


def _run_one(generator: Generator, text: str, settings: dict, stats: bool) -> None:
    """The answer streamed to stdout as it is accepted, then a newline; the statistics on stderr."""
    stream = generator.stream(text, **settings)
    for piece in stream:
        sys.stdout.write(piece.text)
        sys.stdout.flush()
    sys.stdout.write("\n")
    sys.stdout.flush()
    if stats:
        print(f"graft: {stream.completion.stats.summary()}", file=sys.stderr)
    if settings["grammar"] is not None and stream.completion.finish_reason == "length":
        print(f"graft: the answer was cut by --max-new-tokens before it matched the {settings['grammar'].what}: "
              "it is incomplete", file=sys.stderr)
        raise typer.Exit(1)


def _grammar(json_schema: str | None, regex: str | None, prompt_file: str | None):
    """The grammar of ``--json-schema FILE`` or ``--regex``, checked (None: free text)."""
    from graft_cli.grammar import json_schema as schema_grammar, regex as regex_grammar

    if json_schema is not None and regex is not None:
        raise GraftError("give --json-schema or --regex, not both")
    if json_schema == "-" and prompt_file == "-":
        raise GraftError("stdin can hold the prompt or the schema, not both")
    if json_schema is not None:
        return schema_grammar(_read_text(json_schema, "schema file"))
    return None if regex is None else regex_grammar(regex)


def _silence_stdout() -> None:
    """Point stdout at /dev/null so that the interpreter's last flush does not fail on the closed pipe again."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)


def _run_jsonl(generator: Generator, lines: list[str], settings: dict, stats: bool) -> None:
    """One output line per input line; a bad line gets an error record ``{"id", "line", "error"}`` on stdout (and
    a line on stderr) and the others still run. Any bad line makes the exit code 2 at the end."""
    failed = 0
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        record = None
        try:
            record = _parse_json(line)
            completion = generator.generate(_prompt_of(record), **settings)
        except GraftError as e:
            failed += 1
            rid = record.get("id") if isinstance(record, dict) else None
            print(json.dumps({"id": rid, "line": number, "error": str(e)}, ensure_ascii=False), flush=True)
            print(f"graft: error: line {number}: {e}", file=sys.stderr)
            continue
        out = {"id": record.get("id"), "text": completion.text, "finish_reason": completion.finish_reason,
               "stats": completion.stats.as_dict()}
        print(json.dumps(out, ensure_ascii=False), flush=True)
        if stats:
            print(f"graft: {record.get('id')}: {completion.stats.summary()}", file=sys.stderr)
    if failed:
        raise GraftError(f"{failed} of the input lines failed (their error records are on stdout)")


def _read_text(source: str, what: str = "prompt file") -> str:
    try:
        data = sys.stdin.buffer.read() if source == "-" else Path(source).read_bytes()
    except FileNotFoundError:
        raise GraftError(f"{what} not found: {source}") from None
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
        raise GraftError(f"invalid JSON: {e.msg.removesuffix(' at')} at column {e.colno}") from None


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
    return messages  # each message is checked where every caller's are (graft_cli/api/text.py)
