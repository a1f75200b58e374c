"""Retriever discovery through the ``graft.retrievers`` entry-point group.

Built-in retrievers are registered in pyproject.toml exactly as a third-party package registers its own, so
there is one way in. A plugin that fails to import is reported and skipped; it never breaks the others.
"""

from __future__ import annotations

from dataclasses import dataclass
from importlib.metadata import entry_points

GROUP = "graft.retrievers"


@dataclass
class PluginInfo:
    name: str
    module: str  # "module:attribute" as declared
    package: str  # the distribution that declared it
    version: str
    error: str | None = None  # why it could not be loaded, if it could not


def discover() -> dict[str, PluginInfo]:
    """Every declared retriever, without importing any of them."""
    found = {}
    for ep in entry_points(group=GROUP):
        dist = getattr(ep, "dist", None)
        found[ep.name] = PluginInfo(
            ep.name, ep.value, dist.metadata["Name"] if dist else "?", dist.version if dist else "?"
        )
    return found


def load_factory(name: str):
    """The factory of retriever ``name``; raises LookupError (unknown) or ImportError (broken plugin)."""
    for ep in entry_points(group=GROUP):
        if ep.name == name:
            try:
                return ep.load()
            except Exception as e:  # a broken third-party plugin must not take the tool down with it
                raise ImportError(f"retriever plugin '{name}' ({ep.value}) failed to load: {e}") from e
    known = ", ".join(sorted(discover())) or "none"
    raise LookupError(f"unknown retriever '{name}' (installed: {known})")
