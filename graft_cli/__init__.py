"""graft: lossless speculative decoding that drafts less and retrieves more.

The library's entry point is :func:`load` (graft_cli/api/, docs/api.md). It is imported on first use, so that
``import graft_cli`` stays cheap and leaves the process as it was, but for one finder on ``sys.meta_path`` that
answers the old names of moved modules, with a warning (graft_cli/core/moved.py). Plugins import from
:mod:`graft_cli.plugin` (docs/plugins.md).
"""

from typing import Any

from graft_cli.core import moved
from graft_cli.core.version import __version__

__all__ = ["Completion", "Generator", "Piece", "__version__", "load"]

moved.install()


def __getattr__(name: str) -> Any:
    if name in ("Completion", "Generator", "Piece", "load"):
        from graft_cli import api  # lazy: torch and transformers load when the library is first used

        return getattr(api, name)
    raise AttributeError(f"module 'graft_cli' has no attribute {name!r}")
