"""Where models live under :func:`graft_home`: the locations, the manifests of converted dirs, and the work
dirs, locks and final renames that make every pull or conversion atomic."""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Iterator

from datastores.atomic import lock, remove_stale, swap_into_place, write_text_atomic
from graft_cli.core import GraftError

MANIFEST = "graft-model.json"
MANIFEST_FORMAT = 1
_TMP_RE = re.compile(r"^(?P<op>[a-z]+)-(?P<name>.+)-(?P<pid>\d+)-[^-]+$")


def graft_home() -> Path:
    """``$GRAFT_HOME``, else ``$XDG_CACHE_HOME/graft``, else ``~/.cache/graft``."""
    home = os.environ.get("GRAFT_HOME")
    if home:
        return Path(home).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    if xdg:
        return Path(xdg).expanduser() / "graft"
    return Path.home() / ".cache" / "graft"


def models_dir() -> Path:
    return graft_home() / "models"


def ensure_dir(path: Path) -> Path:
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise GraftError(f"cannot create {path}: {e.strerror or e} (set GRAFT_HOME to a writable directory)") from e
    return path


def eprint(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def mb(n: int | float) -> str:
    if n >= 10e9:
        return f"{n / 1e9:.0f} GB"
    if n >= 1e9:
        return f"{n / 1e9:.1f} GB"
    return f"{n / 1e6:.0f} MB"


def dir_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def read_manifest(path: Path) -> dict | None:
    """The manifest of a converted model directory, or None where it has none (or it is unreadable)."""
    try:
        data = json.loads((Path(path) / MANIFEST).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def write_manifest(path: Path, manifest: dict) -> None:
    write_text_atomic(path / MANIFEST, json.dumps(manifest, indent=2) + "\n")


def is_pulled(name: str) -> bool:
    d = models_dir() / name
    return all((d / f).is_file() for f in (MANIFEST, "config.json")) and any(d.glob("*.safetensors"))


def installed_models() -> list[Path]:
    """Every converted directory under ``models/`` (catalog pulls and gguf-* conversions), sorted by name."""
    root = models_dir()
    if not root.is_dir():
        return []
    return sorted(p for p in root.iterdir() if p.is_dir() and (p / MANIFEST).is_file())


def clean_stale_tmp(name: str | None = None) -> list[Path]:
    """Remove work dirs left by crashed pulls: those of dead processes and, when ``name`` is given (the caller holds
    that model's lock, so no live process can be using them), every one of that model's. Returns what it removed."""
    return remove_stale(graft_home() / "tmp", _TMP_RE, "pid", lambda m: name is not None and m.group("name") == name)


@contextlib.contextmanager
def work_dir(op: str, name: str) -> Iterator[Path]:
    """A fresh dir under ``graft_home()/tmp`` (same filesystem as ``models/``, so the final rename is atomic),
    removed whatever happens."""
    root = ensure_dir(graft_home() / "tmp")
    path = Path(tempfile.mkdtemp(prefix=f"{op}-{name}-{os.getpid()}-", dir=root))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def model_lock(name: str) -> contextlib.AbstractContextManager[None]:
    """One pull/rm/conversion of ``name`` at a time, across processes (the second one waits)."""
    return lock(ensure_dir(graft_home() / "locks") / f"{name}.lock",
                lambda: eprint(f"graft: waiting for another graft process that is pulling {name} ..."))


def install_dir(src: Path, dest: Path) -> None:
    """Rename a finished dir into place; an existing ``dest`` is swapped out first (put back if the rename fails)
    and then removed."""
    ensure_dir(dest.parent)
    with work_dir("rm", dest.name) as trash:
        swap_into_place(src, dest, trash / "old")
