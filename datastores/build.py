"""Building a store (or one shard of it) from a corpus, in phases: check the model and parameters, tokenise the
corpus into one token file, index it, describe it in a manifest, and commit the shard atomically (it is staged
in a work directory and renamed into place, under a lock: datastores/staging.py)."""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO, Sequence

import numpy as np

from datastores.atomic import copy_atomic, write_json_atomic
from datastores.corpus import Corpus, CorpusStats, corpus_digest
from datastores.embeddings import find_embeddings
from datastores.errors import DatastoreError
from datastores.fingerprint import describe_tokenizer_file
from datastores.integrity import remember
from datastores.ngram_faiss import write_ngram_files
from datastores.ngram_params import check_params
from datastores.shard_writer import IndexFiles, Progress
from datastores.staging import atomic_shard
from datastores.store import FORMAT, FORMAT_VERSION, KINDS, MANIFEST, describe_files, elapsed, now_iso, shard_name
from datastores.suffix_array import write_shard_files
from datastores.tokenize import SEP, TokenizeStats, tokenize_stream

SUFFIX_ARRAY_FILES = ("tokens.u32", "sa.u32", "first.u32")


@dataclass(frozen=True)
class BuildSpec:
    """Everything that decides what a build writes: which corpus, where, with which model's tokenizer, which kind of
    store and shard, and how. One value, so the CLI, the benchmarks and the tests describe a build alike."""

    sources: Sequence[str | os.PathLike]  # files, directories, or "-" for stdin
    out: str | os.PathLike  # the store directory
    model_dir: str | os.PathLike  # the model (its tokenizer.json; ngram: also its embeddings), or a tokenizer.json
    model_name: str | None = None  # the name the manifest records (default: model_dir)
    kind: str = "suffix-array"  # one of datastores.store.KINDS
    shard: tuple[int, int] = (0, 1)  # (i, n): build shard i of an n-way store
    force: bool = False  # replace an existing store (or shard)
    fields: Sequence[str] | None = None  # dotted JSONL/Arrow record fields to index
    extensions: Sequence[str] | None = None  # the text extensions a directory walk picks up
    stdin_format: str = "auto"  # for "-": auto, jsonl or text
    jobs: int = 1  # tokenizer processes
    params: dict[str, Any] | None = None  # the kind's build parameters (ngram: n, top_k, min_count, ...)
    batch_chars: int = 1 << 20  # characters per tokenizer batch


@dataclass(frozen=True)
class BuildInputs:
    """A :class:`BuildSpec` checked before the corpus is read, so that a wrong model or parameter fails at once."""

    spec: BuildSpec
    model_dir: Path
    tokenizer_path: Path
    tokenizer: dict  # the manifest's ``tokenizer`` section (fingerprint, vocabulary size, model type)
    params: dict[str, Any]  # the kind's parameters, defaults filled in
    jobs: int

    @property
    def vocab_size(self) -> int:
        return int(self.tokenizer["vocab_size"])


@dataclass(frozen=True)
class Tokenized:
    """What the tokenise phase found: token and document counts, what the corpus reader read and skipped, its time."""

    tokens: TokenizeStats
    corpus: CorpusStats
    seconds: float


def build_store(
    sources: Sequence[str | os.PathLike],
    out: str | os.PathLike,
    *,
    model_dir: str | os.PathLike,
    progress: Progress | None = None,
    stdin: BinaryIO | None = None,
    **settings: Any,
) -> dict:
    """:func:`build_shard` with the spec given as keywords: ``settings`` are the other fields of :class:`BuildSpec`
    (``kind``, ``shard``, ``force``, ``params``, ...)."""
    return build_shard(BuildSpec(sources, out, model_dir, **settings), progress=progress, stdin=stdin)


def build_shard(spec: BuildSpec, progress: Progress | None = None, stdin: BinaryIO | None = None) -> dict:
    """Build shard ``spec.shard = (i, n)`` of a ``spec.kind`` store at ``spec.out``; return its manifest.

    ``stdin`` stands for standard input where a source is ``-``. Raises :class:`DatastoreError` for every
    user-facing problem."""
    progress = progress or Progress()
    inputs = check_inputs(spec)
    corpus = Corpus(spec.sources, fields=spec.fields, extensions=spec.extensions, stdin_format=spec.stdin_format,
                    stdin=stdin)
    out = Path(spec.out).expanduser().absolute()
    t_start = time.perf_counter()
    with atomic_shard(out, *spec.shard, spec.force) as staged:
        tokens_path = staged.shard / "tokens.u32"
        tokenized = tokenize_corpus(inputs, corpus, tokens_path, progress)
        _report_skipped(tokenized.corpus, progress)
        _require_tokens(tokenized, spec.shard)
        t_index = time.perf_counter()
        index = write_index(inputs, staged.shard, tokens_path, progress)
        index_s = elapsed(t_index)
        progress.start("write", None)
        manifest = describe_shard(inputs, tokenized, index, index_s, staged.shard)
        manifest["build"]["total_s"] = elapsed(t_start)
        write_json_atomic(staged.shard / MANIFEST, manifest)
        copy_atomic(inputs.tokenizer_path, staged.tokenizer_copy)
        progress.finish("write")
    final = out / shard_name(*spec.shard)
    for name, info in manifest["files"].items():  # hashed just now: its first open need not hash it again
        remember(final / name, info["sha256"])
    return manifest


def check_inputs(spec: BuildSpec) -> BuildInputs:
    """The kind, the model's tokenizer and the kind's parameters (ngram: also the model's embeddings) checked."""
    if spec.kind not in KINDS:
        raise DatastoreError(f"unknown datastore kind {spec.kind!r} (choose {' or '.join(KINDS)})")
    model_dir = Path(spec.model_dir)
    tokenizer_path = model_dir / "tokenizer.json" if model_dir.is_dir() else model_dir
    if not tokenizer_path.is_file():
        raise DatastoreError(f"no tokenizer.json in {model_dir} (a datastore needs the model's fast tokenizer)")
    tokenizer = describe_tokenizer_file(tokenizer_path)
    params = dict(spec.params or {})
    if spec.kind == "ngram":
        params = check_params(params)
        find_embeddings(model_dir)  # fail before reading the corpus
    elif params:
        raise DatastoreError(f"suffix-array stores take no build parameters (got {', '.join(params)})")
    return BuildInputs(spec, model_dir, tokenizer_path, tokenizer, params, max(1, int(spec.jobs)))


class _FilesRead:
    """How many files the corpus reader has finished (read or skipped) since the last look: the ``files`` bar."""

    def __init__(self, corpus: Corpus) -> None:
        self.corpus = corpus
        self.seen = 0

    def since_last(self) -> int:
        now = len(self.corpus.stats.sources) + len(self.corpus.stats.skipped_files)
        step, self.seen = now - self.seen, now
        return step


def tokenize_corpus(inputs: BuildInputs, corpus: Corpus, tokens_path: Path, progress: Progress) -> Tokenized:
    """The corpus (this shard's documents) as one uint32 token file: SEP, then each document followed by SEP."""
    spec = inputs.spec
    stats = TokenizeStats()
    progress.start("tokens", None)
    t0 = time.perf_counter()
    files = _FilesRead(corpus)

    def on_batch(tokens: int, chars: int) -> None:
        progress.advance("tokens", tokens)
        step = files.since_last()
        if step:
            progress.advance("files", step)

    progress.start("files", None)
    with open(tokens_path, "wb") as f:
        np.array([SEP], dtype=np.uint32).tofile(f)
        for arr in tokenize_stream(
            corpus, inputs.tokenizer_path, jobs=inputs.jobs, batch_chars=spec.batch_chars, shard=spec.shard,
            stats=stats, on_batch=on_batch,
        ):
            arr.tofile(f)
    progress.advance("files", files.since_last())
    progress.finish("files")
    progress.finish("tokens")
    return Tokenized(stats, corpus.stats, elapsed(t0))


def _report_skipped(cstats: CorpusStats, progress: Progress) -> None:
    """Skipped files and records are never silent: one note each, with an example or the reasons."""
    if cstats.skipped_files:
        path, reason = cstats.skipped_files[0]
        progress.note(f"skipped {len(cstats.skipped_files)} unreadable file(s), e.g. {path}: {reason}")
    if cstats.skipped_records:
        reasons = ", ".join(f"{n:,} {r}" for r, n in cstats.skipped_records.most_common())
        progress.note(f"skipped {cstats.n_skipped_records:,} record(s): {reasons}")


def _require_tokens(tokenized: Tokenized, shard: tuple[int, int]) -> None:
    """A shard without tokens is an error that says why: no text at all, or none of the documents fell to it."""
    if tokenized.tokens.tokens == 0:
        index, count = shard
        cstats = tokenized.corpus
        what = "has no text"
        if count > 1 and cstats.documents:
            what = f"gives shard {index}/{count} no documents ({cstats.documents} in all)"
        raise DatastoreError(f"the corpus {what}: {cstats.summary()}")


def write_index(inputs: BuildInputs, shard_dir: Path, tokens_path: Path, progress: Progress) -> IndexFiles:
    """The kind's index files from the token file (an n-gram store does not keep the token file)."""
    if inputs.spec.kind == "suffix-array":
        progress.start("sort", None)
        info = write_shard_files(shard_dir, tokens_path, inputs.vocab_size,
                                 progress=lambda s: progress.advance("sort", 0))
        progress.finish("sort")
        return IndexFiles(info, list(SUFFIX_ARRAY_FILES))
    progress.start("index", None)
    index = write_ngram_files(shard_dir, tokens_path, inputs.vocab_size, inputs.model_dir, inputs.params, progress)
    progress.finish("index")
    tokens_path.unlink()
    return index


def describe_shard(
    inputs: BuildInputs, tokenized: Tokenized, index: IndexFiles, index_s: float, shard_dir: Path
) -> dict:
    """The shard's manifest (all but ``build.total_s``, which the caller adds last): what was built, from what,
    with which parameters, how fast, and every file's size and checksums."""
    spec, stats = inputs.spec, tokenized.tokens
    shard_index, count = spec.shard
    return {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "kind": spec.kind,
        "created": now_iso(),
        "model": {"name": spec.model_name or str(inputs.model_dir), "path": str(inputs.model_dir)},
        "tokenizer": inputs.tokenizer,
        "shard": {"index": shard_index, "count": count, "split": "document number modulo count"},
        "corpus": _describe_corpus(spec, tokenized),
        "params": inputs.params,
        "index": index.info,
        "build": {
            "jobs": inputs.jobs,
            "tokenize_s": tokenized.seconds,
            "index_s": index_s,
            "index_tokens_per_s": round(stats.tokens / index_s) if index_s > 0 else None,
        },
        "files": describe_files(shard_dir, index.files),
    }


def _describe_corpus(spec: BuildSpec, tokenized: Tokenized) -> dict:
    """The manifest's ``corpus`` section: every source with its checksum (the shards of a store must agree on
    their digest), the counts, and everything skipped."""
    cstats, stats = tokenized.corpus, tokenized.tokens
    sources = [s.as_dict() for s in cstats.sources]
    return {
        "digest": corpus_digest(sources),
        "files": len(sources),
        "documents": stats.documents,
        "tokens": stats.tokens,
        "chars": stats.chars,
        "sources": sources,
        "skipped_files": [{"path": p, "reason": r} for p, r in cstats.skipped_files],
        "skipped_records": dict(cstats.skipped_records),
        "fields": list(spec.fields or []),
    }
