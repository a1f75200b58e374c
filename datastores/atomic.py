"""File safety, for every part of graft that writes (stores, the model catalog, latency profiles, the adjacency
table): a file or directory is written under a temporary name beside its destination and renamed into place only
when it is complete, under a lock where two processes could collide; temporaries name their process, so that
those of a process that is gone (killed with SIGKILL) are removed by the next graft command of any kind.
Torch-free, like the rest of datastores/."""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import re
import secrets
import shutil
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator

TMP_RE = re.compile(r"^\.(.+)\.(?:tmp|old)-(\d+)-[0-9a-f]+$")  # build work and swap directories
TOK_RE = re.compile(r"^\.tok-.+\.(\d+)-[0-9a-f]+$")  # atomic_file's temporary files


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


def remove_stale(directory: Path, pattern: re.Pattern, pid_group: int | str = 1,
                 also: Callable[[re.Match], bool] | None = None) -> list[Path]:
    """Remove the entries of ``directory`` whose name matches ``pattern`` and names (in ``pid_group``) a process
    that is gone, or for which ``also`` holds (the caller knows no live process uses them). Returns them."""
    try:
        entries = list(os.scandir(directory))
    except OSError:
        return []
    removed = []
    for entry in entries:
        m = pattern.match(entry.name)
        if m and ((also is not None and also(m)) or not pid_alive(int(m.group(pid_group)))):
            if entry.is_dir(follow_symlinks=False):
                shutil.rmtree(entry.path, ignore_errors=True)
            else:
                with contextlib.suppress(OSError):
                    os.unlink(entry.path)
            removed.append(Path(entry.path))
    return removed


def clean_stale_tmp(directory: Path, prefix: str | None = None) -> None:
    """Remove the temporaries builds whose process is gone left in ``directory``: work and swap directories
    ``.<prefix>.tmp-<pid>-*`` / ``.<prefix>.old-<pid>-*`` (``prefix`` None: of any name) and, with ``prefix``
    None, :func:`atomic_file`'s ``.tok-*`` files."""
    ours = re.compile(TMP_RE.pattern if prefix is None else rf"^\.{re.escape(prefix)}\.(?:tmp|old)-(\d+)-[0-9a-f]+$")
    remove_stale(directory, ours, 2 if prefix is None else 1)
    if prefix is None:
        remove_stale(directory, TOK_RE)


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
    :func:`lock`)."""
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


@contextmanager
def lock(path: Path, busy: Callable[[], None]) -> Iterator[None]:
    """An advisory ``flock`` on the file ``path``, removed when released. Where another process holds it,
    ``busy`` runs: it raises to give up, or returns (say, after printing that it waits) to wait for the lock.
    A lock taken on a file that was removed meanwhile is taken again on the new one, so removing it is safe."""
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            if not _try_flock(fd):
                busy()
                fcntl.flock(fd, fcntl.LOCK_EX)
            if _is_current(path, fd):
                break
        except BaseException:
            os.close(fd)
            raise
        os.close(fd)
    try:
        yield
    finally:
        with contextlib.suppress(OSError):
            os.unlink(path)
        os.close(fd)


def _try_flock(fd: int) -> bool:
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    return True


def _is_current(path: Path, fd: int) -> bool:
    """Whether ``fd`` is still the file at ``path`` (not one removed meanwhile)."""
    try:
        return os.stat(path).st_ino == os.fstat(fd).st_ino
    except FileNotFoundError:
        return False


def swap_into_place(src: Path, dest: Path, old: Path) -> None:
    """Rename the finished directory ``src`` to ``dest``; an existing ``dest`` is first renamed to ``old`` (a
    temporary name :func:`remove_stale` knows), put back if the second rename fails, and removed at the end."""
    moved = dest.exists()
    if moved:
        os.rename(dest, old)
    try:
        os.rename(src, dest)
    except OSError:
        if moved:
            os.rename(old, dest)
        raise
    if moved:
        shutil.rmtree(old, ignore_errors=True)


@contextmanager
def atomic_file(path: Path) -> Iterator[Path]:
    """Yield a temporary path beside ``path`` (same filesystem) to write; on a clean exit it replaces ``path`` in
    one rename, on any error it is removed: a reader sees the old file or the new one, never half of one."""
    path = Path(path)
    tmp = path.parent / f".tok-{path.name}.{os.getpid()}-{secrets.token_hex(4)}"
    try:
        yield tmp
        os.replace(tmp, path)
    finally:
        with contextlib.suppress(OSError):
            tmp.unlink(missing_ok=True)


def write_text_atomic(path: Path, text: str) -> None:
    with atomic_file(path) as tmp:
        tmp.write_text(text, encoding="utf-8")


def write_json_atomic(path: Path, data: Any) -> None:
    """JSON, flushed to the disk before the rename (a store's manifest must survive a power cut whole)."""
    with atomic_file(path) as tmp, open(tmp, "w", encoding="utf-8") as f:
        json.dump(data, f, indent=1, sort_keys=False)
        f.write("\n")
        f.flush()
        os.fsync(f.fileno())


def copy_atomic(src: Path, dest: Path) -> None:
    with atomic_file(dest) as tmp:
        shutil.copyfile(src, tmp)
