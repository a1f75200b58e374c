"""The response cache's file: every response a process kept, as token ids, for the next process to start warm.

One ``.npz`` read with ``allow_pickle=False``: ``tokens`` (uint32, the responses joined), ``offsets`` (int64,
``responses + 1``) and ``meta`` (UTF-8 JSON as bytes: the format, its version, the tokenizer fingerprint and the
vocabulary size). Token ids mean something only under the tokenizer that produced them, so a file written under
another one is refused, as a datastore is. Written atomically (a reader sees the old file or the new one), and a
file that is not one of these is one line of error, never a traceback. Torch-free, like the rest of datastores/.
"""

from __future__ import annotations

import json
import os
import zipfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from datastores.atomic import atomic_file
from datastores.errors import DatastoreError

FORMAT, VERSION = "graft-responses", 1


@dataclass
class ResponseFile:
    """A response cache as read from disk."""

    tokens: np.ndarray  # uint32: every response's tokens, oldest response first
    offsets: np.ndarray  # int64: response i is tokens[offsets[i]:offsets[i + 1]]
    fingerprint: str | None  # the tokenizer's (datastores.fingerprint); None when written without one
    vocab_size: int

    @property
    def responses(self) -> int:
        return int(self.offsets.size - 1)

    def sequences(self) -> list[np.ndarray]:
        return np.split(self.tokens, self.offsets[1:-1]) if self.responses else []

    def check(self, path: Path, fingerprint: str | None, vocab_size: int) -> None:
        """Refuse a file written for another tokenizer or vocabulary (its ids would name other tokens)."""
        if fingerprint and self.fingerprint and fingerprint != self.fingerprint:
            raise DatastoreError(f"response cache {path} was written under another tokenizer ({self.fingerprint}, "
                                 f"this model's is {fingerprint}): `graft responses clear {path}` empties it")
        if vocab_size != self.vocab_size:
            raise DatastoreError(f"response cache {path} is for a vocabulary of {self.vocab_size}, not {vocab_size}: "
                                 f"`graft responses clear {path}` empties it")


def write_responses(path: Path, tokens: np.ndarray, offsets: np.ndarray, fingerprint: str | None,
                    vocab_size: int) -> None:
    """Write the cache to a temporary file beside ``path``, flushed to the disk, then rename it over."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    meta = {"format": FORMAT, "version": VERSION, "fingerprint": fingerprint, "vocab_size": int(vocab_size)}
    with atomic_file(path) as tmp, open(tmp, "wb") as f:
        np.savez(f, tokens=np.asarray(tokens, dtype=np.uint32), offsets=np.asarray(offsets, dtype=np.int64),
                 meta=np.frombuffer(json.dumps(meta).encode(), dtype=np.uint8))
        f.flush()
        os.fsync(f.fileno())


def read_responses(path: Path) -> ResponseFile:
    """The cache at ``path``; a DatastoreError (one line) when it is missing, unreadable or inconsistent."""
    path = Path(path)
    if not path.is_file():
        raise DatastoreError(f"no response cache at {path}")
    try:
        with np.load(path, allow_pickle=False) as data:
            meta = json.loads(bytes(data["meta"]).decode())
            tokens, offsets = data["tokens"], data["offsets"]
    except (OSError, ValueError, KeyError, zipfile.BadZipFile, UnicodeDecodeError, EOFError) as e:
        reason = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise DatastoreError(f"{path} is not a readable response cache ({reason})") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise DatastoreError(f"{path} is not a graft response cache")
    if meta.get("version") != VERSION:
        raise DatastoreError(f"response cache {path} has format version {meta.get('version')}; this graft reads "
                             f"{VERSION}: `graft responses clear {path}` empties it")
    vocab_size, fingerprint = meta.get("vocab_size"), meta.get("fingerprint")
    if not isinstance(vocab_size, int) or not isinstance(fingerprint, (str, type(None))):
        raise DatastoreError(f"response cache {path} is inconsistent (its vocabulary or tokenizer is unreadable)")
    file = ResponseFile(tokens, offsets, fingerprint, vocab_size)
    _check_shape(path, file)
    return file


def _check_shape(path: Path, file: ResponseFile) -> None:
    """Offsets that cut the tokens into responses, and ids inside the vocabulary."""
    tokens, offsets = file.tokens, file.offsets
    if (tokens.dtype != np.uint32 or tokens.ndim != 1 or offsets.dtype != np.int64 or offsets.ndim != 1
            or not offsets.size or offsets[0] != 0 or offsets[-1] != tokens.size or np.any(np.diff(offsets) < 0)):
        raise DatastoreError(f"response cache {path} is inconsistent (its offsets do not cut its tokens)")
    if tokens.size and int(tokens.max()) >= file.vocab_size:
        raise DatastoreError(f"response cache {path} holds token id {int(tokens.max())}, outside its vocabulary "
                             f"({file.vocab_size})")


def remove_responses(path: Path, force: bool = False) -> ResponseFile | None:
    """Delete the cache at ``path`` (what it held, or None when ``force`` removed a file that was not one). Only
    a response cache is removed unless ``force``: a typo must not delete another file."""
    path = Path(path)
    try:
        file = read_responses(path)
    except DatastoreError:
        if not (force and path.is_file()):
            raise
        file = None
    path.unlink()
    return file
