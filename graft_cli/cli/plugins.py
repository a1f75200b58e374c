"""``graft plugins``: the retrievers and drafters that entry points declare, built-in and third-party alike."""

from __future__ import annotations

import json

import typer

plugins_app = typer.Typer(no_args_is_help=True)


@plugins_app.command("list")
def list_(as_json: bool = typer.Option(False, "--json", help="One JSON object per plugin.")) -> None:
    """List retriever and drafter plugins (name, module, package, version, kind); broken ones are shown, not fatal."""
    from rich.console import Console
    from rich.table import Table

    from graft_cli.core.discovery import DRAFTERS, KIND, RETRIEVERS, discover, load_factory

    rows = []
    for group in (RETRIEVERS, DRAFTERS):
        for info in discover(group).values():
            try:
                load_factory(info.name, group)
            except ImportError as e:
                info.error = str(e)
            rows.append((KIND[group], info))
    if as_json:
        for kind, info in rows:
            print(json.dumps({**vars(info), "kind": kind, "ok": info.error is None}))
        return
    table = Table("name", "module", "package", "version", "kind", "status")
    for kind, info in rows:
        table.add_row(info.name, info.module, info.package, info.version, kind, info.error or "ok")
    Console().print(table)
