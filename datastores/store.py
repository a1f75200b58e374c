"""Store layout, manifests, integrity checks, and opening / listing / removing stores.

A store is a directory of shards plus a copy of the tokenizer it was built with::

    <store>/
      tokenizer.json                     (the model's tokenizer: `graft index query` needs no model)
      shard-00000-of-00004/manifest.json (+ the kind's files)
      shard-00001-of-00004/...

An unsharded store is a store with one shard. Each shard is self-describing (its manifest records the format
version, the store kind, the tokenizer fingerprint, the shard number and count, the corpus -- every source with
its size and SHA-256 --, document and token counts, build parameters and timings, and the size and checksums of
every file it holds). The shards of one store are built independently (``--shard I/N``, e.g. one per machine)
and must agree on kind, tokenizer, corpus and parameters; opening a store checks that they do, that none is
missing, and that every file has its recorded size, sampled checksum and SHA-256 (the full hash only once per
change of the file, datastores/integrity.py; ``verify=True`` hashes every file).

A build writes into a hidden temporary directory next to its destination and renames it into place only when
it is complete, so an interrupted or failed build (including a full disk) leaves no half store behind
(datastores/staging.py).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Sequence

from datastores.atomic import TMP_RE
from datastores.errors import DatastoreError
from datastores.integrity import file_sha256, sample_digest, sha256_matches
from datastores.ngram_faiss import NgramIndex
from datastores.suffix_array import SuffixArrayIndex

FORMAT = "graft-datastore"
FORMAT_VERSION = 1
KINDS = ("suffix-array", "ngram")
MANIFEST = "manifest.json"
TOKENIZER_COPY = "tokenizer.json"
SHARD_RE = re.compile(r"^shard-(\d{5})-of-(\d{5})$")


# --- names and shards -----------------------------------------------------------------------------------------


def shard_name(index: int, count: int) -> str:
    return f"shard-{index:05d}-of-{count:05d}"


def parse_shard(spec: str | None) -> tuple[int, int]:
    """``"I/N"`` (I counts from 0) -> ``(I, N)``; ``None`` -> ``(0, 1)``."""
    if spec is None or spec == "":
        return 0, 1
    m = re.fullmatch(r"\s*(\d+)\s*/\s*(\d+)\s*", str(spec))
    if not m:
        raise DatastoreError(f"--shard takes I/N (e.g. 0/4), not {spec!r}")
    i, n = int(m.group(1)), int(m.group(2))
    if n < 1 or n > 99999:
        raise DatastoreError(f"--shard {spec}: the shard count must be between 1 and 99999")
    if i >= n:
        raise DatastoreError(f"--shard {spec}: shard numbers count from 0, so {n} shards are 0/{n} to {n - 1}/{n}")
    return i, n


def resolve_store(spec: str | os.PathLike, home: Path | None = None) -> Path:
    """A store path from a path or a name under ``home/datastores``."""
    s = str(spec)
    p = Path(s).expanduser()
    if p.exists() or os.sep in s or s.startswith("."):
        if not p.exists():
            raise DatastoreError(f"no datastore at {p}")
        return p
    if home is not None:
        named = Path(home) / "datastores" / s
        if named.exists():
            return named
        raise DatastoreError(f"no datastore named {s} under {Path(home) / 'datastores'} (`graft index list` shows them)")
    raise DatastoreError(f"no datastore at {p}")


# --- checksums ------------------------------------------------------------------------------------------------


def describe_files(directory: Path, names: Sequence[str]) -> dict:
    out = {}
    for name in names:
        p = directory / name
        size = p.stat().st_size
        out[name] = {"bytes": size, "sha256": file_sha256(p), "sample": sample_digest(p, size)}
    return out


def check_files(directory: Path, manifest: dict, verify: bool = False) -> None:
    """Every file of a shard has its recorded size, sampled checksum and full SHA-256; the full hash is skipped for
    a file unchanged since it last matched (datastores/integrity.py), unless ``verify``."""
    for name, info in manifest.get("files", {}).items():
        p = directory / name
        if not p.is_file():
            raise DatastoreError(f"datastore shard {directory} is damaged: {name} is missing (rebuild it)")
        size = p.stat().st_size
        if size != info["bytes"]:
            raise DatastoreError(
                f"datastore shard {directory} is truncated or damaged: {name} is {size:,} bytes, "
                f"the manifest says {info['bytes']:,} (rebuild it)"
            )
        if sample_digest(p, size) != info["sample"] or not sha256_matches(p, info["sha256"], force=verify):
            raise DatastoreError(f"datastore shard {directory} is corrupt: {name} fails its SHA-256 (rebuild it)")


# --- reading stores -------------------------------------------------------------------------------------------


@dataclass
class StoreMeta:
    """What a store's manifests say (no data file opened)."""

    path: Path
    kind: str
    shard_count: int
    shards: list[tuple[Path, dict]]  # (directory, manifest), by shard number
    missing: list[int] = field(default_factory=list)

    @property
    def complete(self) -> bool:
        return not self.missing

    @property
    def first(self) -> dict:
        return self.shards[0][1]

    @property
    def fingerprint(self) -> str:
        return self.first["tokenizer"]["fingerprint"]

    @property
    def model(self) -> str:
        return self.first.get("model", {}).get("name") or "?"

    @property
    def tokens(self) -> int:
        return sum(m["corpus"]["tokens"] for _, m in self.shards)

    @property
    def documents(self) -> int:
        return sum(m["corpus"]["documents"] for _, m in self.shards)

    @property
    def bytes(self) -> int:
        return dir_bytes(self.path)

    @property
    def data_bytes(self) -> int:
        """Bytes of the index files only (without the tokenizer copy and manifests)."""
        return sum(info["bytes"] for _, m in self.shards for info in m.get("files", {}).values())

    def summary(self) -> dict:
        first = self.first
        return {
            "path": str(self.path),
            "kind": self.kind,
            "model": self.model,
            "tokenizer": first["tokenizer"],
            "shards": {"count": self.shard_count, "built": len(self.shards), "missing": self.missing},
            "documents": self.documents,
            "tokens": self.tokens,
            "bytes": self.bytes,
            "data_bytes": self.data_bytes,
            "bytes_per_token": round(self.data_bytes / self.tokens, 3) if self.tokens else None,
            "params": first.get("params", {}),
            "created": min(m.get("created", "") for _, m in self.shards),
            "format_version": first.get("format_version"),
        }


def dir_bytes(path: Path) -> int:
    total = 0
    for root, _, files in os.walk(path):
        for f in files:
            try:
                total += os.path.getsize(os.path.join(root, f))
            except OSError:
                pass
    return total


def _read_manifest(directory: Path) -> dict:
    p = directory / MANIFEST
    if not p.is_file():
        raise DatastoreError(f"datastore shard {directory} has no manifest: an interrupted or damaged build (rebuild it)")
    try:
        manifest = json.loads(p.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError, OSError) as e:
        raise DatastoreError(f"datastore shard {directory} has an unreadable manifest ({e}); rebuild it") from e
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise DatastoreError(f"{directory} is not a graft datastore shard (its manifest has another format)")
    version = manifest.get("format_version")
    if not isinstance(version, int) or version > FORMAT_VERSION:
        raise DatastoreError(
            f"datastore {directory.parent} has format version {version}; this graft reads version "
            f"{FORMAT_VERSION} and older (upgrade graft)"
        )
    for key in ("kind", "tokenizer", "shard", "corpus", "params", "files"):
        if key not in manifest:
            raise DatastoreError(f"datastore shard {directory} has an incomplete manifest (no {key}); rebuild it")
    return manifest


def shard_dirs(path: Path) -> list[tuple[int, int, Path]]:
    out = []
    try:
        entries = list(os.scandir(path))
    except OSError as e:
        raise DatastoreError(f"cannot read datastore {path}: {e.strerror or e}") from e
    for entry in entries:
        m = SHARD_RE.match(entry.name)
        if m and entry.is_dir():
            out.append((int(m.group(1)), int(m.group(2)), Path(entry.path)))
    return sorted(out)


def read_store(path: str | os.PathLike) -> StoreMeta:
    """Read and cross-check the manifests of a store (raises :class:`DatastoreError` on any inconsistency)."""
    path = Path(path)
    if not path.is_dir():
        raise DatastoreError(f"no datastore at {path}")
    found = shard_dirs(path)
    if not found:
        raise DatastoreError(f"{path} is not a datastore (it has no shard-*-of-* directories)")
    counts = {n for _, n, _ in found}
    if len(counts) > 1:
        raise DatastoreError(f"datastore {path} mixes shards of {sorted(counts)} -way builds; remove the stale ones")
    count = counts.pop()
    shards = [(d, _read_manifest(d)) for _, _, d in found]
    first = shards[0][1]
    for d, m in shards:
        if (m["shard"]["index"], m["shard"]["count"]) != (int(SHARD_RE.match(d.name).group(1)), count):
            raise DatastoreError(f"datastore shard {d} has a manifest for another shard; rebuild it")
        for key, what in (("kind", "kinds"), ("format_version", "format versions")):
            if m.get(key) != first.get(key):
                raise DatastoreError(f"datastore {path} mixes shards of different {what}")
        if m["tokenizer"]["fingerprint"] != first["tokenizer"]["fingerprint"]:
            raise DatastoreError(f"datastore {path} mixes shards built with different tokenizers")
        if m["params"] != first["params"]:
            raise DatastoreError(f"datastore {path} mixes shards built with different parameters")
        if m["corpus"].get("digest") != first["corpus"].get("digest"):
            raise DatastoreError(f"datastore {path} mixes shards built from different corpora")
    have = {m["shard"]["index"] for _, m in shards}
    missing = [i for i in range(count) if i not in have]
    return StoreMeta(path, first["kind"], count, shards, missing)


def open_store(path: str | os.PathLike, *, fingerprint: str | None = None, verify: bool = False, device: str = "cpu"):
    """Open a complete store for queries: a :class:`~datastores.suffix_array.SuffixArrayIndex` or a
    :class:`~datastores.ngram_faiss.NgramIndex`. ``fingerprint``: the tokenizer the caller uses; a store built
    with another is refused."""
    meta = read_store(path)
    if meta.missing:
        raise DatastoreError(
            f"datastore {meta.path} is incomplete: {len(meta.shards)} of {meta.shard_count} shards built "
            f"(missing {', '.join(str(i) for i in meta.missing[:8])}{'…' if len(meta.missing) > 8 else ''})"
        )
    if fingerprint is not None and fingerprint != meta.fingerprint:
        raise DatastoreError(
            f"datastore {meta.path} was built with another tokenizer ({meta.model}, {meta.fingerprint}; "
            f"this model's is {fingerprint}): rebuild it with this model's tokenizer"
        )
    for d, m in meta.shards:
        check_files(d, m, verify=verify)
    if meta.kind == "suffix-array":
        index = SuffixArrayIndex(meta.shards)
    elif meta.kind == "ngram":
        index = NgramIndex(meta.shards, device=device)
    else:
        raise DatastoreError(f"datastore {meta.path} has an unknown kind {meta.kind!r} (upgrade graft)")
    index.meta = meta
    return index


def list_stores(root: Path) -> list[StoreMeta | tuple[Path, str]]:
    """Every store directly under ``root``: its :class:`StoreMeta`, or ``(path, problem)``."""
    out: list[StoreMeta | tuple[Path, str]] = []
    if not root.is_dir():
        return out
    for entry in sorted(os.scandir(root), key=lambda e: e.name):
        if entry.name.startswith(".") or not entry.is_dir():
            continue
        try:
            out.append(read_store(entry.path))
        except DatastoreError as e:
            out.append((Path(entry.path), str(e)))
    return out


def remove_store(path: Path) -> int:
    """Delete a store (complete, partial or damaged), refusing any directory that is not one; returns bytes freed."""
    path = Path(path)
    if not path.is_dir():
        raise DatastoreError(f"no datastore at {path}")
    allowed = True
    has_shard = False
    for entry in os.scandir(path):
        if SHARD_RE.match(entry.name):
            has_shard = True
        elif entry.name == TOKENIZER_COPY or TMP_RE.match(entry.name) or entry.name.startswith(".tok-"):
            pass
        else:
            allowed = False
    if not (allowed and has_shard):
        raise DatastoreError(f"{path} does not look like a datastore; not removing it")
    size = dir_bytes(path)
    shutil.rmtree(path)
    return size


def now_iso() -> str:
    return datetime.now(timezone.utc).replace(microsecond=0).isoformat()


def elapsed(t0: float) -> float:
    return round(time.perf_counter() - t0, 3)
