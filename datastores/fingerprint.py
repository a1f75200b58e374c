"""Tokenizer fingerprints: one stable hash of a vocabulary and its special tokens.

A store's token ids only mean something under the tokenizer that produced them. Two tokenizers with the same
vocabulary (token string -> id) and the same special tokens give the same fingerprint, whatever else differs in
their files (formatting, normalizer options that do not change ids), so a store is usable by every model that
shares a tokenizer (e.g. a draft/target pair), and refused by any other.

The value is computed without torch or transformers: from a ``tokenizer.json`` through the ``tokenizers``
library, or from any object with ``get_vocab()`` (a Hugging Face tokenizer), through the same function
:func:`fingerprint_from_vocab`.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any, Iterable, Mapping

FINGERPRINT_VERSION = "v1"


def fingerprint_from_vocab(vocab: Mapping[str, int], specials: Iterable[str]) -> str:
    """Hash of the ``(token, id)`` pairs sorted by id then token, and of the sorted special-token strings."""
    h = hashlib.sha256()
    h.update(f"graft-tokenizer-{FINGERPRINT_VERSION}\0".encode())
    for token, idx in sorted(vocab.items(), key=lambda kv: (int(kv[1]), kv[0])):
        h.update(str(int(idx)).encode())
        h.update(b"\1")
        h.update(token.encode("utf-8", "surrogatepass"))
        h.update(b"\0")
    h.update(b"\2specials\2")
    for s in sorted(set(specials)):
        h.update(s.encode("utf-8", "surrogatepass"))
        h.update(b"\0")
    return f"{FINGERPRINT_VERSION}:{h.hexdigest()[:32]}"


def _rust_specials(tok: Any) -> list[str]:
    return [t.content for t in tok.get_added_tokens_decoder().values() if getattr(t, "special", False)]


def fingerprint_from_rust(tok: Any) -> str:
    """Fingerprint of a ``tokenizers.Tokenizer``."""
    return fingerprint_from_vocab(tok.get_vocab(with_added_tokens=True), _rust_specials(tok))


def fingerprint_from_file(path: str | Path) -> str:
    """Fingerprint of a ``tokenizer.json`` (or of the ``tokenizer.json`` inside a model directory)."""
    from tokenizers import Tokenizer

    path = Path(path)
    if path.is_dir():
        path = path / "tokenizer.json"
    return fingerprint_from_rust(Tokenizer.from_file(str(path)))


def fingerprint_from_tokenizer(tokenizer: Any) -> str:
    """Fingerprint of a tokenizer object: a ``tokenizers.Tokenizer``, or a Hugging Face tokenizer.

    Fast Hugging Face tokenizers carry the same Rust tokenizer that ``tokenizer.json`` describes
    (``backend_tokenizer``), so both routes hash exactly the same vocabulary and special tokens. Slow tokenizers
    fall back to ``get_vocab()`` and the tokens their ``added_tokens_decoder`` marks special.
    """
    if hasattr(tokenizer, "get_added_tokens_decoder") and hasattr(tokenizer, "encode_batch"):
        return fingerprint_from_rust(tokenizer)
    backend = getattr(tokenizer, "backend_tokenizer", None) or getattr(tokenizer, "_tokenizer", None)
    if backend is not None and hasattr(backend, "get_added_tokens_decoder"):
        return fingerprint_from_rust(backend)
    specials: list[str] = []
    decoder = getattr(tokenizer, "added_tokens_decoder", None)
    if isinstance(decoder, Mapping):
        specials = [str(getattr(t, "content", t)) for t in decoder.values() if getattr(t, "special", False)]
    return fingerprint_from_vocab(tokenizer.get_vocab(), specials)


def describe_tokenizer_file(path: str | Path) -> dict:
    """A small summary for manifests: fingerprint, vocabulary size, model type."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(path))
    try:
        model_type = json.loads(tok.to_str()).get("model", {}).get("type")
    except (ValueError, AttributeError):
        model_type = None
    vocab = tok.get_vocab(with_added_tokens=True)
    return {
        "fingerprint": fingerprint_from_rust(tok),
        "vocab_size": max(vocab.values(), default=-1) + 1,
        "model_type": model_type,
    }
