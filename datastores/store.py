"""Store layout, manifests, atomic builds, integrity checks, and opening / listing / removing stores.

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
missing, and that every file has its recorded size and sampled checksum (``verify=True`` checks full SHA-256).

A build writes into a hidden temporary directory next to its destination and renames it into place only when
it is complete, so an interrupted or failed build (including a full disk) leaves no half store behind.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import re
import secrets
import shutil
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Iterator, Sequence

from datastores.errors import DatastoreError

FORMAT = "graft-datastore"
FORMAT_VERSION = 1
KINDS = ("suffix-array", "ngram")
MANIFEST = "manifest.json"
TOKENIZER_COPY = "tokenizer.json"
SHARD_RE = re.compile(r"^shard-(\d{5})-of-(\d{5})$")
TMP_RE = re.compile(r"^\.(.+)\.tmp-(\d+)-[0-9a-f]+$")
SAMPLE_BLOCKS = 16
SAMPLE_BYTES = 4096


# --- progress -------------------------------------------------------------------------------------------------


class Progress:
    """Build progress callbacks (the CLI draws them with Rich); this base class ignores them."""

    def start(self, stage: str, total: float | None = None) -> None:
        """A stage begins: ``files``, ``tokens``, ``sort``, ``index``, ``write``."""

    def advance(self, stage: str, amount: float = 1, total: float | None = None) -> None:
        """Progress within a stage (``total`` may be learned late)."""

    def finish(self, stage: str) -> None:
        """A stage ended."""

    def note(self, message: str) -> None:
        """Something the user should read (e.g. skipped files)."""


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


def file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(1 << 20):
            h.update(block)
    return h.hexdigest()


def sample_digest(path: Path, size: int | None = None) -> str:
    """SHA-256 of the size and of 16 blocks spread evenly over the file (first and last included): cheap at
    open time whatever the file size, and it catches truncation, zero-filled tails and most overwrites."""
    size = os.path.getsize(path) if size is None else size
    h = hashlib.sha256(str(size).encode())
    offsets = sorted({max(0, min(size - SAMPLE_BYTES, (size * i) // (SAMPLE_BLOCKS - 1))) for i in range(SAMPLE_BLOCKS)})
    with open(path, "rb") as f:
        for off in offsets:
            f.seek(off)
            h.update(f.read(SAMPLE_BYTES))
    return h.hexdigest()


def describe_files(directory: Path, names: Sequence[str]) -> dict:
    out = {}
    for name in names:
        p = directory / name
        size = p.stat().st_size
        out[name] = {"bytes": size, "sha256": file_sha256(p), "sample": sample_digest(p, size)}
    return out


def check_files(directory: Path, manifest: dict, verify: bool = False) -> None:
    """Every file of a shard has its recorded size and sampled checksum (and full SHA-256 with ``verify``)."""
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
        if sample_digest(p, size) != info["sample"]:
            raise DatastoreError(f"datastore shard {directory} is corrupt: {name} fails its checksum (rebuild it)")
        if verify and file_sha256(p) != info["sha256"]:
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
        from datastores.suffix_array import SuffixArrayIndex

        index = SuffixArrayIndex(meta.shards)
    elif meta.kind == "ngram":
        from datastores.ngram_faiss import NgramIndex

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


# --- atomic builds --------------------------------------------------------------------------------------------


def pid_alive(pid: int) -> bool:
    """Whether process ``pid`` still runs (a temporary directory named after a dead one is stale)."""
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    except OSError:
        return False
    return True


def clean_stale_tmp(directory: Path, prefix: str) -> None:
    """Remove temporary build directories ``.<prefix>.tmp-<pid>-*`` left by builds whose process is gone."""
    try:
        entries = list(os.scandir(directory))
    except OSError:
        return
    for entry in entries:
        m = TMP_RE.match(entry.name)
        if m and m.group(1) == prefix and not pid_alive(int(m.group(2))):
            shutil.rmtree(entry.path, ignore_errors=True)


def disk_full_error(path: Path, e: OSError) -> DatastoreError:
    try:
        free = shutil.disk_usage(path if path.exists() else path.parent).free
        free_s = f"{free / 2**20:,.0f} MiB free"
    except OSError:
        free_s = "free space unknown"
    return DatastoreError(f"disk full while building {path} ({free_s}); nothing was left behind")


@contextmanager
def atomic_shard(store: Path, index: int, count: int, force: bool) -> Iterator[tuple[Path, Path]]:
    """Yield ``(work_dir, shard_dir)``: write the shard into ``shard_dir`` (inside ``work_dir``); on a clean exit
    it is moved into place in one rename, on any error (or interrupt) everything written is removed."""
    store = Path(store).expanduser().absolute()
    name = shard_name(index, count)
    created_store = False
    if count == 1:
        if store.exists():
            if not force:
                raise DatastoreError(f"{store} already exists (use --force to replace it)")
            if not _is_store_dir(store):
                raise DatastoreError(f"{store} exists and is not a datastore; not replacing it")
        store.parent.mkdir(parents=True, exist_ok=True)
        clean_stale_tmp(store.parent, store.name)
        work = store.parent / f".{store.name}.tmp-{os.getpid()}-{secrets.token_hex(4)}"
        shard = work / name
    else:
        if store.exists():
            if not _is_store_dir(store, allow_empty=True):
                raise DatastoreError(f"{store} exists and is not a datastore")
            others = {n for _, n, _ in shard_dirs(store)}
            if others - {count}:
                raise DatastoreError(
                    f"{store} holds shards of a {sorted(others - {count})[0]}-way build; "
                    f"remove it or build those shards again with the same count"
                )
            if (store / name).exists() and not force:
                raise DatastoreError(f"shard {index}/{count} of {store} already exists (use --force to rebuild it)")
        else:
            store.mkdir(parents=True)
            created_store = True
        clean_stale_tmp(store, name)
        work = store / f".{name}.tmp-{os.getpid()}-{secrets.token_hex(4)}"
        shard = work
    ok = False
    try:
        shard.mkdir(parents=True)
        yield work, shard
        _commit(store, work, name, count)
        ok = True
    except OSError as e:
        if e.errno in (errno.ENOSPC, errno.EDQUOT):
            raise disk_full_error(store, e) from e
        raise
    finally:
        if not ok:
            shutil.rmtree(work, ignore_errors=True)
            if created_store:
                _remove_if_bare(store)


def _remove_if_bare(store: Path) -> None:
    """Remove a store directory this build created if nothing but our tokenizer copy is in it (another shard's
    build may have started in it meanwhile: then it stays)."""
    try:
        entries = list(os.scandir(store))
    except OSError:
        return
    if all(e.name == TOKENIZER_COPY or e.name.startswith(".tok-") for e in entries):
        shutil.rmtree(store, ignore_errors=True)


def _is_store_dir(path: Path, allow_empty: bool = False) -> bool:
    try:
        entries = list(os.scandir(path))
    except OSError:
        return False
    if not entries:
        return allow_empty
    return any(SHARD_RE.match(e.name) for e in entries) or (
        allow_empty and all(TMP_RE.match(e.name) or e.name == TOKENIZER_COPY for e in entries)
    )


def _commit(store: Path, work: Path, name: str, count: int) -> None:
    if count == 1:
        old = None
        if store.exists():
            old = store.parent / f".{store.name}.old-{os.getpid()}-{secrets.token_hex(4)}"
            os.rename(store, old)
        try:
            os.rename(work, store)
        except OSError:
            if old is not None:
                os.rename(old, store)
            raise
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    else:
        target = store / name
        old = None
        if target.exists():
            old = store / f".{name}.tmp-{os.getpid()}-{secrets.token_hex(4)}"
            os.rename(target, old)
        os.rename(work, target)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)


def write_json_atomic(path: Path, data: Any) -> None:
    tmp = path.parent / f".tok-{path.name}.{os.getpid()}-{secrets.token_hex(4)}"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(data, f, indent=1, sort_keys=False)
        f.write("\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def copy_atomic(src: Path, dest: Path) -> None:
    tmp = dest.parent / f".tok-{dest.name}.{os.getpid()}-{secrets.token_hex(4)}"
    try:
        shutil.copyfile(src, tmp)
        os.replace(tmp, dest)
    finally:
        if tmp.exists():
            tmp.unlink()


def now_iso() -> str:
    return datetime.now(timezone.utc).replace(microsecond=0).isoformat()


def elapsed(t0: float) -> float:
    return round(time.perf_counter() - t0, 3)
