"""Where a build writes: a shard is staged in a hidden work directory beside its destination and renamed into
place in one step when it is complete, under a lock, so that an interrupted or failed build (a full disk
included) leaves nothing behind and two builds of one store never interleave (the file primitives are
datastores/atomic.py)."""

from __future__ import annotations

import errno
import os
import secrets
import shutil
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

from datastores.atomic import TMP_RE, clean_stale_tmp, lock, swap_into_place
from datastores.errors import DatastoreError
from datastores.store import SHARD_RE, TOKENIZER_COPY, shard_dirs, shard_name


@dataclass(frozen=True)
class StagedShard:
    """The directories a build writes into before its shard is moved into place."""

    work: Path  # renamed into place on success: the whole store (one shard), or the shard itself
    shard: Path  # the shard's files and manifest go here (inside ``work``, or ``work`` itself)
    tokenizer_copy: Path  # a whole store carries its tokenizer copy in ``work``; a shard's goes in the store


def disk_full_error(path: Path) -> DatastoreError:
    """A full disk said in one line, with the free space left (the build removed what it wrote)."""
    try:
        free = shutil.disk_usage(path if path.exists() else path.parent).free
        free_s = f"{free / 2**20:,.0f} MiB free"
    except OSError:
        free_s = "free space unknown"
    return DatastoreError(f"disk full while building {path} ({free_s}); nothing was left behind")


@contextmanager
def atomic_shard(store: Path, index: int, count: int, force: bool) -> Iterator[StagedShard]:
    """Stage shard ``index`` of ``count`` of ``store``: on a clean exit it is moved into place in one rename, on
    any error (or interrupt) everything written is removed. One build of a store (or shard) at a time: from the
    "already exists" check to the rename it holds a lock, and a second build of the same name fails at once
    instead of replacing the first one's store. Every OSError (a full disk, a read-only or forbidden directory)
    becomes a one-line DatastoreError."""
    store = Path(store).expanduser().absolute()
    name = shard_name(index, count)
    try:
        store.parent.mkdir(parents=True, exist_ok=True)
        with _build_lock(store, name, index, count):
            yield from _staged(store, name, index, count, force)
    except OSError as e:
        if e.errno in (errno.ENOSPC, errno.EDQUOT):
            raise disk_full_error(store) from e
        where = f" ({e.filename})" if e.filename else ""
        raise DatastoreError(f"cannot build {store}: {e.strerror or e}{where}") from e


def _build_lock(store: Path, name: str, index: int, count: int) -> AbstractContextManager[None]:
    """One build of a store's shard at a time: ``.<store>.<shard>.lock`` beside the store; a second build fails."""
    def busy() -> None:
        what = f"shard {index}/{count} of {store}" if count > 1 else str(store)
        raise DatastoreError(f"another graft process is building {what}; wait for it to finish")

    return lock(store.parent / f".{store.name}.{name}.lock", busy)


def _staged(store: Path, name: str, index: int, count: int, force: bool) -> Iterator[StagedShard]:
    """The work directory made, yielded, and committed, or removed (with a store directory this build created)."""
    created_store = False
    if count == 1:
        _check_replaceable_store(store, force)
        clean_stale_tmp(store.parent, store.name)
        work = store.parent / f".{store.name}.tmp-{os.getpid()}-{secrets.token_hex(4)}"
        staged = StagedShard(work, work / name, work / TOKENIZER_COPY)
    else:
        if store.exists():
            _check_shard_slot(store, name, index, count, force)
        else:
            store.mkdir(parents=True)
            created_store = True
        clean_stale_tmp(store, name)
        work = store / f".{name}.tmp-{os.getpid()}-{secrets.token_hex(4)}"
        staged = StagedShard(work, work, store / TOKENIZER_COPY)
    ok = False
    try:
        staged.shard.mkdir(parents=True)
        yield staged
        _commit(store, work, name, count)
        ok = True
    finally:
        if not ok:
            shutil.rmtree(work, ignore_errors=True)
            if created_store:
                _remove_if_bare(store)


def _check_replaceable_store(store: Path, force: bool) -> None:
    """An unsharded build replaces an existing store only with ``force``, and never a directory that is no store."""
    if store.exists():
        if not force:
            raise DatastoreError(f"{store} already exists (use --force to replace it)")
        if not _is_store_dir(store):
            raise DatastoreError(f"{store} exists and is not a datastore; not replacing it")


def _check_shard_slot(store: Path, name: str, index: int, count: int, force: bool) -> None:
    """A shard joins an existing store only if the store holds shards of the same count, and replaces its own
    earlier build only with ``force``."""
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
    """Whether ``path`` holds shards (or, with ``allow_empty``, nothing yet but build leftovers and a tokenizer):
    a build never replaces a directory that is something else."""
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
    """The finished work directory into place: the whole store, or one shard inside it."""
    tag = f"{os.getpid()}-{secrets.token_hex(4)}"
    if count == 1:
        swap_into_place(work, store, store.parent / f".{store.name}.old-{tag}")
    else:
        swap_into_place(work, store / name, store / f".{name}.tmp-{tag}")
