"""Reading a corpus as a stream of documents.

A corpus is a list of sources: directories (walked recursively, in sorted order, hidden entries skipped),
files, or ``-`` for standard input. A file is read according to its extension:

* ``.jsonl`` / ``.ndjson``: one JSON record per line. The text of a record is the ``--field`` paths given
  (dotted, e.g. ``response`` or ``data.text`` or ``turns.0``; several fields are joined by a blank line), or
  else, by default, its chat ``messages`` / ``conversations`` list (the contents joined), else its ``text``
  string, else all of its top-level string values joined by newlines (datastores/records.py).
* ``.parquet``, ``.arrow``, ``.feather``, ``.ipc``: read in record batches through ``pyarrow.dataset``, rows
  handled like JSONL records.
* Text, Markdown and source code (by extension, see :data:`TEXT_EXTENSIONS`; any extension when the file is
  named explicitly): one document per file, cut at line boundaries into pieces of about ``chunk_chars``
  characters so that a huge file never sits in memory whole.

Nothing is held whole: files are read line by line or in blocks, every source is hashed while it is read (its
size and SHA-256 go to the store's manifest), and every document or file that is dropped is counted with its
reason (:class:`CorpusStats`), never silently.
"""

from __future__ import annotations

import codecs
import hashlib
import json
import os
import sys
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO, Callable, Iterable, Iterator, Sequence

from datastores.errors import DatastoreError
from datastores.records import extract_text

JSONL_EXTENSIONS = {".jsonl", ".ndjson"}
ARROW_EXTENSIONS = {".parquet": "parquet", ".arrow": "ipc", ".feather": "ipc", ".ipc": "ipc"}
TEXT_EXTENSIONS = {
    # prose
    ".txt", ".text", ".md", ".markdown", ".rst", ".adoc", ".org", ".tex", ".html", ".htm", ".xml", ".csv", ".tsv",
    # code
    ".py", ".pyi", ".pyx", ".c", ".h", ".cc", ".cpp", ".cxx", ".hpp", ".hh", ".cu", ".cuh", ".m", ".mm", ".java",
    ".kt", ".kts", ".scala", ".go", ".rs", ".js", ".mjs", ".cjs", ".jsx", ".ts", ".tsx", ".vue", ".svelte", ".rb",
    ".php", ".pl", ".pm", ".lua", ".r", ".jl", ".swift", ".cs", ".fs", ".hs", ".ml", ".mli", ".ex", ".exs",
    ".erl", ".clj", ".el", ".lisp", ".scm", ".sh", ".bash", ".zsh", ".fish", ".ps1", ".bat", ".sql", ".css",
    ".scss", ".less", ".proto", ".graphql", ".dart", ".zig", ".nim", ".v", ".sv", ".vhd", ".asm", ".s",
    # configuration
    ".json", ".yaml", ".yml", ".toml", ".ini", ".cfg", ".conf", ".mk", ".cmake", ".gradle",
}
TEXT_FILENAMES = {"makefile", "dockerfile", "readme", "license", "changelog", "cmakelists.txt"}
SKIP_DIRS = {"__pycache__", "node_modules"}

READ_BLOCK = 1 << 20


@dataclass
class SourceInfo:
    """One file (or standard input) that was read."""

    path: str
    kind: str  # "jsonl", "text", "parquet", "ipc", "stdin-jsonl", "stdin-text"
    bytes: int = 0
    sha256: str = ""
    documents: int = 0
    skipped_records: int = 0

    def as_dict(self) -> dict:
        return {
            "path": self.path,
            "kind": self.kind,
            "bytes": self.bytes,
            "sha256": self.sha256,
            "documents": self.documents,
            "skipped_records": self.skipped_records,
        }


@dataclass
class CorpusStats:
    """What reading the corpus found: sources read, files skipped, records skipped, all with reasons."""

    sources: list[SourceInfo] = field(default_factory=list)
    skipped_files: list[tuple[str, str]] = field(default_factory=list)  # (path, reason)
    skipped_records: Counter = field(default_factory=Counter)  # reason -> count
    documents: int = 0

    @property
    def n_skipped_records(self) -> int:
        return sum(self.skipped_records.values())

    def summary(self) -> str:
        parts = [f"{len(self.sources)} files read", f"{self.documents:,} documents"]
        if self.skipped_files:
            parts.append(f"{len(self.skipped_files)} files skipped")
        if self.skipped_records:
            parts.append(f"{self.n_skipped_records:,} records skipped")
        return ", ".join(parts)


def classify(path: Path, explicit: bool, extensions: set[str] | None = None) -> str | None:
    """How a file is read ("jsonl", "parquet", "ipc", "text"), or ``None`` when a directory walk skips it."""
    suffix = path.suffix.lower()
    if suffix in JSONL_EXTENSIONS:
        return "jsonl"
    if suffix in ARROW_EXTENSIONS:
        return ARROW_EXTENSIONS[suffix]
    text_ext = TEXT_EXTENSIONS if extensions is None else extensions
    if explicit or suffix in text_ext or (extensions is None and path.name.lower() in TEXT_FILENAMES):
        return "text"
    return None


class Corpus:
    """An iterable of document strings over ``sources``; :attr:`stats` fills in as it is read.

    ``fields``: dotted record paths for JSONL / Arrow rows. ``extensions``: the text extensions a directory
    walk picks up (default :data:`TEXT_EXTENSIONS`). ``stdin_format``: ``auto`` (JSONL when the first non-blank
    line starts with ``{``), ``jsonl`` or ``text``. ``chunk_chars``: text files are cut into documents of about
    this many characters at line boundaries. ``record_text``: a record's text in place of :func:`extract_text`
    (training chat-templates instruction/response records).
    """

    def __init__(
        self,
        sources: Sequence[str | os.PathLike],
        *,
        fields: Sequence[str] | None = None,
        extensions: Iterable[str] | None = None,
        stdin_format: str = "auto",
        chunk_chars: int = 1 << 20,
        stdin: BinaryIO | None = None,
        record_text: Callable[[Any], str | None] | None = None,
    ) -> None:
        if not sources:
            raise DatastoreError("no corpus given")
        self.sources = [str(s) for s in sources]
        self.fields = [f for f in (fields or []) if f]
        self.extensions = None if extensions is None else {e.lower() if e.startswith(".") else "." + e.lower() for e in extensions}
        if stdin_format not in ("auto", "jsonl", "text"):
            raise DatastoreError(f"unknown stdin format {stdin_format!r} (auto, jsonl or text)")
        self.stdin_format = stdin_format
        self.chunk_chars = max(int(chunk_chars), 1024)
        self._stdin = stdin
        self._record_text = record_text or (lambda record: extract_text(record, self.fields))
        self.stats = CorpusStats()
        if self.sources.count("-") > 1:
            raise DatastoreError("standard input (-) can be read only once")
        for s in self.sources:
            if s != "-" and not os.path.exists(s):
                raise DatastoreError(f"corpus path {s} does not exist")

    # -- walking --
    def files(self) -> Iterator[tuple[Path | None, str]]:
        """``(path, kind)`` for every file to read, in a deterministic order (``(None, "stdin")`` for ``-``)."""
        for s in self.sources:
            if s == "-":
                yield None, "stdin"
                continue
            p = Path(s)
            if p.is_dir():
                yield from self._walk(p)
            else:
                yield p, classify(p, explicit=True, extensions=self.extensions) or "text"

    def _walk(self, root: Path) -> Iterator[tuple[Path, str]]:
        def onerror(e: OSError) -> None:
            self.stats.skipped_files.append((str(e.filename), f"unreadable directory ({e.strerror or e})"))

        for dirpath, dirnames, filenames in os.walk(root, onerror=onerror):
            dirnames[:] = sorted(d for d in dirnames if not d.startswith(".") and d not in SKIP_DIRS)
            for name in sorted(filenames):
                if name.startswith("."):
                    continue
                path = Path(dirpath) / name
                kind = classify(path, explicit=False, extensions=self.extensions)
                if kind is not None:
                    yield path, kind

    # -- reading --
    def __iter__(self) -> Iterator[str]:
        for path, kind in self.files():
            if path is None:
                yield from self._read_stdin()
                continue
            info = SourceInfo(str(path.resolve()), kind)
            try:
                if kind == "jsonl":
                    with open(path, "rb") as f:
                        yield from self._read_jsonl(f, info)
                elif kind == "text":
                    with open(path, "rb") as f:
                        yield from self._read_text(f, info)
                else:
                    yield from self._read_arrow(path, kind, info)
            except _SkipFile as e:
                self.stats.skipped_files.append((str(path), str(e)))
                continue
            except OSError as e:
                self.stats.skipped_files.append((str(path), f"unreadable ({e.strerror or e})"))
                continue
            self.stats.sources.append(info)

    def _emit(self, text: str | None, info: SourceInfo, reason: str = "no text") -> Iterator[str]:
        if text is None or not text.strip():
            self._skip_record(info, "empty" if text is not None else reason)
            return
        info.documents += 1
        self.stats.documents += 1
        yield text

    def _skip_record(self, info: SourceInfo, reason: str) -> None:
        info.skipped_records += 1
        self.stats.skipped_records[reason] += 1

    def _missing_reason(self) -> str:
        return f"no field {'/'.join(self.fields)}" if self.fields else "no text"

    def _read_jsonl(self, lines: Iterable[bytes], info: SourceInfo, first: bytes | None = None) -> Iterator[str]:
        h = hashlib.sha256()
        size = 0
        missing = self._missing_reason()

        def all_lines() -> Iterator[bytes]:
            if first is not None:
                yield first
            yield from lines

        for raw in all_lines():
            h.update(raw)
            size += len(raw)
            if not raw.strip():
                continue
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError:
                self._skip_record(info, "invalid UTF-8")
                continue
            try:
                record = json.loads(line)
            except ValueError:
                self._skip_record(info, "invalid JSON")
                continue
            yield from self._emit(self._record_text(record), info, missing)
        info.bytes, info.sha256 = size, h.hexdigest()

    def _read_text(self, f: BinaryIO, info: SourceInfo, first: bytes = b"") -> Iterator[str]:
        """One document per file, cut at line ends into pieces of about ``chunk_chars``. A file whose first
        block is not UTF-8 text (or holds NUL bytes) is skipped whole; a bad byte found later ends the file
        there, keeps the text before it, and is reported."""
        h = hashlib.sha256()
        decoder = codecs.getincrementaldecoder("utf-8")("strict")
        size = 0
        pending = ""
        while True:
            block = first or f.read(READ_BLOCK)
            first = b""
            final = not block
            bad = None
            nul = block.find(b"\0")
            try:
                if nul >= 0:
                    raise UnicodeDecodeError("utf-8", block, nul, nul + 1, "NUL byte")
                pending += decoder.decode(block, final=final)
            except UnicodeDecodeError as e:
                if size == 0:
                    raise _SkipFile("binary file" if e.reason == "NUL byte" else "not UTF-8 text") from None
                bad = size + max(e.start, 0)
                good = block[: max(e.start, 0)]
                try:  # the valid text before the bad byte (with any character begun in the previous block)
                    pending += decoder.decode(good, final=True) if e.reason == "NUL byte" else good.decode("utf-8")
                except UnicodeDecodeError:
                    pending += good.decode("utf-8", "ignore")
                block, final = good, True
            h.update(block)
            size += len(block)
            while len(pending) >= self.chunk_chars or (final and pending):
                cut = len(pending) if final else pending.rfind("\n", 0, self.chunk_chars) + 1
                if cut <= 0:
                    cut = self.chunk_chars
                piece, pending = pending[:cut], pending[cut:]
                yield from self._emit(piece, info)
            if bad is not None:
                self.stats.skipped_files.append((info.path, f"not UTF-8 after byte {bad}; the text before it was kept"))
            if final:
                break
        info.bytes, info.sha256 = size, h.hexdigest()

    def _read_arrow(self, path: Path, fmt: str, info: SourceInfo) -> Iterator[str]:
        import pyarrow as pa
        import pyarrow.dataset as ds

        try:
            dataset = ds.dataset(str(path), format=fmt)
            names = dataset.schema.names
        except (pa.ArrowInvalid, pa.ArrowIOError, OSError) as e:
            raise _SkipFile(f"unreadable {fmt} ({str(e).splitlines()[0]})") from e
        if self.fields:
            top = list(dict.fromkeys(f.split(".")[0] for f in self.fields))
            columns = [c for c in top if c in names]
            if not columns:
                raise _SkipFile(f"no column {', '.join(top)} (columns: {', '.join(names[:12])})")
        else:
            columns = None
            for key in ("messages", "conversations", "conversation", "text"):
                if key in names:
                    columns = [key]
                    break
            if columns is None:
                columns = [
                    n for n in names
                    if pa.types.is_string(dataset.schema.field(n).type) or pa.types.is_large_string(dataset.schema.field(n).type)
                ]
                if not columns:
                    raise _SkipFile("no text column")
        missing = self._missing_reason()
        try:
            for batch in dataset.to_batches(columns=columns, batch_size=4096):
                cols = {c: batch.column(c).to_pylist() for c in columns}
                for i in range(batch.num_rows):
                    record = {c: cols[c][i] for c in columns}
                    yield from self._emit(self._record_text(record), info, missing)
        except (pa.ArrowInvalid, pa.ArrowIOError) as e:
            raise _SkipFile(f"unreadable {fmt} ({str(e).splitlines()[0]})") from e
        info.bytes, info.sha256 = _file_digest(path)

    def _read_stdin(self) -> Iterator[str]:
        stream = self._stdin if self._stdin is not None else sys.stdin.buffer
        fmt = self.stdin_format
        first = b""
        if fmt == "auto":
            while True:
                line = stream.readline()
                first += line
                if not line or line.strip():
                    break
            fmt = "jsonl" if first.lstrip().startswith(b"{") else "text"
        info = SourceInfo("-", f"stdin-{fmt}")
        if fmt == "jsonl":
            yield from self._read_jsonl(stream, info, first=first or None)
        else:
            try:
                yield from self._read_text(stream, info, first=first)
            except _SkipFile as e:
                self.stats.skipped_files.append(("-", str(e)))
                return
        self.stats.sources.append(info)


class _SkipFile(Exception):
    pass


def _file_digest(path: Path) -> tuple[int, str]:
    h = hashlib.sha256()
    size = 0
    with open(path, "rb") as f:
        while block := f.read(READ_BLOCK):
            h.update(block)
            size += len(block)
    return size, h.hexdigest()


def corpus_digest(sources: Sequence[dict]) -> str:
    """One hash of every source's path, size and checksum: the shards of one store must agree on it."""
    h = hashlib.sha256()
    for s in sources:
        h.update(f"{s['path']}\0{s['bytes']}\0{s['sha256']}\n".encode())
    return h.hexdigest()[:32]
