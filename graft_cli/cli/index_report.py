"""What `graft index` prints on stdout: a build's summary, a store's description, a query's retrieval, the list of
stores; each as text for people or as JSON for scripts. Apart from the commands (graft_cli/cli/index.py), which
check the options and run the datastore code."""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING, Optional

from graft_cli.cli.build_progress import short_count

if TYPE_CHECKING:
    from rich.console import Console
    from tokenizers import Tokenizer

    from datastores.ngram_faiss import NgramIndex
    from datastores.store import StoreMeta
    from datastores.suffix_array import Lookup, SuffixArrayIndex

INFO_SOURCES = 20  # corpus sources `graft index info` names; the rest are an ellipsis
QUERY_NEIGHBOURS = 5  # nearest contexts a text query shows


def human_size(n: Optional[float]) -> str:
    """A byte count, short: 3.9 MB."""
    if n is None:
        return "-"
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{int(n)} B"


def stdout_console() -> Console:
    """A Rich console on stdout that, when piped, never wraps a table row."""
    from rich.console import Console

    console = Console()
    if not console.is_terminal:
        console = Console(width=200)
    return console


# --------------------------------------------------------------------------------------------------- build


def build_report(manifest: dict, dest: Path, as_json: bool) -> str:
    """A finished build: one line (what, where, how big, how fast), or its summary as JSON."""
    c, b = manifest["corpus"], manifest["build"]
    data_bytes = sum(f["bytes"] for f in manifest["files"].values())
    where = Path(dest).expanduser().absolute()
    if as_json:
        summary = {
            "path": str(where),
            "kind": manifest["kind"],
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
        return json.dumps(summary, indent=2)
    index, count = manifest["shard"]["index"], manifest["shard"]["count"]
    shard_s = f" shard {index}/{count}" if count > 1 else ""
    skipped = ""
    if c["skipped_files"] or c["skipped_records"]:
        skipped = f"; skipped {len(c['skipped_files'])} files, {sum(c['skipped_records'].values()):,} records"
    return (
        f"built {manifest['kind']} store{shard_s} {where}: {c['documents']:,} documents, {c['tokens']:,} tokens from "
        f"{c['files']} files{skipped}; {human_size(data_bytes)} ({data_bytes / c['tokens']:.2f} bytes/token); "
        f"tokenise {b['tokenize_s']:.1f} s, index {b['index_s']:.1f} s "
        f"({short_count(b['index_tokens_per_s'] or 0)} tokens/s)"
    )


# --------------------------------------------------------------------------------------------------- info


def info_summary(meta: StoreMeta, status: str, verify: bool) -> dict:
    """A store's description: the manifests' summary with the corpus, the index and build of each shard, and the
    state of its files (``status``) with how thoroughly that was checked."""
    summary = meta.summary()
    first = meta.first
    c = first["corpus"]
    summary["corpus"] = {
        "files": c["files"],
        "sources": [s["path"] for s in c["sources"][:INFO_SOURCES]] + (["…"] if len(c["sources"]) > INFO_SOURCES else []),
        "skipped_files": sum(len(m["corpus"]["skipped_files"]) for _, m in meta.shards),
        "skipped_records": sum(sum(m["corpus"]["skipped_records"].values()) for _, m in meta.shards),
        "fields": c.get("fields", []),
        "digest": c.get("digest"),
    }
    summary["index"] = [m["index"] for _, m in meta.shards] if len(meta.shards) > 1 else first["index"]
    summary["build"] = [m["build"] for _, m in meta.shards] if len(meta.shards) > 1 else first["build"]
    summary["status"] = status
    summary["verified"] = "sha256" if verify else "sha256 of the files changed since they last matched"
    return summary


def info_text(meta: StoreMeta, summary: dict) -> str:
    """:func:`info_summary` as aligned ``key  value`` lines."""
    first = meta.first
    c = first["corpus"]
    rows = [
        ("path", summary["path"]),
        ("kind", summary["kind"]),
        ("model", summary["model"]),
        ("tokenizer", f"{first['tokenizer']['fingerprint']} (vocabulary {first['tokenizer']['vocab_size']:,})"),
        ("shards", f"{len(meta.shards)} of {meta.shard_count} built"
         + (f" (missing {', '.join(map(str, meta.missing))})" if meta.missing else "")),
        ("documents", f"{summary['documents']:,}"),
        ("tokens", f"{summary['tokens']:,}"),
        ("size", f"{human_size(summary['bytes'])} on disk, {human_size(summary['data_bytes'])} of index "
         f"({summary['bytes_per_token']} bytes/token)"),
        ("corpus", f"{c['files']} files" + (f", fields {', '.join(c['fields'])}" if c.get("fields") else "")
         + f"; skipped {summary['corpus']['skipped_files']} files, {summary['corpus']['skipped_records']:,} records"),
        ("params", ", ".join(f"{k}={v}" for k, v in first["params"].items()) or "-"),
        ("created", summary["created"]),
        ("status", summary["status"] + f" ({summary['verified']})"),
    ]
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)


# --------------------------------------------------------------------------------------------------- query


@dataclass
class QueryRun:
    """One `graft index query`: the opened store, the context as tokens, what the store retrieved, and the time
    opening and querying took."""

    store: Path
    index: SuffixArrayIndex | NgramIndex
    tok: Tokenizer
    ids: list[int]
    result: Lookup
    open_ms: float
    query_ms: float

    @cached_property
    def paths(self) -> list[tuple[list[int], float, int]]:
        """The continuations as ``(tokens, score, count)``, best first."""
        return self.result.paths()


def query_data(run: QueryRun) -> dict:
    """The retrieval as data: the matched suffix, every continuation path with its count and score, and (n-gram
    stores) the neighbouring contexts consulted."""
    tok, result, ids = run.tok, run.result, run.ids
    matched = ids[len(ids) - result.match_len :] if result.match_len else []
    data = {
        "store": str(run.store),
        "kind": run.index.kind,
        "tokens": len(ids),
        "match_len": result.match_len,
        "matched": tok.decode(matched) if matched else "",
        "matched_ids": matched,
        "occurrences": result.occurrences,
        "counted": result.counted,
        "open_ms": round(run.open_ms, 3),
        "query_ms": round(run.query_ms, 3),
        "continuations": [
            {"text": tok.decode(p), "ids": p, "depth": len(p), "count": c, "score": round(s, 6)}
            for p, s, c in run.paths
        ],
    }
    if run.index.kind == "ngram":
        data["neighbours"] = [{"similarity": round(s, 4), "context": tok.decode(c), "ids": c} for s, c in result.neighbours]
    return data


def print_query(run: QueryRun, data: dict, min_match: int) -> None:
    """The retrieval for people: what matched (suffix-array) or which contexts were near (n-gram), then the
    continuations as a table, best first."""
    console = stdout_console()
    tok, result = run.tok, run.result
    if run.index.kind == "suffix-array":
        if result.match_len:
            console.print(
                f"matched suffix ({result.match_len} tokens): {data['matched']!r} — {result.occurrences:,} "
                f"occurrences, {result.counted:,} counted; {run.query_ms:.3f} ms",
                markup=False, highlight=False,
            )
        else:
            console.print(f"no suffix of at least {min_match} tokens occurs in the store ({run.query_ms:.3f} ms)",
                          markup=False)
    else:
        console.print(
            f"context {tok.decode(run.ids[-run.index.n:])!r}: {'exact match' if result.match_len else 'no exact match'}, "
            f"{len(result.neighbours)} neighbours; {run.query_ms:.3f} ms",
            markup=False, highlight=False,
        )
        for s, c in result.neighbours[:QUERY_NEIGHBOURS]:
            console.print(f"  {s:.3f}  {tok.decode(c)!r}", markup=False, highlight=False)
    if not run.paths:
        return
    from rich.table import Table

    table = Table(box=None, pad_edge=False, header_style="bold")
    for col in ("#", "SCORE", "COUNT", "DEPTH", "CONTINUATION"):
        table.add_column(col, justify="right" if col != "CONTINUATION" else "left", no_wrap=col != "CONTINUATION")
    for i, (p, s, c) in enumerate(run.paths, start=1):
        table.add_row(str(i), f"{s:.3f}", f"{c:,}", str(len(p)), repr(tok.decode(p)))
    console.print(table, markup=False, highlight=False)


# --------------------------------------------------------------------------------------------------- list


def print_store_list(rows: list[dict], root: Path) -> None:
    """The stores under ``root`` as a table (a damaged one with its problem in place of its figures)."""
    from rich.table import Table

    table = Table(box=None, pad_edge=False, header_style="bold")
    for col in ("NAME", "KIND", "MODEL", "TOKENS", "SIZE", "SHARDS", "CREATED", "STATUS"):
        table.add_column(col, no_wrap=col != "STATUS")
    for r in rows:
        if "kind" not in r:
            table.add_row(r["name"], "-", "-", "-", "-", "-", "-", r["status"])
        else:
            table.add_row(r["name"], r["kind"], r["model"], short_count(r["tokens"]), human_size(r["bytes"]), r["shards"],
                          r["created"][:16].replace("T", " "), r["status"])
    console = stdout_console()
    console.print(table, markup=False, highlight=False)
    console.print(f"stores live in {root} (set GRAFT_HOME to move them)", markup=False, highlight=False)
