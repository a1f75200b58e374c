"""Suffix-array datastores: construction against brute force, lookups, shards, the retriever plugin, no torch
(manifests, fingerprints, integrity and atomic builds: test_datastores_integrity.py)."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import numpy as np
import pytest

from datastores import DatastoreError, build_store, open_store, read_store
from datastores.suffix_array import build_suffix_array, continuation_trie
from datastores.tokenize import SEP, SEP_INT
from tests.datastore_fixtures import make_model_dir, model_dir, random_docs, random_store, write_jsonl  # noqa: F401


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


# --- the retriever plugin ---------------------------------------------------------------------------------------


def test_suffix_array_retriever_plugin(random_store, tmp_path):
    from importlib.metadata import entry_points

    from graft_cli.core import GraftError
    from graft_cli.core import RetrieverEnv
    from plugins.suffix_array_retriever import make
    from tokenizers import Tokenizer

    docs, path, _ = random_store
    eps = {e.name: e.value for e in entry_points(group="graft.retrievers")}
    assert eps.get("suffix-array") == "plugins.suffix_array_retriever:make"
    tok = Tokenizer.from_file(str(path / "tokenizer.json"))
    env = RetrieverEnv(vocab_size=201, tokenizer=tok, options={"datastore": str(path), "suffix-array.depth": "3"},
                       name="suffix-array")
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
