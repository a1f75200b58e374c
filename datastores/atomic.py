"""Atomic builds: a shard is written into a hidden temporary directory beside its destination and renamed into
place only when it is complete, under a lock that keeps a second build of the same name out; temporaries whose
process is gone (a build killed with SIGKILL) are removed by the next graft command of any kind."""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import re
import secrets
import shutil
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

from datastores.errors import DatastoreError
from datastores.store import SHARD_RE, TMP_RE, TOKENIZER_COPY, shard_dirs, shard_name

TOK_RE = re.compile(r"^\.tok-.+\.(\d+)-[0-9a-f]+$")  # write_json_atomic's and copy_atomic's temporary files

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


def clean_stale_tmp(directory: Path, prefix: str | None = None) -> None:
    """Remove the temporaries builds whose process is gone left in ``directory``: work and swap directories
    ``.<prefix>.tmp-<pid>-*`` / ``.<prefix>.old-<pid>-*`` (``prefix`` None: of any name) and ``.tok-*`` files."""
    try:
        entries = list(os.scandir(directory))
    except OSError:
        return
    for entry in entries:
        m = TMP_RE.match(entry.name)
        if m and (prefix is None or m.group(1) == prefix) and not pid_alive(int(m.group(2))):
            shutil.rmtree(entry.path, ignore_errors=True)
        m = TOK_RE.match(entry.name)
        if m and prefix is None and not pid_alive(int(m.group(1))):
            with contextlib.suppress(OSError):
                os.unlink(entry.path)


def sweep(root: Path) -> None:
    """What builds killed outright (SIGKILL) left under the stores root ``root``: temporaries beside the stores and
    inside each (shard builds), and lock files no process holds. Cheap (a directory listing or two); run by every
    graft command."""
    clean_stale_tmp(root)
    try:
        entries = list(os.scandir(root))
    except OSError:
        return
    for entry in entries:
        if entry.name.startswith(".") and entry.name.endswith(".lock"):
            _drop_free_lock(Path(entry.path))
        elif not entry.name.startswith(".") and entry.is_dir():
            clean_stale_tmp(Path(entry.path))


def _drop_free_lock(path: Path) -> None:
    """Remove a build lock file when no process holds it (a build that takes it meanwhile notices, see
    :func:`_build_lock`)."""
    try:
        fd = os.open(path, os.O_RDWR)
    except OSError:
        return
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        os.unlink(path)
    except OSError:
        pass
    finally:
        os.close(fd)


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
    it is moved into place in one rename, on any error (or interrupt) everything written is removed. One build of
    a store (or shard) at a time: from the "already exists" check to the rename it holds a lock, and a second
    build of the same name fails at once instead of replacing the first one's store. Every OSError (a full disk,
    a read-only or forbidden directory) becomes a one-line DatastoreError."""
    store = Path(store).expanduser().absolute()
    name = shard_name(index, count)
    try:
        store.parent.mkdir(parents=True, exist_ok=True)
        with _build_lock(store, name, index, count):
            yield from _atomic_shard(store, name, index, count, force)
    except OSError as e:
        if e.errno in (errno.ENOSPC, errno.EDQUOT):
            raise disk_full_error(store, e) from e
        where = f" ({e.filename})" if e.filename else ""
        raise DatastoreError(f"cannot build {store}: {e.strerror or e}{where}") from e


@contextmanager
def _build_lock(store: Path, name: str, index: int, count: int) -> Iterator[None]:
    """An advisory ``flock`` on ``.<store>.<shard>.lock`` beside the store, removed when the build ends (a lock
    taken on a file that was removed meanwhile is taken again on the new one, so removing it is safe)."""
    path = store.parent / f".{store.name}.{name}.lock"
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            what = f"shard {index}/{count} of {store}" if count > 1 else str(store)
            raise DatastoreError(f"another graft process is building {what}; wait for it to finish") from None
        try:
            if os.stat(path).st_ino == os.fstat(fd).st_ino:
                break
        except FileNotFoundError:
            pass
        os.close(fd)
    try:
        yield
    finally:
        with contextlib.suppress(OSError):
            os.unlink(path)
        os.close(fd)


def _atomic_shard(store: Path, name: str, index: int, count: int, force: bool) -> Iterator[tuple[Path, Path]]:
    created_store = False
    if count == 1:
        if store.exists():
            if not force:
                raise DatastoreError(f"{store} already exists (use --force to replace it)")
            if not _is_store_dir(store):
                raise DatastoreError(f"{store} exists and is not a datastore; not replacing it")
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
