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
from typing import Iterator, List, Optional

import typer

from graft_cli.build_progress import BuildProgress, short_count
from graft_cli.catalog.entries import DEFAULT_MODEL
from graft_cli.errors import GraftError

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


def _size(n: Optional[float]) -> str:
    if n is None:
        return "-"
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{int(n)} B"


def _stdout_console():
    from rich.console import Console

    console = Console()
    if not console.is_terminal:  # piped: never wrap table rows
        console = Console(width=200)
    return console


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
    from datastores.store import KINDS, parse_shard

    if kind not in KINDS:
        raise GraftError(f"unknown --kind {kind!r} (choose {' or '.join(KINDS)})")
    if name and out:
        raise GraftError("give --name or --out, not both")
    ngram_params = {
        k: v
        for k, v in {
            "n": ngram_n, "top_k": top_k, "min_count": min_count, "max_contexts": max_contexts,
            "dim": dim, "index": faiss_index, "nprobe": nprobe, "decay": decay,
        }.items()
        if v is not None
    }
    if ngram_params and kind != "ngram":
        raise GraftError(f"--{', --'.join(k.replace('_', '-') for k in ngram_params)} only apply to --kind ngram")
    if stdin_format not in ("auto", "jsonl", "text"):
        raise GraftError(f"--stdin-format must be auto, jsonl or text, not {stdin_format!r}")
    with _errors():
        index, count = parse_shard(shard)
    if out is not None:
        dest = out
    else:
        if not name:
            first = corpus[0]
            if first == "-":
                raise GraftError("a store built from stdin needs --name or --out")
            name = Path(first.rstrip("/")).resolve().name.split(".")[0] or "store"
        if "/" in name or name.startswith(".") or name in ("", ".."):
            raise GraftError(f"--name {name!r} is not a plain name (use --out for a path)")
        dest = _stores_root() / name
    from graft_cli.catalog.resolve import resolve_model

    model_dir = resolve_model(model)
    jobs = jobs if jobs > 0 else (os.cpu_count() or 1)
    from datastores.build import build_store

    with _errors(), BuildProgress(not quiet) as progress:
        manifest = build_store(
            corpus,
            dest,
            model_dir=model_dir,
            model_name=model,
            kind=kind,
            shard=(index, count),
            force=force,
            fields=field,
            extensions=ext or None,
            stdin_format=stdin_format,
            jobs=jobs,
            params=ngram_params,
            progress=progress,
        )
    c, b = manifest["corpus"], manifest["build"]
    data_bytes = sum(f["bytes"] for f in manifest["files"].values())
    if as_json:
        summary = {
            "path": str(Path(dest).expanduser().absolute()),
            "kind": kind,
            "shard": manifest["shard"],
            "model": manifest["model"],
            "documents": c["documents"],
            "tokens": c["tokens"],
            "files": c["files"],
            "skipped_files": len(c["skipped_files"]),
            "skipped_records": sum(c["skipped_records"].values()),
            "data_bytes": data_bytes,
            "bytes_per_token": round(data_bytes / c["tokens"], 3),
            "build": b,
            "index": manifest["index"],
        }
        typer.echo(json.dumps(summary, indent=2))
        return
    where = Path(dest).expanduser().absolute()
    shard_s = f" shard {index}/{count}" if count > 1 else ""
    skipped = ""
    if c["skipped_files"] or c["skipped_records"]:
        skipped = f"; skipped {len(c['skipped_files'])} files, {sum(c['skipped_records'].values()):,} records"
    typer.echo(
        f"built {kind} store{shard_s} {where}: {c['documents']:,} documents, {c['tokens']:,} tokens from "
        f"{c['files']} files{skipped}; {_size(data_bytes)} ({data_bytes / c['tokens']:.2f} bytes/token); "
        f"tokenise {b['tokenize_s']:.1f} s, index {b['index_s']:.1f} s "
        f"({short_count(b['index_tokens_per_s'] or 0)} tokens/s)"
    )


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
    summary = meta.summary()
    first = meta.first
    c = first["corpus"]
    summary["corpus"] = {
        "files": c["files"],
        "sources": [s["path"] for s in c["sources"][:20]] + (["…"] if len(c["sources"]) > 20 else []),
        "skipped_files": sum(len(m["corpus"]["skipped_files"]) for _, m in meta.shards),
        "skipped_records": sum(sum(m["corpus"]["skipped_records"].values()) for _, m in meta.shards),
        "fields": c.get("fields", []),
        "digest": c.get("digest"),
    }
    summary["index"] = [m["index"] for _, m in meta.shards] if len(meta.shards) > 1 else first["index"]
    summary["build"] = [m["build"] for _, m in meta.shards] if len(meta.shards) > 1 else first["build"]
    summary["status"] = _status(meta, problem)
    summary["verified"] = "sha256" if verify else "sha256 of the files changed since they last matched"
    if as_json:
        typer.echo(json.dumps(summary, indent=2))
    else:
        rows = [
            ("path", summary["path"]),
            ("kind", summary["kind"]),
            ("model", summary["model"]),
            ("tokenizer", f"{first['tokenizer']['fingerprint']} (vocabulary {first['tokenizer']['vocab_size']:,})"),
            ("shards", f"{len(meta.shards)} of {meta.shard_count} built"
             + (f" (missing {', '.join(map(str, meta.missing))})" if meta.missing else "")),
            ("documents", f"{summary['documents']:,}"),
            ("tokens", f"{summary['tokens']:,}"),
            ("size", f"{_size(summary['bytes'])} on disk, {_size(summary['data_bytes'])} of index "
             f"({summary['bytes_per_token']} bytes/token)"),
            ("corpus", f"{c['files']} files" + (f", fields {', '.join(c['fields'])}" if c.get("fields") else "")
             + f"; skipped {summary['corpus']['skipped_files']} files, {summary['corpus']['skipped_records']:,} records"),
            ("params", ", ".join(f"{k}={v}" for k, v in first["params"].items()) or "-"),
            ("created", summary["created"]),
            ("status", summary["status"] + f" ({summary['verified']})"),
        ]
        width = max(len(k) for k, _ in rows)
        for k, v in rows:
            typer.echo(f"{k:<{width}}  {v}")
    if problem is not None:
        raise GraftError(problem)


def _problem(meta, verify: bool = False) -> str | None:
    """What is wrong with a store's files (sizes, sampled and full checksums), or None; reported, not raised, so
    that ``info`` and ``list`` describe damaged stores too."""
    from datastores.store import check_files

    try:
        for d, m in meta.shards:
            check_files(d, m, verify=verify)
    except Exception as e:  # noqa: BLE001 - a damaged store may fail in any way (unreadable files included)
        return str(e)
    return None


def _status(meta, problem: str | None) -> str:
    return problem or ("ok" if meta.complete else "incomplete")


# --------------------------------------------------------------------------------------------------- query


def _store_tokenizer(path: Path, meta, model: Optional[str]):
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
    matched = ids[len(ids) - result.match_len :] if result.match_len else []
    paths = result.paths()
    data = {
        "store": str(path),
        "kind": index.kind,
        "tokens": len(ids),
        "match_len": result.match_len,
        "matched": tok.decode(matched) if matched else "",
        "matched_ids": matched,
        "occurrences": result.occurrences,
        "counted": result.counted,
        "open_ms": round(open_ms, 3),
        "query_ms": round(query_ms, 3),
        "continuations": [
            {"text": tok.decode(p), "ids": p, "depth": len(p), "count": c, "score": round(s, 6)} for p, s, c in paths
        ],
    }
    if index.kind == "ngram":
        data["neighbours"] = [{"similarity": round(s, 4), "context": tok.decode(c), "ids": c} for s, c in result.neighbours]
    if as_json:
        typer.echo(json.dumps(data, indent=2, ensure_ascii=False))
        return
    console = _stdout_console()
    from rich.table import Table

    if index.kind == "suffix-array":
        if result.match_len:
            console.print(
                f"matched suffix ({result.match_len} tokens): {data['matched']!r} — {result.occurrences:,} "
                f"occurrences, {result.counted:,} counted; {query_ms:.3f} ms",
                markup=False, highlight=False,
            )
        else:
            console.print(f"no suffix of at least {min_match} tokens occurs in the store ({query_ms:.3f} ms)", markup=False)
    else:
        console.print(
            f"context {tok.decode(ids[-index.n:])!r}: {'exact match' if result.match_len else 'no exact match'}, "
            f"{len(result.neighbours)} neighbours; {query_ms:.3f} ms",
            markup=False, highlight=False,
        )
        for s, c in result.neighbours[:5]:
            console.print(f"  {s:.3f}  {tok.decode(c)!r}", markup=False, highlight=False)
    if not paths:
        return
    table = Table(box=None, pad_edge=False, header_style="bold")
    for col in ("#", "SCORE", "COUNT", "DEPTH", "CONTINUATION"):
        table.add_column(col, justify="right" if col != "CONTINUATION" else "left", no_wrap=col != "CONTINUATION")
    for i, (p, s, c) in enumerate(paths, start=1):
        table.add_row(str(i), f"{s:.3f}", f"{c:,}", str(len(p)), repr(tok.decode(p)))
    console.print(table, markup=False, highlight=False)


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
    from rich.table import Table

    table = Table(box=None, pad_edge=False, header_style="bold")
    for col in ("NAME", "KIND", "MODEL", "TOKENS", "SIZE", "SHARDS", "CREATED", "STATUS"):
        table.add_column(col, no_wrap=col != "STATUS")
    for r in rows:
        if "kind" not in r:
            table.add_row(r["name"], "-", "-", "-", "-", "-", "-", r["status"])
        else:
            table.add_row(r["name"], r["kind"], r["model"], short_count(r["tokens"]), _size(r["bytes"]), r["shards"],
                          r["created"][:16].replace("T", " "), r["status"])
    console = _stdout_console()
    console.print(table, markup=False, highlight=False)
    console.print(f"stores live in {root} (set GRAFT_HOME to move them)", markup=False, highlight=False)


@index_app.command("rm")
def rm(store: str = typer.Argument(..., help="Store name or path.")) -> None:
    """Delete a store (refuses directories that are not datastores)."""
    from datastores.store import remove_store

    path = _resolve(store)
    with _errors():
        freed = remove_store(path)
    typer.echo(f"removed {path} ({_size(freed)})")
