"""Where named EAGLE-3 heads live and how ``eagle3:NAME`` finds them.

A head is a directory (``config.json`` + weights, in one of the layouts ``layouts.py`` reads). ``eagle3:SPEC`` is
a path when one exists there, else a name: the heads shipped inside the package (``graft_cli/heads/shipped/NAME``),
then the heads trained into ``GRAFT_HOME/heads/NAME``; else a Hugging Face hub id ``ORG/NAME[@REVISION]``, found in
the hub cache or downloaded into it (``graft_cli/catalog/hub.py``).
"""

from __future__ import annotations

from pathlib import Path

from graft_cli.catalog import graft_home
from graft_cli.catalog.hub import parse_hub_id, snapshot
from graft_cli.core import GraftError

SHIPPED = Path(__file__).parent / "shipped"


def user_heads_dir() -> Path:
    return graft_home() / "heads"


def named_heads() -> dict[str, Path]:
    """Every named head, shipped first; a user head of the same name does not shadow a shipped one."""
    found: dict[str, Path] = {}
    for root in (SHIPPED, user_heads_dir()):
        if root.is_dir():
            for d in sorted(root.iterdir()):
                if (d / "config.json").is_file() and d.name not in found:
                    found[d.name] = d
    return found


def resolve_head(spec: str) -> Path:
    """``eagle3:SPEC`` to the head's directory; one line of GraftError when there is none."""
    path = Path(spec).expanduser()
    if path.is_dir():
        return path
    if path.exists():
        raise GraftError(f"eagle3 head {spec}: not a directory")
    named = named_heads()
    if "/" not in spec and spec in named:
        return named[spec]
    hub_id = parse_hub_id(spec)
    if hub_id is not None:
        return snapshot(hub_id, "eagle3 head")
    known = ", ".join(named) or "none"
    raise GraftError(f"eagle3 head {spec}: not a directory, a named head (named heads: {known}) "
                     "nor a Hugging Face id (ORG/NAME)")
