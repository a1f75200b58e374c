"""`graft models list | pull | info | rm | vocab`: the model catalog, and the token counts a draft model's vocabulary
is chosen by. Results go to stdout; progress and logs to stderr.

Only cheap imports here: the catalog module itself imports torch/transformers when a conversion runs."""

from __future__ import annotations

import json
from typing import List, Optional

import typer

models_app = typer.Typer(no_args_is_help=True, help="The model catalog: list, pull, inspect and remove models.")


def _mb(n: Optional[int]) -> str:
    if n is None:
        return "-"
    return f"{n / 1e9:.2f} GB" if n >= 1e9 else f"{n / 1e6:.0f} MB"


@models_app.command("list")
def list_(
    as_json: bool = typer.Option(False, "--json", help="One JSON array on stdout instead of a table."),
) -> None:
    """Catalog models (size, whether pulled, the default) and any converted local GGUFs."""
    from graft_cli.catalog import home, resolve

    rows = resolve.list_models()
    if as_json:
        typer.echo(json.dumps(rows, indent=2))
        return
    from rich.console import Console
    from rich.table import Table

    table = Table(box=None, pad_edge=False, header_style="bold")
    for col in ("", "NAME", "GGUF", "ON DISK", "PULLED", "QUANTIZED", "DESCRIPTION"):
        table.add_column(col, no_wrap=col != "DESCRIPTION")
    for r in rows:
        table.add_row(
            "*" if r["default"] else "",
            r["name"],
            _mb(r["gguf_bytes"]),
            _mb(r["dir_bytes"]),
            "yes" if r["pulled"] else "no",
            "-" if r["q4_weights"] is None else str(r["q4_weights"]),  # linears --dtype q4 runs as stored
            r["description"],
        )
    console = Console()
    if not console.is_terminal:  # piped: one line per model, whatever the width
        console = Console(width=200)
    console.print(table)
    console.print(f"* default model; models live in {home.models_dir()} (set GRAFT_HOME to move them)")


@models_app.command("pull")
def pull(
    name: str = typer.Argument(None, help="Catalog name (default: the default model), a path to a .gguf file, or a "
                               "Hugging Face id ORG/NAME[@REVISION] (into the hub cache)."),
    keep_gguf: bool = typer.Option(False, "--keep-gguf", help="Keep the assembled GGUF inside the model directory."),
    force: bool = typer.Option(False, "--force", help="Pull and convert (or download) again even if already there."),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="No progress bar."),
) -> None:
    """Download, verify (sha256) and convert a model once, or download a hub model into the Hugging Face cache;
    prints its directory on stdout."""
    from graft_cli.catalog import entries, home, install, resolve

    name = name or entries.DEFAULT_MODEL
    if name in entries.CATALOG:
        already = home.is_pulled(name) and not force
        path = install.pull(name, keep_gguf=keep_gguf, force=force, show_progress=not quiet)
        if already:
            typer.echo(f"graft: {name} is already pulled (use --force to pull it again)", err=True)
    else:
        path = resolve.resolve_model(name, force=force)
    typer.echo(str(path))


@models_app.command("info")
def info(
    name: str = typer.Argument(..., help="Catalog name, gguf-* name, a model directory, or a cached ORG/NAME."),
    as_json: bool = typer.Option(False, "--json", help="The manifest as JSON."),
) -> None:
    """Show a model's manifest (source packages, sha256, sizes, conversion time)."""
    from graft_cli.catalog import resolve

    data = resolve.model_info(name)
    if as_json:
        typer.echo(json.dumps(data, indent=2))
        return
    width = max(len(k) for k in data)
    for key, value in data.items():
        if isinstance(value, dict):
            value = ", ".join(f"{k}={v if not isinstance(v, list) else ' '.join(map(str, v))}" for k, v in value.items())
        elif isinstance(value, list):
            value = " ".join(map(str, value))
        elif key.endswith("_bytes") and isinstance(value, int):
            value = f"{value:,} ({_mb(value)})"
        typer.echo(f"{key:<{width}}  {value}")


@models_app.command("rm")
def rm(name: str = typer.Argument(..., help="Catalog name or gguf-* name of a pulled model.")) -> None:
    """Remove a pulled model's directory."""
    from graft_cli.catalog import install

    path = install.remove(name)
    typer.echo(f"removed {name} ({path})")


@models_app.command("vocab")
def vocab(
    name: str = typer.Argument(..., help="Catalog name or model directory whose tokenizer counts (a draft or its target)."),
    corpus: List[str] = typer.Argument(..., help="Corpus: JSONL, Parquet/Arrow files or folders."),
    field: List[str] = typer.Option([], "--field", help="Record fields to read (JSONL/Parquet); default: auto."),
    max_documents: Optional[int] = typer.Option(None, "--max-documents", help="Read at most N documents."),
) -> None:
    """Count how often each token occurs in a corpus, so that a draft model scores only the tokens real text uses
    (on a CPU by default; --draft-vocab N to choose). Prints the ranking's file on stdout."""
    from transformers import AutoTokenizer

    from graft_cli.runtime import token_ranking
    from graft_cli.catalog import resolve
    from graft_cli.heads.data import read_documents

    tokenizer = AutoTokenizer.from_pretrained(str(resolve.resolve_model(name)))
    docs, summary = read_documents(corpus, tokenizer, field or None, max_documents)
    ranking = token_ranking.Ranking.count(docs.tokens, len(tokenizer), summary)
    path = token_ranking.save(ranking, tokenizer)
    typer.echo(f"graft: {summary}: {len(docs.tokens):,} tokens, {ranking.used:,} of {len(tokenizer):,} ids used", err=True)
    for size in sorted({8192, 16384, 32768, 65536, ranking.size_for()}):
        if size <= ranking.used:
            note = "  (the default on a CPU)" if size == ranking.size_for() else ""
            typer.echo(f"  --draft-vocab {size:>7,}  covers {ranking.coverage(size):.2%}{note}", err=True)
    typer.echo(str(path))
