"""Plugin discovery through entry-point groups: retrievers (``graft.retrievers``) and drafters (``graft.drafters``).

Built-ins are registered in pyproject.toml exactly as a third-party package registers its own, so there is one
way in. A plugin that fails to import is reported and skipped; it never breaks the others.
"""

from __future__ import annotations

from dataclasses import dataclass
from importlib.metadata import entry_points
from typing import Any

from graft_cli.core.errors import GraftError

RETRIEVERS = "graft.retrievers"
DRAFTERS = "graft.drafters"
KIND = {RETRIEVERS: "retriever", DRAFTERS: "drafter"}  # what a group's plugins are called in messages


@dataclass
class PluginInfo:
    name: str
    module: str  # "module:attribute" as declared
    package: str  # the distribution that declared it
    version: str
    error: str | None = None  # why it could not be loaded, if it could not


def discover(group: str = RETRIEVERS) -> dict[str, PluginInfo]:
    """Every plugin declared in ``group``, without importing any of them."""
    found = {}
    for ep in entry_points(group=group):
        dist = getattr(ep, "dist", None)
        found[ep.name] = PluginInfo(
            ep.name, ep.value, dist.metadata["Name"] if dist else "?", dist.version if dist else "?"
        )
    return found


def load_factory(name: str, group: str = RETRIEVERS):
    """The factory of plugin ``name`` in ``group``; raises LookupError (unknown) or ImportError (broken plugin)."""
    kind = KIND.get(group, "plugin")
    for ep in entry_points(group=group):
        if ep.name == name:
            try:
                return ep.load()
            except Exception as e:  # a broken third-party plugin must not take the tool down with it
                raise ImportError(f"{kind} plugin '{name}' ({ep.value}) failed to load: {e}") from e
    known = ", ".join(sorted(discover(group))) or "none"
    raise LookupError(f"unknown {kind} '{name}' (installed: {known})")


def build(name: str, env: Any, group: str = RETRIEVERS) -> Any:
    """Plugin ``name`` of ``group`` made over ``env``: unknown, broken or refusing its options, one GraftError."""
    try:
        return load_factory(name, group)(env)
    except (LookupError, ImportError, ValueError) as e:
        raise GraftError(str(e)) from e
