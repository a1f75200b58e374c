"""A Hugging Face hub cache written by hand in the layout huggingface_hub writes, so that tests resolve hub ids
with no network: ``models--ORG--NAME/blobs/<hash>`` (large files named by their SHA-256, small ones by their git
blob SHA-1), ``snapshots/<commit>/<file>`` as relative links into ``blobs/``, ``refs/<branch or tag>`` holding the
commit hash (no newline)."""

from __future__ import annotations

import hashlib
import os
import shutil
from pathlib import Path

LFS_ABOVE = 10 * 1024  # files from this size up are stored as LFS blobs (named by SHA-256), as on the hub


def _blob_name(path: Path) -> str:
    data_size = path.stat().st_size
    if data_size >= LFS_ABOVE or path.suffix in (".safetensors", ".bin"):
        h = hashlib.sha256()
        with open(path, "rb") as f:
            while block := f.read(1 << 20):
                h.update(block)
        return h.hexdigest()
    return hashlib.sha1(b"blob %d\0" % data_size + path.read_bytes()).hexdigest()


def _store(src: Path, blob: Path, link: bool) -> None:
    """Put ``src`` into the cache as ``blob``: a hard link (or a symbolic one across file systems) when ``link``
    (a real model's gigabytes are not copied), else a copy."""
    if blob.exists():
        return
    if link:
        try:
            os.link(src, blob)
        except OSError:
            blob.symlink_to(src.resolve())
    else:
        shutil.copyfile(src, blob)


def add_snapshot(cache: Path, repo: str, source: Path, commit: str, refs: tuple[str, ...] = ("main",),
                 files: list[str] | None = None, link: bool = False) -> Path:
    """Put ``source``'s files (or just ``files``) into ``cache`` as snapshot ``commit`` of ``repo``, with each name
    in ``refs`` pointing at it. Returns the snapshot directory."""
    root = cache / ("models--" + repo.replace("/", "--"))
    blobs, snapshot = root / "blobs", root / "snapshots" / commit
    blobs.mkdir(parents=True, exist_ok=True)
    snapshot.mkdir(parents=True, exist_ok=True)
    for name in files if files is not None else sorted(p.name for p in source.iterdir() if p.is_file()):
        if name.startswith("."):
            continue
        src = source / name
        blob = blobs / _blob_name(src)
        _store(src, blob, link)
        (snapshot / name).symlink_to(os.path.relpath(blob, snapshot))
    for ref in refs:
        (root / "refs" / ref).parent.mkdir(parents=True, exist_ok=True)
        (root / "refs" / ref).write_text(commit)
    return snapshot


def use_cache(monkeypatch, cache: Path, offline: bool = True) -> None:
    """Point this process's huggingface_hub at ``cache`` (what HF_HUB_CACHE does for a fresh process), offline
    unless asked otherwise."""
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", offline)
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    if offline:
        monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    else:
        monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
        monkeypatch.delenv("TRANSFORMERS_OFFLINE", raising=False)
