"""`graft index build | info | query | list | rm`: on-disk token datastores.

Results go to stdout; progress (Rich, on stderr) and notes (skipped files, ...) to stderr. Stores live under
``$GRAFT_HOME/datastores/<name>`` unless ``--out`` puts them elsewhere; every command takes a name or a path.
Only cheap imports at module level: the datastore code (numpy, tokenizers, faiss) loads when a command runs.
"""

from __future__ import annotations

import json
import os
import sys
import time
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Iterator, List, Optional

import typer

from graft_cli.cli.build_progress import BuildProgress
from graft_cli.catalog.entries import DEFAULT_MODEL
from graft_cli.core import GraftError
from graft_cli.cli.index_report import (
    QueryRun,
    build_report,
    human_size,
    info_summary,
    info_text,
    print_query,
    print_store_list,
    query_data,
)

if TYPE_CHECKING:
    from tokenizers import Tokenizer

    from datastores.store import StoreMeta

index_app = typer.Typer(no_args_is_help=True, help="Build and manage on-disk token datastores.")


@contextmanager
def _errors() -> Iterator[None]:
    """Datastore errors become one-line GraftErrors."""
    from datastores.errors import DatastoreError

    try:
        yield
    except DatastoreError as e:
        raise GraftError(str(e)) from e


def _home() -> Path:
    from graft_cli.catalog.home import graft_home

    return graft_home()


def _stores_root() -> Path:
    return _home() / "datastores"


def _resolve(spec: str) -> Path:
    from datastores.store import resolve_store

    with _errors():
        return resolve_store(spec, _home())


# --------------------------------------------------------------------------------------------------- build


@index_app.command("build")
def build(
    corpus: List[str] = typer.Argument(..., help="Files, directories, or '-' (JSONL or text on stdin)."),
    model: str = typer.Option(DEFAULT_MODEL, "--model", "-m", help="Catalog name or model directory (its tokenizer; ngram: also its embeddings)."),
    kind: str = typer.Option("suffix-array", "--kind", "-k", help="suffix-array or ngram."),
    name: Optional[str] = typer.Option(None, "--name", help="Store name under $GRAFT_HOME/datastores (default: the corpus's name)."),
    out: Optional[Path] = typer.Option(None, "--out", "-o", help="Store directory (instead of --name)."),
    field: List[str] = typer.Option([], "--field", help="JSONL/Parquet field to index, dotted (repeatable; default: messages, text, or every string field)."),
    ext: List[str] = typer.Option([], "--ext", help="Only these file extensions in directories (repeatable; default: text, markdown and code)."),
    stdin_format: str = typer.Option("auto", "--stdin-format", help="For '-': auto, jsonl or text."),
    jobs: int = typer.Option(0, "--jobs", "-j", help="Tokenizer processes (0: one per core).", show_default="all cores"),
    shard: Optional[str] = typer.Option(None, "--shard", help="Build only shard I/N (I from 0) of the store, e.g. one per machine."),
    force: bool = typer.Option(False, "--force", help="Replace an existing store (or shard)."),
    ngram_n: Optional[int] = typer.Option(None, "--n", help="ngram: context length (3)."),
    top_k: Optional[int] = typer.Option(None, "--top-k", help="ngram: next tokens kept per context (8)."),
    min_count: Optional[int] = typer.Option(None, "--min-count", help="ngram: drop contexts seen fewer times (2)."),
    max_contexts: Optional[int] = typer.Option(None, "--max-contexts", help="ngram: keep the most frequent contexts (1,000,000)."),
    dim: Optional[int] = typer.Option(None, "--dim", help="ngram: embedding dimensions after PCA (64)."),
    faiss_index: Optional[str] = typer.Option(None, "--faiss", help="ngram: auto, flat, ivf or hnsw (auto)."),
    nprobe: Optional[int] = typer.Option(None, "--nprobe", help="ngram: IVF lists searched per query (8)."),
    decay: Optional[float] = typer.Option(None, "--decay", help="ngram: weight ratio of each earlier context position (0.7)."),
    as_json: bool = typer.Option(False, "--json", help="Print the shard's manifest summary as JSON."),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="No progress display."),
) -> None:
    """Build a datastore from a corpus (atomically: an interrupted build leaves nothing behind)."""
    from datastores.build import BuildSpec, build_shard
    from datastores.store import parse_shard
    from graft_cli.catalog.resolve import resolve_model

    params = _ngram_params(n=ngram_n, top_k=top_k, min_count=min_count, max_contexts=max_contexts, dim=dim,
                           index=faiss_index, nprobe=nprobe, decay=decay)
    _check_build_options(kind, name, out, params, stdin_format)
    with _errors():
        parsed_shard = parse_shard(shard)
    dest = out if out is not None else _named_store(name, corpus)
    spec = BuildSpec(corpus, dest, resolve_model(model), model_name=model, kind=kind, shard=parsed_shard, force=force,
                     fields=field, extensions=ext or None, stdin_format=stdin_format,
                     jobs=jobs if jobs > 0 else (os.cpu_count() or 1), params=params)
    with _errors(), BuildProgress(not quiet) as progress:
        manifest = build_shard(spec, progress)
    typer.echo(build_report(manifest, dest, as_json))


def _ngram_params(**given: Optional[float | int | str]) -> dict:
    """The n-gram build parameters given on the command line (those left out take the store's defaults)."""
    return {k: v for k, v in given.items() if v is not None}


def _check_build_options(kind: str, name: Optional[str], out: Optional[Path], params: dict, stdin_format: str) -> None:
    """The options that contradict each other or name nothing, refused before anything is read."""
    from datastores.store import KINDS

    if kind not in KINDS:
        raise GraftError(f"unknown --kind {kind!r} (choose {' or '.join(KINDS)})")
    if name and out:
        raise GraftError("give --name or --out, not both")
    if params and kind != "ngram":
        raise GraftError(f"--{', --'.join(k.replace('_', '-') for k in params)} only apply to --kind ngram")
    if stdin_format not in ("auto", "jsonl", "text"):
        raise GraftError(f"--stdin-format must be auto, jsonl or text, not {stdin_format!r}")


def _named_store(name: Optional[str], corpus: List[str]) -> Path:
    """The store directory under $GRAFT_HOME/datastores: ``--name``, or else the first corpus path's name."""
    if not name:
        first = corpus[0]
        if first == "-":
            raise GraftError("a store built from stdin needs --name or --out")
        name = Path(first.rstrip("/")).resolve().name.split(".")[0] or "store"
    if "/" in name or name.startswith(".") or name in ("", ".."):
        raise GraftError(f"--name {name!r} is not a plain name (use --out for a path)")
    return _stores_root() / name


# --------------------------------------------------------------------------------------------------- info


@index_app.command("info")
def info(
    store: str = typer.Argument(..., help="Store name or path."),
    verify: bool = typer.Option(False, "--verify", help="Check every file's full SHA-256 (reads the whole store)."),
    as_json: bool = typer.Option(False, "--json", help="JSON on stdout."),
) -> None:
    """Show a store's manifest summary and check its files."""
    from datastores.store import read_store

    path = _resolve(store)
    with _errors():
        meta = read_store(path)
    problem = _problem(meta, verify)
    summary = info_summary(meta, _status(meta, problem), verify)
    typer.echo(json.dumps(summary, indent=2) if as_json else info_text(meta, summary))
    if problem is not None:
        raise GraftError(problem)


def _problem(meta: StoreMeta, verify: bool = False) -> str | None:
    """What is wrong with a store's files (sizes, sampled and full checksums), or None; reported, not raised, so
    that ``info`` and ``list`` describe damaged stores too."""
    from datastores.store import check_files

    try:
        for d, m in meta.shards:
            check_files(d, m, verify=verify)
    except Exception as e:  # noqa: BLE001 - a damaged store may fail in any way (unreadable files included)
        return str(e)
    return None


def _status(meta: StoreMeta, problem: str | None) -> str:
    """The one word `info` and `list` show for a store's state (or its problem)."""
    return problem or ("ok" if meta.complete else "incomplete")


# --------------------------------------------------------------------------------------------------- query


def _store_tokenizer(path: Path, meta: StoreMeta, model: Optional[str]) -> Tokenizer:
    """The tokenizer a query is encoded with: the store's copy, or ``--model``'s, refused unless it is the one the
    store was built with (other token ids would match nothing, or the wrong text)."""
    from datastores.fingerprint import fingerprint_from_rust
    from datastores.tokenize import load_tokenizer

    if model:
        from graft_cli.catalog.resolve import resolve_model

        source = resolve_model(model)
    else:
        source = path / "tokenizer.json"
        if not source.is_file():
            raise GraftError(f"datastore {path} has no tokenizer copy; give --model")
    with _errors():
        tok = load_tokenizer(source)
    if fingerprint_from_rust(tok) != meta.fingerprint:
        raise GraftError(
            f"datastore {path} was built with another tokenizer ({meta.model}, {meta.fingerprint}) than {source}"
        )
    return tok


@index_app.command("query")
def query(
    store: str = typer.Argument(..., help="Store name or path."),
    text: Optional[str] = typer.Option(None, "--text", "-t", help="The context (default: stdin)."),
    budget: int = typer.Option(16, "--budget", "-b", min=1, help="Continuation nodes to retrieve."),
    max_match: int = typer.Option(16, "--max-match", min=1, help="suffix-array: longest suffix tried."),
    min_match: int = typer.Option(2, "--min-match", min=1, help="suffix-array: shortest suffix accepted."),
    depth: int = typer.Option(8, "--depth", min=1, help="Longest continuation."),
    max_occurrences: int = typer.Option(512, "--max-occurrences", min=1, help="suffix-array: occurrences counted."),
    neighbours: int = typer.Option(8, "--neighbours", min=0, help="ngram: nearest contexts consulted."),
    min_sim: float = typer.Option(0.8, "--min-sim", help="ngram: similarity a neighbour needs."),
    model: Optional[str] = typer.Option(None, "--model", "-m", help="Tokenise with this model's tokenizer instead of the store's copy."),
    as_json: bool = typer.Option(False, "--json", help="JSON on stdout."),
) -> None:
    """Show what a store would retrieve after TEXT: the matched suffix, the continuations and their scores."""
    from datastores.store import open_store

    if text is None:
        text = sys.stdin.read()
    if not text:
        raise GraftError("no text to query (--text TEXT or stdin)")
    path = _resolve(store)
    with _errors():
        t0 = time.perf_counter()
        index = open_store(path)
        open_ms = (time.perf_counter() - t0) * 1e3
    tok = _store_tokenizer(path, index.meta, model)
    ids = tok.encode(text, add_special_tokens=False).ids
    if not ids:
        raise GraftError("the text encodes to no tokens")
    params = (
        dict(max_match=max_match, min_match=min_match, depth=depth, max_occurrences=max_occurrences)
        if index.kind == "suffix-array"
        else dict(neighbours=neighbours, min_sim=min_sim, depth=depth)
    )
    with _errors():
        t0 = time.perf_counter()
        result = index.lookup(ids, budget=budget, **params)
        query_ms = (time.perf_counter() - t0) * 1e3
    run = QueryRun(path, index, tok, ids, result, open_ms, query_ms)
    data = query_data(run)
    if as_json:
        typer.echo(json.dumps(data, indent=2, ensure_ascii=False))
    else:
        print_query(run, data, min_match)


# --------------------------------------------------------------------------------------------------- list, rm


@index_app.command("list")
def list_(as_json: bool = typer.Option(False, "--json", help="One JSON array on stdout.")) -> None:
    """The stores under $GRAFT_HOME/datastores with kind, model, size and tokens."""
    from datastores.store import list_stores

    root = _stores_root()
    found = list_stores(root)
    rows = []
    for item in found:
        if isinstance(item, tuple):
            p, problem = item
            rows.append({"name": p.name, "path": str(p), "status": problem})
            continue
        s = item.summary()
        rows.append(
            {
                "name": item.path.name,
                "path": s["path"],
                "kind": s["kind"],
                "model": s["model"],
                "tokens": s["tokens"],
                "documents": s["documents"],
                "bytes": s["bytes"],
                "shards": f"{len(item.shards)}/{item.shard_count}",
                "created": s["created"],
                "status": _status(item, _problem(item)),  # the state `info` shows
            }
        )
    if as_json:
        typer.echo(json.dumps(rows, indent=2))
        return
    if not rows:
        typer.echo(f"no datastores in {root} (build one with `graft index build CORPUS --name NAME`)")
        return
    print_store_list(rows, root)


@index_app.command("rm")
def rm(store: str = typer.Argument(..., help="Store name or path.")) -> None:
    """Delete a store (refuses directories that are not datastores)."""
    from datastores.store import remove_store

    path = _resolve(store)
    with _errors():
        freed = remove_store(path)
    typer.echo(f"removed {path} ({human_size(freed)})")
