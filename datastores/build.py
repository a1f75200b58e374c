"""Building a store (or one shard of it) from a corpus: read, tokenise, index, describe, commit atomically (the
shard is written in a work directory beside it and renamed into place, under a lock: datastores/atomic.py)."""

from __future__ import annotations

import errno
import os
import secrets
import shutil
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, BinaryIO, Iterator, Sequence

import numpy as np

from datastores.atomic import TMP_RE, clean_stale_tmp, copy_atomic, lock, swap_into_place, write_json_atomic
from datastores.corpus import Corpus, corpus_digest
from datastores.errors import DatastoreError
from datastores.fingerprint import describe_tokenizer_file
from datastores.integrity import remember
from datastores.store import (
    FORMAT,
    FORMAT_VERSION,
    KINDS,
    MANIFEST,
    SHARD_RE,
    TOKENIZER_COPY,
    Progress,
    describe_files,
    elapsed,
    now_iso,
    shard_dirs,
    shard_name,
)
from datastores.tokenize import SEP, TokenizeStats, tokenize_stream


def build_store(
    sources: Sequence[str | os.PathLike],
    out: str | os.PathLike,
    *,
    model_dir: str | os.PathLike,
    model_name: str | None = None,
    kind: str = "suffix-array",
    shard: tuple[int, int] = (0, 1),
    force: bool = False,
    fields: Sequence[str] | None = None,
    extensions: Sequence[str] | None = None,
    stdin_format: str = "auto",
    jobs: int = 1,
    params: dict[str, Any] | None = None,
    progress: Progress | None = None,
    stdin: BinaryIO | None = None,
    batch_chars: int = 1 << 20,
) -> dict:
    """Build shard ``shard = (i, n)`` of a ``kind`` store at ``out`` from ``sources``; return its manifest.

    ``params`` are the kind's build parameters (ngram: ``n``, ``top_k``, ``min_count``, ``max_contexts``,
    ``dim``, ``nprobe``, ``decay``). Raises :class:`DatastoreError` for every user-facing problem.
    """
    if kind not in KINDS:
        raise DatastoreError(f"unknown datastore kind {kind!r} (choose {' or '.join(KINDS)})")
    progress = progress or Progress()
    model_dir = Path(model_dir)
    tokenizer_path = model_dir / "tokenizer.json" if model_dir.is_dir() else model_dir
    if not tokenizer_path.is_file():
        raise DatastoreError(f"no tokenizer.json in {model_dir} (a datastore needs the model's fast tokenizer)")
    tok_info = describe_tokenizer_file(tokenizer_path)
    vocab_size = int(tok_info["vocab_size"])
    params = dict(params or {})
    if kind == "ngram":
        from datastores.ngram_faiss import check_params
        from datastores.embeddings import find_embeddings

        params = check_params(params)
        find_embeddings(model_dir)  # fail before reading the corpus
    elif params:
        raise DatastoreError(f"suffix-array stores take no build parameters (got {', '.join(params)})")
    jobs = max(1, int(jobs))
    corpus = Corpus(sources, fields=fields, extensions=extensions, stdin_format=stdin_format, stdin=stdin)
    out = Path(out).expanduser().absolute()
    index, count = shard
    t_start = time.perf_counter()

    with atomic_shard(out, index, count, force) as (work, shard_dir):
        tokens_path = shard_dir / "tokens.u32"
        stats = TokenizeStats()
        progress.start("tokens", None)
        t0 = time.perf_counter()
        seen_files = 0

        def on_batch(tokens: int, chars: int) -> None:
            nonlocal seen_files
            progress.advance("tokens", tokens)
            now = len(corpus.stats.sources) + len(corpus.stats.skipped_files)
            if now != seen_files:
                progress.advance("files", now - seen_files)
                seen_files = now

        progress.start("files", None)
        with open(tokens_path, "wb") as f:
            np.array([SEP], dtype=np.uint32).tofile(f)
            for arr in tokenize_stream(
                corpus, tokenizer_path, jobs=jobs, batch_chars=batch_chars, shard=shard, stats=stats, on_batch=on_batch
            ):
                arr.tofile(f)
        now = len(corpus.stats.sources) + len(corpus.stats.skipped_files)
        progress.advance("files", now - seen_files)
        progress.finish("files")
        progress.finish("tokens")
        t_tok = elapsed(t0)
        cstats = corpus.stats
        if cstats.skipped_files:
            progress.note(
                f"skipped {len(cstats.skipped_files)} unreadable file(s), e.g. {cstats.skipped_files[0][0]}: "
                f"{cstats.skipped_files[0][1]}"
            )
        if cstats.skipped_records:
            reasons = ", ".join(f"{n:,} {r}" for r, n in cstats.skipped_records.most_common())
            progress.note(f"skipped {cstats.n_skipped_records:,} record(s): {reasons}")
        if stats.tokens == 0:
            what = "has no text"
            if count > 1 and cstats.documents:
                what = f"gives shard {index}/{count} no documents ({cstats.documents} in all)"
            raise DatastoreError(f"the corpus {what}: {cstats.summary()}")

        t1 = time.perf_counter()
        if kind == "suffix-array":
            from datastores.suffix_array import write_shard_files

            progress.start("sort", None)
            index_info = write_shard_files(shard_dir, tokens_path, vocab_size, progress=lambda s: progress.advance("sort", 0))
            progress.finish("sort")
            files = ["tokens.u32", "sa.u32", "first.u32"]
        else:
            from datastores.ngram_faiss import write_ngram_files

            progress.start("index", None)
            index_info, files = write_ngram_files(shard_dir, tokens_path, vocab_size, model_dir, params, progress)
            progress.finish("index")
            tokens_path.unlink()
        t_index = elapsed(t1)
        progress.start("write", None)
        sources_list = [s.as_dict() for s in cstats.sources]
        manifest = {
            "format": FORMAT,
            "format_version": FORMAT_VERSION,
            "kind": kind,
            "created": now_iso(),
            "model": {"name": model_name or str(model_dir), "path": str(model_dir)},
            "tokenizer": tok_info,
            "shard": {"index": index, "count": count, "split": "document number modulo count"},
            "corpus": {
                "digest": corpus_digest(sources_list),
                "files": len(sources_list),
                "documents": stats.documents,
                "tokens": stats.tokens,
                "chars": stats.chars,
                "sources": sources_list,
                "skipped_files": [{"path": p, "reason": r} for p, r in cstats.skipped_files],
                "skipped_records": dict(cstats.skipped_records),
                "fields": list(fields or []),
            },
            "params": params,
            "index": index_info,
            "build": {
                "jobs": jobs,
                "tokenize_s": t_tok,
                "index_s": t_index,
                "index_tokens_per_s": round(stats.tokens / t_index) if t_index > 0 else None,
            },
            "files": describe_files(shard_dir, files),
        }
        manifest["build"]["total_s"] = elapsed(t_start)
        write_json_atomic(shard_dir / MANIFEST, manifest)
        if count == 1:
            copy_atomic(tokenizer_path, work / TOKENIZER_COPY)
        else:
            copy_atomic(tokenizer_path, out / TOKENIZER_COPY)
        progress.finish("write")
    final = out / shard_name(index, count)
    for name, info in manifest["files"].items():  # hashed just now: its first open need not hash it again
        remember(final / name, info["sha256"])
    return manifest


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


def _build_lock(store: Path, name: str, index: int, count: int):
    """One build of a store's shard at a time: ``.<store>.<shard>.lock`` beside the store; a second build fails."""
    def busy() -> None:
        what = f"shard {index}/{count} of {store}" if count > 1 else str(store)
        raise DatastoreError(f"another graft process is building {what}; wait for it to finish")

    return lock(store.parent / f".{store.name}.{name}.lock", busy)


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
    """The finished work directory into place: the whole store, or one shard inside it."""
    tag = f"{os.getpid()}-{secrets.token_hex(4)}"
    if count == 1:
        swap_into_place(work, store, store.parent / f".{store.name}.old-{tag}")
    else:
        swap_into_place(work, store / name, store / f".{name}.tmp-{tag}")
