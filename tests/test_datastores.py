"""Suffix-array datastores: construction against brute force, lookups, shards, manifests, integrity, atomicity."""

from __future__ import annotations

import errno
import json
import os
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

from datastores import DatastoreError, build_store, open_store, read_store
from datastores.fingerprint import fingerprint_from_file, fingerprint_from_tokenizer, fingerprint_from_vocab
from datastores.suffix_array import PAD, build_suffix_array, continuation_trie
from datastores.tokenize import SEP, SEP_INT
from tests.datastore_fixtures import make_model_dir, random_docs, write_jsonl

@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return make_model_dir(tmp_path_factory.mktemp("model"))


def _text(docs: list[list[int]]) -> np.ndarray:
    out = [SEP_INT]
    for d in docs:
        out += d + [SEP_INT]
    return np.array(out, dtype=np.uint32)


# --- suffix array construction ----------------------------------------------------------------------------------


@pytest.mark.parametrize("alphabet,vocab", [(3, 3), (6, 300), (50, 70_000)])  # 1-, 2- and 3-byte packings
def test_suffix_array_equals_brute_force(alphabet, vocab):
    rng = np.random.default_rng(alphabet)
    for trial in range(4):
        docs = random_docs(rng, 12, alphabet, 1, 30)
        if vocab == 70_000:  # use ids above 65,535 too
            docs = [[t * 1399 for t in d] for d in docs]
        text = _text(docs)
        sa, first = build_suffix_array(text, vocab)
        n = text.size
        big = 1 << 40  # SEP sorts above every token

        def key(p):  # the string that ends at text[p-1], read backwards to the start of the text
            return tuple(big if t == SEP_INT else int(t) for t in text[p - 1 :: -1])

        expected = [p for p in range(1, n) if text[p - 1] != SEP and text[p] != SEP]
        expected.sort(key=key)
        assert sa.tolist() == expected
        last = text[sa.astype(np.int64) - 1]
        for t in set(last.tolist()) | {0, vocab - 1}:
            lo, hi = int(first[t]), int(first[t + 1])
            assert (last[lo:hi] == t).all() and (last[:lo] < t).all() and (last[hi:] > t).all()
        assert int(first[-1]) == sa.size


def test_suffix_array_rejects_bad_text():
    with pytest.raises(ValueError):
        build_suffix_array(np.array([1, 2, SEP_INT], dtype=np.uint32), 5)
    with pytest.raises(DatastoreError, match="outside the vocabulary"):
        build_suffix_array(np.array([SEP_INT, 9, SEP_INT], dtype=np.uint32), 5)


# --- lookups against a brute-force reference ---------------------------------------------------------------------


def _reference(docs, context, max_match, min_match, depth):
    """(match length, Counter of continuation prefixes) by scanning every document."""
    for k in range(min(max_match, len(context)), min_match - 1, -1):
        suffix = context[-k:]
        conts = []
        for d in docs:
            for p in range(k, len(d)):  # the continuation starts at d[p]: one token at least
                if d[p - k : p] == suffix:
                    conts.append(tuple(d[p : p + depth]))
        if conts:
            prefixes = Counter()
            for c in conts:
                for j in range(1, len(c) + 1):
                    prefixes[c[:j]] += 1
            return k, len(conts), prefixes
    return 0, 0, Counter()


def _got(lookup):
    return {tuple(p): c for p, _, c in lookup.paths()}


@pytest.fixture(scope="module")
def random_store(tmp_path_factory, model_dir):
    rng = np.random.default_rng(7)
    docs = random_docs(rng, 150, 6)
    tmp = tmp_path_factory.mktemp("rand")
    corpus = write_jsonl(tmp / "c.jsonl", docs)
    build_store([corpus], tmp / "store", model_dir=model_dir)
    return docs, tmp / "store", corpus


def test_lookup_finds_longest_suffix_with_exact_counts(random_store):
    docs, path, _ = random_store
    index = open_store(path)
    rng = np.random.default_rng(3)
    for trial in range(60):
        if trial % 3 == 0:
            context = rng.integers(0, 6, size=20).tolist()
        else:  # a context taken from the corpus, so long matches happen
            d = docs[int(rng.integers(len(docs)))]
            cut = int(rng.integers(1, len(d) + 1))
            context = d[:cut]
        k, occ, prefixes = _reference(docs, context, 16, 2, 4)
        got = index.lookup(context, max_match=16, min_match=2, depth=4, max_occurrences=10**9, budget=10**6, prior=0)
        assert got.match_len == k
        assert got.occurrences == occ and got.counted == occ
        assert _got(got) == dict(prefixes)
        for p, score, count in got.paths():
            assert score == pytest.approx(count / occ)
    index.close()


def test_lookup_budget_is_best_first_and_prefix_closed(random_store):
    docs, path, _ = random_store
    index = open_store(path)
    context = docs[0][:6]
    full = index.lookup(context, depth=6, max_occurrences=10**9, budget=10**6)
    for budget in (1, 3, 10, 25):
        got = index.lookup(context, depth=6, max_occurrences=10**9, budget=budget)
        assert len(got.nodes) == min(budget, len(full.nodes))
        scores = [n.score for n in got.nodes]
        assert scores == sorted(scores, reverse=True)
        for i, n in enumerate(got.nodes):  # a parent is present and comes first, and scores never grow
            assert n.parent < i
            if n.parent >= 0:
                assert got.nodes[n.parent].score >= n.score and got.nodes[n.parent].depth == n.depth - 1
        # the kept nodes are the best ones of the full trie
        assert min(scores) >= sorted((n.score for n in full.nodes), reverse=True)[len(got.nodes) - 1] - 1e-12


def test_sampling_caps_counted_occurrences(random_store):
    docs, path, _ = random_store
    index = open_store(path)
    got = index.lookup([docs[0][0], docs[0][1]], min_match=1, max_match=1, max_occurrences=7, budget=50)
    assert got.occurrences > 7 and got.counted == 7
    assert sum(n.count for n in got.nodes if n.depth == 1) <= 7


def test_continuation_trie_stops_at_separators():
    rows = np.array([[5, 6, SEP_INT], [5, SEP_INT, 9], [5, 6, 7]], dtype=np.uint32)
    nodes = continuation_trie(rows, budget=10, prior=0)
    got = {}
    prefix = []
    for n in nodes:
        p = (prefix[n.parent] if n.parent >= 0 else ()) + (n.token,)
        prefix.append(p)
        got[p] = n.count
    assert got == {(5,): 3, (5, 6): 2, (5, 6, 7): 1}  # the 9 after a separator belongs to another document


def test_documents_are_never_crossed(tmp_path, model_dir):
    corpus = write_jsonl(tmp_path / "c.jsonl", [[1, 2, 3], [4, 5, 6], [3, 4, 9]])
    build_store([corpus], tmp_path / "s", model_dir=model_dir)
    index = open_store(tmp_path / "s")
    got = index.lookup([1, 2, 3], min_match=1, budget=50)  # "3" ends document 1: only document 3's "3 4 9"
    assert got.match_len == 1 and _got(got) == {(4,): 1, (4, 9): 1}
    got = index.lookup([2, 3, 4], min_match=2, budget=50)  # "3 4" occurs only in document 3
    assert got.match_len == 2 and _got(got) == {(9,): 1}
    got = index.lookup([5, 6], min_match=1, budget=50)  # "6" ends its document: nothing follows it
    assert got.match_len == 0 and got.nodes == []
    got = index.lookup([6, 4], min_match=2, budget=50)  # "6 4" would cross documents 2 and 3 (in order 1,2,3)
    assert got.match_len == 0


def test_shards_queried_together_equal_one_store(tmp_path, random_store, model_dir):
    docs, path, corpus = random_store
    sharded = tmp_path / "sharded"
    for i in (2, 0, 1):  # any order, as independent jobs would
        m = build_store([corpus], sharded, model_dir=model_dir, shard=(i, 3))
        assert m["shard"] == {"index": i, "count": 3, "split": "document number modulo count"}
    meta = read_store(sharded)
    assert meta.complete and meta.tokens == read_store(path).tokens
    one, many = open_store(path), open_store(sharded)
    rng = np.random.default_rng(11)
    for _ in range(40):
        d = docs[int(rng.integers(len(docs)))]
        context = d[: int(rng.integers(1, len(d) + 1))]
        a = one.lookup(context, max_occurrences=10**9, budget=10**6, depth=5)
        b = many.lookup(context, max_occurrences=10**9, budget=10**6, depth=5)
        assert (a.match_len, a.occurrences) == (b.match_len, b.occurrences)
        assert _got(a) == _got(b)


def test_incomplete_and_mixed_shards_are_refused(tmp_path, random_store, model_dir):
    _, _, corpus = random_store
    store = tmp_path / "s"
    build_store([corpus], store, model_dir=model_dir, shard=(0, 2))
    with pytest.raises(DatastoreError, match=r"incomplete: 1 of 2 shards built \(missing 1\)"):
        open_store(store)
    with pytest.raises(DatastoreError, match="3-way|2-way"):
        build_store([corpus], store, model_dir=model_dir, shard=(1, 3))
    with pytest.raises(DatastoreError, match="already exists"):
        build_store([corpus], store, model_dir=model_dir, shard=(0, 2))
    other = write_jsonl(tmp_path / "other.jsonl", [[1, 2, 3, 4]] * 5)
    build_store([other], store, model_dir=model_dir, shard=(1, 2))
    with pytest.raises(DatastoreError, match="different corpora"):
        open_store(store)


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


# --- the retriever plugin ---------------------------------------------------------------------------------------


def test_suffix_array_retriever_plugin(random_store, tmp_path):
    from importlib.metadata import entry_points

    from graft_cli.errors import GraftError
    from plugins.base import RetrieverEnv
    from plugins.suffix_array import make
    from tokenizers import Tokenizer

    docs, path, _ = random_store
    eps = {e.name: e.value for e in entry_points(group="graft.retrievers")}
    assert eps.get("suffix-array") == "plugins.suffix_array:make"
    tok = Tokenizer.from_file(str(path / "tokenizer.json"))
    env = RetrieverEnv(vocab_size=201, tokenizer=tok, options={"datastore": str(path), "suffix-array.depth": "3"})
    r = make(env)
    assert r.name == "suffix-array" and r.params["depth"] == 3
    r.start(docs[0])
    tree = r.retrieve(docs[0][:8], budget=12)
    assert 0 < len(tree) <= 12
    assert all(n.source == "suffix-array" and n.depth <= 3 for n in tree.nodes)
    for n in tree.nodes:
        if n.parent >= 0:
            assert tree.nodes[n.parent].score >= n.score
    assert len(r.retrieve(docs[0][:8], budget=0)) == 0

    other = make_model_dir(tmp_path / "other", prefix="v")
    with pytest.raises(GraftError, match="built with another tokenizer"):
        make(RetrieverEnv(vocab_size=201, tokenizer=Tokenizer.from_file(str(other / "tokenizer.json")),
                          options={"datastore": str(path)}))
    with pytest.raises(GraftError, match="needs a datastore"):
        make(RetrieverEnv(vocab_size=201))
    with pytest.raises(GraftError, match="must be a int"):
        make(RetrieverEnv(vocab_size=201, options={"datastore": str(path), "depth": "deep"}))
    with pytest.raises(GraftError, match="no datastore"):
        make(RetrieverEnv(vocab_size=201, options={"datastore": str(tmp_path / "nope")}))


def test_datastores_never_import_torch_or_transformers(tmp_path, model_dir):
    """Building, opening and querying both kinds of store loads neither torch nor transformers."""
    import subprocess
    import sys

    corpus = write_jsonl(tmp_path / "c.jsonl", [[1, 2, 3, 4, 5]] * 4)
    code = f"""
import sys
from datastores import build_store, open_store
from datastores.build import build_store as b
import datastores.corpus, datastores.tokenize, datastores.ngram_faiss, datastores.embeddings, datastores.store
build_store([{str(corpus)!r}], {str(tmp_path / 'sa')!r}, model_dir={str(model_dir)!r})
build_store([{str(corpus)!r}], {str(tmp_path / 'ng')!r}, model_dir={str(model_dir)!r}, kind="ngram", params={{"n": 2, "min_count": 1, "dim": 4}})
assert open_store({str(tmp_path / 'sa')!r}).lookup([1, 2]).nodes
assert open_store({str(tmp_path / 'ng')!r}).lookup([1, 2]).nodes
bad = sorted(m for m in sys.modules if m.split(".")[0] in ("torch", "transformers"))
print(bad)
assert not bad, bad
"""
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=Path(__file__).parents[1])
    assert proc.returncode == 0, proc.stderr + proc.stdout
