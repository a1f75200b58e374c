"""Datastores kept safe: manifests and tokenizer fingerprints, truncated or corrupt files detected, builds that
fail or are interrupted leave nothing (or the old store) behind, parallel tokenisation equals serial."""

from __future__ import annotations

import errno
import json
import os
from pathlib import Path

import numpy as np
import pytest

from datastores import DatastoreError, build_store, open_store, read_store
from datastores.fingerprint import fingerprint_from_file, fingerprint_from_tokenizer, fingerprint_from_vocab
from datastores.suffix_array import PAD
from tests.datastore_fixtures import make_model_dir, model_dir, random_docs, random_store, write_jsonl  # noqa: F401


# --- manifests, fingerprints, integrity -------------------------------------------------------------------------


def test_manifest_records_corpus_and_files(random_store):
    docs, path, corpus = random_store
    meta = read_store(path)
    m = meta.first
    assert m["format"] == "graft-datastore" and m["format_version"] == 1 and m["kind"] == "suffix-array"
    assert m["corpus"]["documents"] == len(docs)
    assert m["corpus"]["tokens"] == sum(map(len, docs))
    src = m["corpus"]["sources"][0]
    assert src["path"] == str(corpus.resolve()) and src["bytes"] == corpus.stat().st_size
    import hashlib

    assert src["sha256"] == hashlib.sha256(corpus.read_bytes()).hexdigest()
    assert set(m["files"]) == {"tokens.u32", "sa.u32", "first.u32"}
    tokens = np.fromfile(meta.shards[0][0] / "tokens.u32", dtype=np.uint32)
    assert tokens.size == m["index"]["text_tokens"] + PAD  # uint32 on disk, padded with separators
    assert m["tokenizer"]["vocab_size"] == 201
    assert meta.data_bytes / meta.tokens <= 10


def test_fingerprints(tmp_path, model_dir):
    from tokenizers import Tokenizer

    fp = fingerprint_from_file(model_dir / "tokenizer.json")
    assert fp == fingerprint_from_file(model_dir)
    assert fp == fingerprint_from_tokenizer(Tokenizer.from_file(str(model_dir / "tokenizer.json")))
    vocab = Tokenizer.from_file(str(model_dir / "tokenizer.json")).get_vocab(with_added_tokens=True)
    assert fp == fingerprint_from_vocab(dict(reversed(list(vocab.items()))), ["[UNK]"])  # order-independent
    assert fp != fingerprint_from_vocab(vocab, [])  # special tokens count
    other = make_model_dir(tmp_path / "other", prefix="v")
    assert fingerprint_from_file(other) != fp


class _SlowTokenizer:
    """Duck-typed like a slow Hugging Face tokenizer (no backend): the vocabulary route."""

    def __init__(self, path):
        from tokenizers import Tokenizer

        t = Tokenizer.from_file(str(path))
        self.vocab = t.get_vocab(with_added_tokens=True)
        self.added_tokens_decoder = {i: tok for i, tok in t.get_added_tokens_decoder().items()}

    def get_vocab(self):
        return dict(self.vocab)


def test_fingerprint_from_hf_style_objects(model_dir):
    assert fingerprint_from_tokenizer(_SlowTokenizer(model_dir / "tokenizer.json")) == fingerprint_from_file(model_dir)


@pytest.mark.real_model
def test_fingerprint_of_real_hf_tokenizer_matches_its_file():
    import transformers

    from graft_cli.catalog.resolve import resolve_model

    smollm2 = resolve_model("smollm2-135m-instruct")  # the catalog model, pulled on first use
    hf = transformers.AutoTokenizer.from_pretrained(str(smollm2))
    assert fingerprint_from_tokenizer(hf) == fingerprint_from_file(smollm2)
    vocab = hf.get_vocab()
    specials = [t.content for t in hf.added_tokens_decoder.values() if t.special]
    assert fingerprint_from_vocab(vocab, specials) == fingerprint_from_file(smollm2)


def test_other_tokenizer_is_refused(tmp_path, random_store):
    _, path, _ = random_store
    other = make_model_dir(tmp_path / "other", prefix="v")
    with pytest.raises(DatastoreError, match="built with another tokenizer"):
        open_store(path, fingerprint=fingerprint_from_file(other))
    open_store(path, fingerprint=fingerprint_from_file(read_store(path).path / "tokenizer.json"))


def _copy_store(src: Path, dst: Path) -> Path:
    import shutil

    shutil.copytree(src, dst)
    return dst


def test_truncated_and_corrupt_files_are_detected(tmp_path, random_store):
    _, path, _ = random_store
    s = _copy_store(path, tmp_path / "trunc")
    sa = s / "shard-00000-of-00001" / "sa.u32"
    data = sa.read_bytes()
    sa.write_bytes(data[:-8])
    with pytest.raises(DatastoreError, match="truncated or damaged: sa.u32"):
        open_store(s)

    s = _copy_store(path, tmp_path / "flip")
    tok = s / "shard-00000-of-00001" / "tokens.u32"
    raw = bytearray(tok.read_bytes())
    raw[4] ^= 0xFF  # inside the first sampled block
    tok.write_bytes(bytes(raw))
    with pytest.raises(DatastoreError, match="corrupt: tokens.u32"):
        open_store(s)

    s = tmp_path / "deep"
    big = write_jsonl(tmp_path / "big.jsonl", random_docs(np.random.default_rng(1), 60, 100, 400, 500))
    build_store([big], s, model_dir=Path(read_store(path).first["model"]["path"]))
    tok = s / "shard-00000-of-00001" / "tokens.u32"
    raw = bytearray(tok.read_bytes())
    assert len(raw) > 24 * 4096  # big enough to have unsampled bytes
    raw[4096 + 100] ^= 0xFF  # outside every sampled block: the full hash, paid because the file changed, finds it
    before = tok.stat()
    tok.write_bytes(bytes(raw))
    with pytest.raises(DatastoreError, match="corrupt: tokens.u32 fails its SHA-256"):
        open_store(s)
    os.utime(tok, ns=(before.st_atime_ns, before.st_mtime_ns))  # damage that keeps the stamp: only --verify sees it
    open_store(s)
    with pytest.raises(DatastoreError, match="SHA-256"):
        open_store(s, verify=True)

    s = _copy_store(path, tmp_path / "nomanifest")
    (s / "shard-00000-of-00001" / "manifest.json").unlink()
    with pytest.raises(DatastoreError, match="no manifest"):
        open_store(s)

    s = _copy_store(path, tmp_path / "badjson")
    (s / "shard-00000-of-00001" / "manifest.json").write_text("{not json")
    with pytest.raises(DatastoreError, match="unreadable manifest"):
        open_store(s)

    s = _copy_store(path, tmp_path / "future")
    mf = s / "shard-00000-of-00001" / "manifest.json"
    m = json.loads(mf.read_text())
    m["format_version"] = 99
    mf.write_text(json.dumps(m))
    with pytest.raises(DatastoreError, match="format version 99"):
        open_store(s)

    with pytest.raises(DatastoreError, match="not a datastore"):
        open_store(tmp_path)


# --- atomic builds ----------------------------------------------------------------------------------------------


def _leftovers(parent: Path) -> list[str]:
    return sorted(p.name for p in parent.iterdir())


def test_failed_build_leaves_nothing(tmp_path, model_dir, monkeypatch):
    import datastores.suffix_array as sa_mod

    corpus = write_jsonl(tmp_path / "c.jsonl", [[1, 2, 3, 4, 5]] * 20)
    out = tmp_path / "stores"
    out.mkdir()

    def boom(*a, **k):
        raise RuntimeError("simulated crash in the middle of the sort")

    monkeypatch.setattr(sa_mod, "build_suffix_array", boom)
    with pytest.raises(RuntimeError, match="simulated"):
        build_store([corpus], out / "s", model_dir=model_dir)
    assert _leftovers(out) == []

    def interrupt(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(sa_mod, "build_suffix_array", interrupt)
    with pytest.raises(KeyboardInterrupt):
        build_store([corpus], out / "s", model_dir=model_dir, shard=(1, 2))
    assert _leftovers(out) == []  # the store directory the shard build created is gone too

    def disk_full(*a, **k):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(sa_mod, "build_suffix_array", disk_full)
    with pytest.raises(DatastoreError, match="disk full"):
        build_store([corpus], out / "s", model_dir=model_dir)
    assert _leftovers(out) == []


def test_failed_rebuild_keeps_the_old_store(tmp_path, model_dir, monkeypatch):
    import datastores.suffix_array as sa_mod

    corpus = write_jsonl(tmp_path / "c.jsonl", [[1, 2, 3, 4, 5]] * 20)
    build_store([corpus], tmp_path / "s", model_dir=model_dir)
    before = read_store(tmp_path / "s").first["created"]
    monkeypatch.setattr(sa_mod, "build_suffix_array", lambda *a, **k: (_ for _ in ()).throw(RuntimeError("x")))
    with pytest.raises(RuntimeError):
        build_store([corpus], tmp_path / "s", model_dir=model_dir, force=True)
    assert read_store(tmp_path / "s").first["created"] == before
    open_store(tmp_path / "s")
    assert _leftovers(tmp_path) == ["c.jsonl", "s"]


def test_stale_temporary_directories_are_cleaned(tmp_path, model_dir):
    corpus = write_jsonl(tmp_path / "c.jsonl", [[1, 2, 3]] * 3)
    stale = tmp_path / ".s.tmp-999999999-abcd"  # a build killed with SIGKILL (that pid does not exist)
    (stale / "shard-00000-of-00001").mkdir(parents=True)
    build_store([corpus], tmp_path / "s", model_dir=model_dir)
    assert not stale.exists()


def test_existing_store_needs_force_and_non_stores_are_never_replaced(tmp_path, model_dir):
    corpus = write_jsonl(tmp_path / "c.jsonl", [[1, 2, 3]] * 3)
    build_store([corpus], tmp_path / "s", model_dir=model_dir)
    with pytest.raises(DatastoreError, match="already exists"):
        build_store([corpus], tmp_path / "s", model_dir=model_dir)
    build_store([corpus], tmp_path / "s", model_dir=model_dir, force=True)
    (tmp_path / "precious").mkdir()
    (tmp_path / "precious" / "thesis.tex").write_text("x")
    with pytest.raises(DatastoreError, match="not a datastore"):
        build_store([corpus], tmp_path / "precious", model_dir=model_dir, force=True)
    assert (tmp_path / "precious" / "thesis.tex").exists()


def test_empty_corpus_is_an_error(tmp_path, model_dir):
    (tmp_path / "empty.jsonl").write_text("\n\n")
    with pytest.raises(DatastoreError, match="has no text"):
        build_store([tmp_path / "empty.jsonl"], tmp_path / "s", model_dir=model_dir)
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "blob.bin").write_bytes(b"\0\1\2")
    with pytest.raises(DatastoreError, match="has no text"):
        build_store([tmp_path / "d"], tmp_path / "s", model_dir=model_dir)
    assert not (tmp_path / "s").exists()
    with pytest.raises(DatastoreError, match="does not exist"):
        build_store([tmp_path / "missing"], tmp_path / "s", model_dir=model_dir)


def test_parallel_tokenisation_equals_serial(tmp_path, model_dir):
    rng = np.random.default_rng(5)
    corpus = write_jsonl(tmp_path / "c.jsonl", random_docs(rng, 300, 150))
    build_store([corpus], tmp_path / "one", model_dir=model_dir, jobs=1)
    build_store([corpus], tmp_path / "two", model_dir=model_dir, jobs=2, batch_chars=2000)
    for name in ("tokens.u32", "sa.u32", "first.u32"):
        a = (tmp_path / "one" / "shard-00000-of-00001" / name).read_bytes()
        b = (tmp_path / "two" / "shard-00000-of-00001" / name).read_bytes()
        assert a == b, name
