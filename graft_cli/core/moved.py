"""Moved modules keep their old names for a release: ``import graft_cli.tree`` still works, with a
DeprecationWarning that names the new place.

One table, old dotted name to new, read by a finder that ``import graft_cli`` appends to ``sys.meta_path`` (the one
change importing graft makes to the process, and only to its imports). The finder answers only the table's names,
and only after every other finder has found no module of that name, so it can never shadow a real one; the old
name then is the new module itself (``graft_cli.tree.Tree is graft_cli.core.tree.Tree``), never a copy. A name
leaves the table in the release ``REMOVED_IN`` names.
"""

from __future__ import annotations

import sys
import warnings
from importlib import import_module
from importlib.machinery import ModuleSpec
from types import ModuleType
from typing import Sequence

REMOVED_IN = "0.2.0"  # the release that drops every name below

_RUNTIME = ("attention", "attention_kernels", "cpu_linear", "engine", "half_linear", "kv_cache", "limits", "loading",
            "lossless", "sampling", "target", "token_ranking", "verify")
_CLI = ("bench", "generate", "heads", "index", "models", "options", "plugins", "responses", "serve")

MOVED: dict[str, str] = {
    **{f"graft_cli.{name}": f"graft_cli.core.{name}" for name in ("tree", "errors", "prune", "stats", "discovery",
                                                                  "memory")},
    **{f"graft_cli.{name}": f"graft_cli.runtime.{name}" for name in _RUNTIME},
    **{f"graft_cli.{name}": f"graft_cli.drafting.{name}" for name in ("budget", "objective", "profile")},
    **{f"graft_cli.cli_{name}": f"graft_cli.cli.{name}" for name in _CLI},
    **{f"graft_cli.{name}": f"graft_cli.cli.{name}" for name in ("build_progress", "index_report", "prefill_bar")},
    "graft_cli.graft": "graft_cli.drafting.proposer",
    "graft_cli.drafters": "graft_cli.drafting.tree_drafter",
    "graft_cli.methods": "graft_cli.method.builder",
    "graft_cli.method_config": "graft_cli.method.config",
    "graft_cli.synthetic": "graft_cli.bench.synthetic",
    "graft_cli.plots": "graft_cli.bench.plots",
    "plugins.base": "graft_cli.plugin",  # a retriever's names, before graft_cli.plugin held them all
}


class MovedFinder:
    """A meta-path finder and loader for the names of ``MOVED``: the old name's module is the new one."""

    def find_spec(self, name: str, path: Sequence[str] | None = None, target: ModuleType | None = None
                  ) -> ModuleSpec | None:
        return ModuleSpec(name, self) if name in MOVED else None

    def create_module(self, spec: ModuleSpec) -> None:
        return None  # the default module, replaced by the new one in exec_module

    def exec_module(self, module: ModuleType) -> None:
        old = module.__name__
        new = MOVED[old]
        hint = "" if new == "graft_cli.plugin" else " (a plugin imports all it needs from graft_cli.plugin)"
        # stacklevel 2: the import machinery's own frames are skipped, so the warning points at the import line
        warnings.warn(f"{old} moved to {new}; the old name goes in graft {REMOVED_IN}{hint}", DeprecationWarning,
                      stacklevel=2)
        sys.modules[old] = import_module(new)  # the import system returns what sys.modules holds under the name


def install() -> None:
    """Append the finder to ``sys.meta_path`` once, however often graft is imported or reloaded."""
    if not any(type(finder).__name__ == MovedFinder.__name__ for finder in sys.meta_path):
        sys.meta_path.append(MovedFinder())
