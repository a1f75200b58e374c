"""File checksums, and the record of which files were last seen intact, so that a full SHA-256 is paid once per
change of a file rather than at every open.

A file's *stamp* is (size, mtime in ns, inode). Writing a file (even one byte of it, in place) changes its mtime,
so a file whose stamp equals the one recorded when its full SHA-256 last matched is the file that matched; any
other stamp means the whole file is hashed again. What this cannot see is damage that leaves the stamp alone
(the disk itself rotting, or a writer that resets the mtime): ``--verify`` hashes every file whatever its stamp.
The record is ``.verified.json`` beside the files; where that directory is read-only nothing is recorded and
every open hashes.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
from pathlib import Path

from datastores.atomic import write_text_atomic

SAMPLE_BLOCKS = 16
SAMPLE_BYTES = 4096
RECORD = ".verified.json"


def file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(1 << 20):
            h.update(block)
    return h.hexdigest()


def sample_digest(path: Path, size: int | None = None) -> str:
    """SHA-256 of the size and of 16 blocks spread evenly over the file (first and last included): cheap at
    open time whatever the file size, and it catches truncation and zero-filled tails."""
    size = os.path.getsize(path) if size is None else size
    h = hashlib.sha256(str(size).encode())
    offsets = sorted({max(0, min(size - SAMPLE_BYTES, (size * i) // (SAMPLE_BLOCKS - 1))) for i in range(SAMPLE_BLOCKS)})
    with open(path, "rb") as f:
        for off in offsets:
            f.seek(off)
            h.update(f.read(SAMPLE_BYTES))
    return h.hexdigest()


def stamp(path: Path) -> list[int]:
    st = os.stat(path)
    return [st.st_size, st.st_mtime_ns, st.st_ino]


def _read(record: Path) -> dict:
    try:
        data = json.loads(record.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def remember(path: Path, sha256: str) -> None:
    """Record that ``path``, as it is now, has ``sha256`` (best effort: a read-only directory records nothing)."""
    path = Path(path)
    record = path.parent / RECORD
    data = _read(record)
    data[path.name] = {"stamp": stamp(path), "sha256": sha256}
    with contextlib.suppress(OSError):
        write_text_atomic(record, json.dumps(data, indent=1))


def _recorded(path: Path) -> str | None:
    """The SHA-256 recorded for ``path`` if its stamp is still the one recorded with it."""
    seen = _read(path.parent / RECORD).get(path.name)
    if isinstance(seen, dict) and seen.get("stamp") == stamp(path) and isinstance(seen.get("sha256"), str):
        return seen["sha256"]
    return None


def sha256_of(path: Path) -> str:
    """``path``'s SHA-256, hashed in full only when the file changed since it was last recorded (what identifies
    a plain model directory in profiles and benchmark fingerprints, computed once per change of its weights)."""
    path = Path(path)
    digest = _recorded(path)
    if digest is None:
        digest = file_sha256(path)
        remember(path, digest)
    return digest


def sha256_matches(path: Path, expected: str, *, force: bool = False) -> bool:
    """Whether ``path`` has SHA-256 ``expected``: hashed in full unless its stamp is the one recorded when it last
    matched (``force``: hashed whatever the record says)."""
    path = Path(path)
    if not force and _recorded(path) == expected:
        return True
    if file_sha256(path) != expected:
        return False
    remember(path, expected)
    return True
