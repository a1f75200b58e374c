"""`graft plugins` (placeholder until its issue lands)."""

import typer

plugins_app = typer.Typer(no_args_is_help=True)


@plugins_app.command("list")
def list_() -> None:
    """Not implemented yet."""
    from graft_cli.errors import GraftError

    raise GraftError("`graft plugins` is not implemented yet")
