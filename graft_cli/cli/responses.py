"""``graft responses info | clear FILE``: the response cache a process keeps on disk (``--retriever-opt
responses.file=FILE``), looked at and emptied without loading a model."""

from __future__ import annotations

import json
from pathlib import Path

import typer

from graft_cli.core import GraftError

responses_app = typer.Typer(no_args_is_help=True, help="The response cache kept on disk: inspect it or clear it.")


def _read(file: Path):
    """The cache at ``file``; what is wrong with it as one GraftError line."""
    from datastores import DatastoreError
    from datastores.responses import read_responses

    try:
        return read_responses(file)
    except DatastoreError as e:
        raise GraftError(str(e)) from None


@responses_app.command("info")
def info(
    file: Path = typer.Argument(..., help="A response cache file (what responses.file names)."),
    as_json: bool = typer.Option(False, "--json", help="One JSON object on stdout."),
) -> None:
    """What a response cache holds: responses, tokens, and the tokenizer its ids belong to."""
    cache = _read(file)
    lengths = [int(n) for n in (cache.offsets[1:] - cache.offsets[:-1])]
    facts = {"file": str(file), "responses": cache.responses, "tokens": int(cache.tokens.size),
             "longest": max(lengths, default=0), "bytes": file.stat().st_size,
             "tokenizer": cache.fingerprint, "vocab_size": cache.vocab_size}
    if as_json:
        typer.echo(json.dumps(facts))
        return
    for key, value in facts.items():
        typer.echo(f"{key:<11} {value if value is not None else '-'}")


@responses_app.command("clear")
def clear(
    file: Path = typer.Argument(..., help="A response cache file (what responses.file names)."),
    force: bool = typer.Option(False, "--force", help="Remove the file even when it is not a readable response "
                               "cache (a corrupt one)."),
) -> None:
    """Delete a response cache: the next process that names it starts empty. Only a response cache is removed
    (a mistyped path must not delete another file) unless --force."""
    from datastores import DatastoreError
    from datastores.responses import remove_responses

    if not file.exists():
        typer.echo(f"{file}: no response cache there; nothing to clear")
        return
    try:
        removed = remove_responses(file, force=force)
    except DatastoreError as e:
        raise GraftError(f"{e} (--force removes it anyway)") from None
    except OSError as e:
        raise GraftError(f"cannot remove {file}: {e.strerror or e}") from None
    held = f" ({removed.responses} responses, {removed.tokens.size} tokens)" if removed is not None else ""
    typer.echo(f"cleared {file}{held}")
