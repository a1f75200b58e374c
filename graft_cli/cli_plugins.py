"""``graft plugins``: the retrievers that entry points declare, built-in and third-party alike."""

from __future__ import annotations

import json

import typer

plugins_app = typer.Typer(no_args_is_help=True)


@plugins_app.command("list")
def list_(as_json: bool = typer.Option(False, "--json", help="One JSON object per plugin.")) -> None:
    """List retriever plugins (name, module, package, version, kind); broken ones are shown, not fatal."""
    from rich.console import Console
    from rich.table import Table

    from plugins import discover, load_factory

    rows = []
    for info in discover().values():
        try:
            load_factory(info.name)
        except ImportError as e:
            info.error = str(e)
        rows.append(info)
    if as_json:
        for info in rows:
            print(json.dumps({**vars(info), "kind": "retriever", "ok": info.error is None}))
        return
    table = Table("name", "module", "package", "version", "kind", "status")
    for info in rows:
        table.add_row(info.name, info.module, info.package, info.version, "retriever", info.error or "ok")
    Console().print(table)
