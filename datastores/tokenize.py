"""Tokenising a document stream with a model's fast tokenizer, in batches, over several processes.

Only the ``tokenizers`` library is used (``tokenizer.json``), never transformers. Documents are encoded without
special tokens and each one is followed by :data:`SEP`, an id outside every vocabulary, so that no match in a
store can run from one document into the next. Results come back in corpus order whatever the number of
processes, so a build is deterministic.
"""

from __future__ import annotations

import os
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable, Iterator, Sequence

import numpy as np

from datastores.errors import DatastoreError

SEP = np.uint32(0xFFFFFFFF)  # document separator: never a token id, never in a query
SEP_INT = int(SEP)

_TOKENIZER = None  # per worker process


def load_tokenizer(path: str | Path):
    from tokenizers import Tokenizer

    path = Path(path)
    if path.is_dir():
        path = path / "tokenizer.json"
    if not path.is_file():
        raise DatastoreError(f"no tokenizer.json at {path.parent} (a store needs the model's fast tokenizer)")
    try:
        tok = Tokenizer.from_file(str(path))
    except Exception as e:  # the Rust side raises plain Exception subclasses
        raise DatastoreError(f"cannot read tokenizer {path}: {str(e).splitlines()[0]}") from e
    tok.no_truncation()
    tok.no_padding()
    return tok


def _init_worker(path: str) -> None:
    # one process, one thread: the pool itself is the parallelism
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    os.environ["RAYON_NUM_THREADS"] = "1"
    global _TOKENIZER
    _TOKENIZER = load_tokenizer(path)


def encode_documents(tok, texts: Sequence[str]) -> tuple[np.ndarray, int]:
    """Token ids of ``texts`` each followed by SEP (documents that encode to nothing are dropped)."""
    encodings = tok.encode_batch_fast(list(texts), add_special_tokens=False)
    pieces = []
    sep = np.array([SEP], dtype=np.uint32)
    docs = 0
    for enc in encodings:
        ids = enc.ids
        if not ids:
            continue
        pieces.append(np.asarray(ids, dtype=np.uint32))
        pieces.append(sep)
        docs += 1
    if not pieces:
        return np.empty(0, dtype=np.uint32), 0
    return np.concatenate(pieces), docs


def _encode_in_worker(texts: list[str]) -> tuple[np.ndarray, int]:
    return encode_documents(_TOKENIZER, texts)


def batches(docs: Iterable[str], batch_chars: int, shard: tuple[int, int] = (0, 1)) -> Iterator[list[str]]:
    """Group documents into batches of about ``batch_chars`` characters, keeping only shard ``i`` of ``n``
    (document number modulo ``n``)."""
    i, n = shard
    batch: list[str] = []
    size = 0
    for k, doc in enumerate(docs):
        if n > 1 and k % n != i:
            continue
        batch.append(doc)
        size += len(doc)
        if size >= batch_chars:
            yield batch
            batch, size = [], 0
    if batch:
        yield batch


@dataclass
class TokenizeStats:
    documents: int = 0  # documents that produced tokens
    tokens: int = 0  # tokens, separators excluded
    chars: int = 0


def tokenize_stream(
    docs: Iterable[str],
    tokenizer_path: str | Path,
    *,
    jobs: int = 1,
    batch_chars: int = 1 << 20,
    shard: tuple[int, int] = (0, 1),
    stats: TokenizeStats | None = None,
    on_batch: Callable[[int, int], None] | None = None,
) -> Iterator[np.ndarray]:
    """Yield uint32 arrays (documents each followed by SEP) in corpus order.

    ``jobs`` > 1 encodes in that many spawned processes, with at most ``2 * jobs`` batches in flight so the
    corpus is never read far ahead of the tokenizer. ``on_batch(tokens, chars)`` reports progress.
    """
    stats = stats if stats is not None else TokenizeStats()
    encoded = (_encoded_here(docs, tokenizer_path, batch_chars, shard) if jobs <= 1
               else _encoded_in_pool(docs, tokenizer_path, jobs, batch_chars, shard))
    try:
        for arr, ndocs, chars in encoded:
            stats.documents += ndocs
            stats.tokens += int(arr.size) - ndocs
            stats.chars += chars
            if on_batch is not None:
                on_batch(int(arr.size) - ndocs, chars)
            yield arr
    finally:
        encoded.close()  # a reader that stops early shuts the workers down now


def _encoded_here(docs: Iterable[str], tokenizer_path: str | Path, batch_chars: int,
                  shard: tuple[int, int]) -> Iterator[tuple[np.ndarray, int, int]]:
    """Each batch encoded in this process: its array, its documents and its characters (the tokenizers library's
    own threads off meanwhile, as they are in a worker)."""
    tok = load_tokenizer(tokenizer_path)
    saved = os.environ.get("TOKENIZERS_PARALLELISM")
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    try:
        for batch in batches(docs, batch_chars, shard):
            arr, nd = encode_documents(tok, batch)
            yield arr, nd, sum(map(len, batch))
    finally:
        if saved is None:
            os.environ.pop("TOKENIZERS_PARALLELISM", None)
        else:
            os.environ["TOKENIZERS_PARALLELISM"] = saved


def _encoded_in_pool(docs: Iterable[str], tokenizer_path: str | Path, jobs: int, batch_chars: int,
                     shard: tuple[int, int]) -> Iterator[tuple[np.ndarray, int, int]]:
    """Each batch encoded in one of ``jobs`` spawned processes, in corpus order, at most ``2 * jobs`` in flight."""
    import multiprocessing as mp
    from concurrent.futures import ProcessPoolExecutor
    from concurrent.futures.process import BrokenProcessPool

    load_tokenizer(tokenizer_path)  # fail here, clearly, rather than in every worker
    pool = ProcessPoolExecutor(
        max_workers=jobs, mp_context=mp.get_context("spawn"), initializer=_init_worker, initargs=(str(tokenizer_path),)
    )
    try:
        pending: deque = deque()
        for batch in batches(docs, batch_chars, shard):
            pending.append((pool.submit(_encode_in_worker, batch), sum(map(len, batch))))
            while len(pending) >= 2 * jobs:
                fut, chars = pending.popleft()
                yield (*fut.result(), chars)
        while pending:
            fut, chars = pending.popleft()
            yield (*fut.result(), chars)
    except BrokenProcessPool as e:
        raise DatastoreError(
            "the tokenizer worker processes died (out of memory, or a __main__ that spawned processes cannot "
            "import); retry with --jobs 1"
        ) from e
    finally:
        pool.shutdown(wait=True, cancel_futures=True)
