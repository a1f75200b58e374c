"""``graft bench`` (placeholder)."""

from graft_cli.errors import GraftError


def bench() -> None:
    """Benchmark every method side by side (not implemented yet: see issue 6)."""
    raise GraftError("`graft bench` is not implemented yet")
