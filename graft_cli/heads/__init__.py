"""EAGLE-3 heads that graft trains and ships: where named heads live and how ``eagle3:NAME`` finds them.

A head is a directory in SpecForge's layout (``config.json`` + ``model.safetensors``). ``eagle3:SPEC`` is a path
when one exists there, else a name: the heads shipped inside the package (``graft_cli/heads/shipped/NAME``), then
the heads trained into ``GRAFT_HOME/heads/NAME``.

A shipped head records the checksum of the target it was trained for (``training.json``'s ``target_sha256``):
``graft`` without ``--draft`` drafts with it on that target (graft_cli/methods.py).
"""

from __future__ import annotations

import json
from pathlib import Path

from graft_cli.errors import GraftError

SHIPPED = Path(__file__).parent / "shipped"


def user_heads_dir() -> Path:
    from graft_cli.catalog.home import graft_home

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


def shipped_head_for(checksum: str) -> str | None:
    """The name of the head shipped for the target whose model checksum is ``checksum``, or None."""
    for d in sorted(SHIPPED.iterdir()) if SHIPPED.is_dir() else []:
        try:
            record = json.loads((d / "training.json").read_text())
        except (OSError, ValueError):
            continue
        if isinstance(record, dict) and record.get("target_sha256") == checksum:
            return d.name
    return None


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
    known = ", ".join(named) or "none"
    raise GraftError(f"eagle3 head {spec}: not a directory nor a named head (named heads: {known})")
