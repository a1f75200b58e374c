"""Shared helpers for the datastore tests (no tests here): a tiny word-level tokenizer model directory and a store
of random documents built over it, no torch."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from datastores import build_store

WORDS = 200  # tokens "w0" .. "w199" have ids 0 .. 199; "[UNK]" is 200


def make_model_dir(path: Path, words: int = WORDS, dim: int = 16, seed: int = 0, prefix: str = "w", embeddings=None) -> Path:
    """A model directory with a WordLevel ``tokenizer.json`` (``w<k>`` -> id k), ``config.json`` and a
    ``model.safetensors`` holding only ``model.embed_tokens.weight``."""
    from safetensors.numpy import save_file
    from tokenizers import Tokenizer, models, pre_tokenizers

    path.mkdir(parents=True, exist_ok=True)
    vocab = {f"{prefix}{i}": i for i in range(words)}
    vocab["[UNK]"] = words
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.add_special_tokens(["[UNK]"])
    tok.save(str(path / "tokenizer.json"))
    (path / "config.json").write_text(json.dumps({"model_type": "llama", "vocab_size": words + 1, "hidden_size": dim}))
    if embeddings is None:
        embeddings = np.random.default_rng(seed).standard_normal((words + 1, dim)).astype(np.float32)
    save_file({"model.embed_tokens.weight": np.ascontiguousarray(embeddings, dtype=np.float32)}, str(path / "model.safetensors"))
    return path


def text_of(ids, prefix: str = "w") -> str:
    return " ".join(f"{prefix}{i}" for i in ids)


def write_jsonl(path: Path, docs) -> Path:
    with open(path, "w") as f:
        for d in docs:
            f.write(json.dumps({"text": text_of(d)}) + "\n")
    return path


def random_docs(rng: np.random.Generator, n_docs: int, alphabet: int, lo: int = 5, hi: int = 60) -> list[list[int]]:
    """Documents over a small alphabet (lots of repeats, so matches are long and counts interesting)."""
    return [rng.integers(0, alphabet, size=int(rng.integers(lo, hi))).tolist() for _ in range(n_docs)]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return make_model_dir(tmp_path_factory.mktemp("model"))


@pytest.fixture(scope="module")
def random_store(tmp_path_factory, model_dir):
    rng = np.random.default_rng(7)
    docs = random_docs(rng, 150, 6)
    tmp = tmp_path_factory.mktemp("rand")
    corpus = write_jsonl(tmp / "c.jsonl", docs)
    build_store([corpus], tmp / "store", model_dir=model_dir)
    return docs, tmp / "store", corpus
