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

from datastores.atomic import pid_alive
from graft_cli.errors import GraftError

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
    tmp = path / f".{MANIFEST}.{os.getpid()}.tmp"
    tmp.write_text(json.dumps(manifest, indent=2) + "\n", encoding="utf-8")
    os.replace(tmp, path / MANIFEST)


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
    root = graft_home() / "tmp"
    removed: list[Path] = []
    if not root.is_dir():
        return removed
    for p in root.iterdir():
        m = _TMP_RE.match(p.name)
        if not m:
            continue
        if (name is not None and m.group("name") == name) or not pid_alive(int(m.group("pid"))):
            if p.is_dir():
                shutil.rmtree(p, ignore_errors=True)
            else:
                with contextlib.suppress(OSError):
                    p.unlink()
            removed.append(p)
    return removed


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


@contextlib.contextmanager
def model_lock(name: str) -> Iterator[None]:
    """One pull/rm/conversion of ``name`` at a time, across processes (advisory ``flock``; a no-op without fcntl)."""
    try:
        import fcntl
    except ImportError:  # pragma: no cover - Windows
        yield
        return
    lock_path = ensure_dir(graft_home() / "locks") / f"{name}.lock"
    fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            eprint(f"graft: waiting for another graft process that is pulling {name} ...")
            fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def install_dir(src: Path, dest: Path) -> None:
    """Rename a finished dir into place; an existing ``dest`` is swapped out first and then removed."""
    ensure_dir(dest.parent)
    trash = None
    if dest.exists():
        trash = Path(tempfile.mkdtemp(prefix=f"rm-{dest.name}-{os.getpid()}-", dir=graft_home() / "tmp"))
        os.rename(dest, trash / "old")
    os.rename(src, dest)
    if trash is not None:
        shutil.rmtree(trash, ignore_errors=True)
