"""FAISS n-gram stores: exact counts, near neighbours for unseen contexts, IVF, shards, embeddings, the plugin."""

from __future__ import annotations

import json
import struct
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("faiss")

from datastores import DatastoreError, build_store, open_store
from datastores.embeddings import load_embeddings
from datastores.ngram_table import hash_context, hash_rows
from tests.datastore_fixtures import make_model_dir, random_docs, write_jsonl


def _embeddings(words: int = 201, dim: int = 16, seed: int = 0) -> np.ndarray:
    e = np.random.default_rng(seed).standard_normal((words, dim)).astype(np.float32)
    e[11] = e[10] + 0.01  # token 11 means almost what token 10 means
    return e


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return make_model_dir(tmp_path_factory.mktemp("model"), embeddings=_embeddings())


def _next_counts(docs, ctx):
    n = len(ctx)
    c = Counter()
    for d in docs:
        for i in range(n, len(d)):
            if d[i - n : i] == ctx:
                c[d[i]] += 1
    return c


@pytest.fixture(scope="module")
def ngram_store(tmp_path_factory, model_dir):
    rng = np.random.default_rng(2)
    docs = random_docs(rng, 200, 8, 5, 40)  # tokens 0..7
    docs += [[5, 10, 7, 9, 3, 4]] * 6 + [[5, 10, 7, 2]] * 2
    tmp = tmp_path_factory.mktemp("ng")
    corpus = write_jsonl(tmp / "c.jsonl", docs)
    m = build_store([corpus], tmp / "s", model_dir=model_dir, kind="ngram", params={"n": 3, "dim": 16, "min_count": 1})
    return docs, tmp / "s", corpus, m


def test_exact_counts(ngram_store):
    docs, path, _, m = ngram_store
    assert m["index"]["faiss"] == "flat" and m["params"]["n"] == 3
    index = open_store(path)
    for ctx in ([1, 2, 3], [0, 0, 0], [5, 10, 7], [7, 7, 1]):
        expected = _next_counts(docs, ctx)
        got = index.lookup([9, 9] + ctx, neighbours=0, depth=1, budget=100)
        counts = {n.token: n.count for n in got.nodes}
        assert counts == dict(Counter(dict(expected.most_common(8))))
        if expected:
            assert got.match_len == 3
            total = sum(expected.values())
            for n in got.nodes:
                assert n.score == pytest.approx(n.count / total)


def test_unseen_context_finds_near_neighbours(ngram_store):
    _, path, _, _ = ngram_store
    index = open_store(path)
    got = index.lookup([5, 11, 7], neighbours=4, min_sim=0.9, depth=2, budget=10)  # never in the corpus
    assert got.match_len == 0
    assert got.neighbours and got.neighbours[0][1] == [5, 10, 7] and got.neighbours[0][0] > 0.99
    paths = {tuple(p): s for p, s, _ in got.paths()}
    assert max(paths, key=paths.get) == (9,)  # 6 of 8 continuations of "5 10 7"
    assert (9, 3) in paths and paths[(9, 3)] <= paths[(9,)]  # deeper levels chain exact n-grams
    assert index.lookup([150, 160, 170], neighbours=4, min_sim=0.9).nodes == []  # nothing near enough
    assert index.lookup([1, 2], neighbours=4).nodes == []  # shorter than n


def test_best_first_and_budget(ngram_store):
    _, path, _, _ = ngram_store
    index = open_store(path)
    got = index.lookup([1, 2, 3], depth=4, budget=12)
    assert len(got.nodes) == 12
    scores = [n.score for n in got.nodes]
    assert scores == sorted(scores, reverse=True)
    for i, n in enumerate(got.nodes):
        assert n.parent < i and (n.parent < 0 or got.nodes[n.parent].score >= n.score)


def test_shards_sum_counts(tmp_path, ngram_store, model_dir):
    docs, path, corpus, _ = ngram_store
    for i in range(2):
        build_store([corpus], tmp_path / "sh", model_dir=model_dir, kind="ngram", shard=(i, 2),
                    params={"n": 3, "dim": 16, "min_count": 1})
    one, two = open_store(path), open_store(tmp_path / "sh")
    for ctx in ([1, 2, 3], [5, 10, 7], [0, 1, 0]):
        a = one.lookup(ctx, neighbours=0, depth=1, budget=100)
        b = two.lookup(ctx, neighbours=0, depth=1, budget=100)
        ca, cb = {n.token: n.count for n in a.nodes}, {n.token: n.count for n in b.nodes}
        # both keep each context's top 8; with the 8-token alphabet nothing is cut
        assert ca == cb


def test_ivf_hnsw_and_filters(tmp_path, model_dir):
    rng = np.random.default_rng(9)
    docs = random_docs(rng, 400, 60, 20, 60)
    corpus = write_jsonl(tmp_path / "c.jsonl", docs)
    m = build_store([corpus], tmp_path / "ivf", model_dir=model_dir, kind="ngram",
                    params={"n": 2, "dim": 8, "min_count": 2, "index": "ivf", "nprobe": 64})
    assert m["index"]["faiss"] == "ivf" and m["index"]["nlist"] >= 16
    counts = Counter()
    for d in docs:
        for i in range(2, len(d)):
            counts[tuple(d[i - 2 : i])] += 1
    assert m["index"]["contexts"] == sum(1 for c in counts.values() if c >= 2)
    index = open_store(tmp_path / "ivf")
    ctx = list(max(counts, key=counts.get))
    got = index.lookup(ctx, neighbours=4)
    assert got.match_len == 2 and got.neighbours[0][0] > 0.95
    m = build_store([corpus], tmp_path / "hnsw", model_dir=model_dir, kind="ngram",
                    params={"n": 2, "dim": 8, "index": "hnsw", "max_contexts": 100})
    assert m["index"]["faiss"] == "hnsw" and m["index"]["contexts"] == 100
    assert open_store(tmp_path / "hnsw").lookup(ctx, neighbours=2).match_len == 2  # the most frequent is kept
    with pytest.raises(DatastoreError, match="unknown n-gram store parameter"):
        build_store([corpus], tmp_path / "x", model_dir=model_dir, kind="ngram", params={"m": 3})
    with pytest.raises(DatastoreError, match="take no build parameters"):
        build_store([corpus], tmp_path / "x", model_dir=model_dir, kind="suffix-array", params={"n": 3})
    with pytest.raises(DatastoreError, match="min_count"):
        build_store([write_jsonl(tmp_path / "u.jsonl", [[1, 2, 3, 4]])], tmp_path / "x", model_dir=model_dir,
                    kind="ngram", params={"n": 2, "min_count": 5})
    assert not (tmp_path / "x").exists()


def test_hashes_agree():
    rows = np.array([[1, 2, 3], [70000, 0, 5], [0, 0, 0]], dtype=np.uint32)
    assert hash_rows(rows).tolist() == [hash_context(r) for r in rows.tolist()]


def _write_safetensors(path: Path, name: str, dtype: str, shape, data: bytes) -> None:
    header = json.dumps({name: {"dtype": dtype, "shape": list(shape), "data_offsets": [0, len(data)]}}).encode()
    path.write_bytes(struct.pack("<Q", len(header)) + header + data)


def test_embeddings_bf16_f16_and_sharded_checkpoints(tmp_path):
    e = np.random.default_rng(0).standard_normal((7, 4)).astype(np.float32)
    bf16 = (e.view(np.uint32) >> 16).astype(np.uint16)
    d = tmp_path / "bf16"
    d.mkdir()
    _write_safetensors(d / "model.safetensors", "model.embed_tokens.weight", "BF16", e.shape, bf16.tobytes())
    got = load_embeddings(d)
    assert got.dtype == np.float32 and np.allclose(got, e, rtol=1e-2, atol=1e-2)
    d = tmp_path / "sharded"
    d.mkdir()
    _write_safetensors(d / "model-00002-of-00002.safetensors", "transformer.wte.weight", "F16", e.shape,
                       e.astype(np.float16).tobytes())
    (d / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {"transformer.wte.weight": "model-00002-of-00002.safetensors", "lm_head.weight": "x"}})
    )
    assert np.allclose(load_embeddings(d), e, atol=1e-2)
    d = tmp_path / "none"
    d.mkdir()
    _write_safetensors(d / "model.safetensors", "lm_head.weight", "F32", e.shape, e.tobytes())
    with pytest.raises(DatastoreError, match="no input-embedding tensor"):
        load_embeddings(d)


def test_ngram_retriever_plugin(ngram_store, tmp_path):
    from graft_cli.core import GraftError
    from graft_cli.core import RetrieverEnv
    from plugins.ngram_retriever import make
    from plugins.suffix_array_retriever import make as make_sa
    from tokenizers import Tokenizer

    _, path, _, _ = ngram_store
    tok = Tokenizer.from_file(str(path / "tokenizer.json"))
    r = make(RetrieverEnv(vocab_size=201, tokenizer=tok, options={"datastore": str(path), "ngram.min_sim": "0.9"},
                          name="ngram"))
    tree = r.retrieve([1, 5, 11, 7], budget=6)
    assert 0 < len(tree) <= 6 and tree.nodes[0].token == 9 and tree.nodes[0].source == "ngram"
    with pytest.raises(GraftError, match="is a ngram store; the suffix-array retriever reads suffix-array stores"):
        make_sa(RetrieverEnv(vocab_size=201, tokenizer=tok, options={"datastore": str(path)}))


def test_top_eigenvectors_match_exact_pca():
    from datastores.ngram_vectors import top_eigenvectors

    rng = np.random.default_rng(4)
    x = rng.standard_normal((2000, 40)) * np.linspace(3, 0.1, 40)  # a decaying spectrum
    cov = x.T @ x
    v = top_eigenvectors(cov, 8).astype(np.float64)
    w, exact = np.linalg.eigh(cov)
    top = exact[:, ::-1][:, :8]
    assert np.allclose(v.T @ v, np.eye(8), atol=1e-5)
    assert np.trace(v.T @ cov @ v) / w[::-1][:8].sum() > 0.999
    assert np.allclose(np.abs(np.sum(v * top, axis=0)), 1, atol=1e-3)  # the same directions, up to sign
