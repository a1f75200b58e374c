"""`graft index build | info | query | list | rm` through the real entry point, and one real subprocess."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from graft_cli.cli import main
from tests.datastore_fixtures import make_model_dir, text_of, write_jsonl


def run(capsys, *argv: str) -> tuple[int, str, str]:
    try:
        main(list(argv))
        code = 0
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else 1
    out, err = capsys.readouterr()
    return code, out, err


@pytest.fixture()
def home(tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv("GRAFT_HOME", str(tmp_path / "home"))
    return tmp_path / "home"


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    return make_model_dir(tmp_path_factory.mktemp("model"))


@pytest.fixture()
def corpus(tmp_path) -> Path:
    docs = [[1, 2, 3, 4, 5], [1, 2, 3, 9], [7, 1, 2, 3, 4, 6], [8, 8, 8]]
    return write_jsonl(tmp_path / "docs.jsonl", docs * 3)


def test_build_info_query_list_rm(capsys, home, model, corpus, tmp_path):
    code, out, err = run(capsys, "index", "build", str(corpus), "--model", str(model), "--name", "demo", "-j", "1", "-q")
    assert code == 0, err
    assert out.startswith(f"built suffix-array store {home / 'datastores' / 'demo'}: 12 documents, 54 tokens from 1 files")
    assert (home / "datastores" / "demo" / "shard-00000-of-00001" / "manifest.json").is_file()

    code, out, err = run(capsys, "index", "info", "demo")
    assert code == 0, err
    assert "kind       suffix-array" in out and "tokens     54" in out and "status     ok" in out
    code, out, _ = run(capsys, "index", "info", "demo", "--json", "--verify")
    info = json.loads(out)
    assert info["status"] == "ok" and info["verified"] == "sha256" and info["tokens"] == 54
    assert info["corpus"]["sources"] == [str(corpus.resolve())]

    code, out, err = run(capsys, "index", "query", "demo", "--text", text_of([0, 1, 2, 3]), "--json")
    assert code == 0, err
    q = json.loads(out)
    assert q["match_len"] == 3 and q["matched"] == text_of([1, 2, 3]) and q["occurrences"] == 9
    best = q["continuations"][0]
    assert best["text"] == "w4" and best["count"] == 6 and best["score"] == pytest.approx(6 / 10)
    code, out, _ = run(capsys, "index", "query", "demo", "--text", text_of([0, 1, 2, 3]))
    assert "matched suffix (3 tokens): 'w1 w2 w3'" in out and "'w4 w5'" in out
    code, out, _ = run(capsys, "index", "query", "demo", "--text", text_of([50, 60]))
    assert code == 0 and "no suffix of at least 2 tokens" in out

    code, out, err = run(capsys, "index", "build", str(corpus), "--model", str(model), "--out", str(tmp_path / "elsewhere"), "-j", "1", "-q")
    assert code == 0, err
    code, out, _ = run(capsys, "index", "query", str(tmp_path / "elsewhere"), "--text", text_of([2, 3]), "--json")
    assert json.loads(out)["match_len"] == 2

    code, out, _ = run(capsys, "index", "list")
    assert code == 0 and "demo" in out and "suffix-array" in out and str(model) in out
    code, out, _ = run(capsys, "index", "list", "--json")
    rows = json.loads(out)
    assert [r["name"] for r in rows] == ["demo"] and rows[0]["tokens"] == 54 and rows[0]["status"] == "ok"

    code, out, _ = run(capsys, "index", "rm", "demo")
    assert code == 0 and out.startswith("removed")
    assert not (home / "datastores" / "demo").exists()
    code, out, _ = run(capsys, "index", "list")
    assert "no datastores" in out


def test_sharded_build_and_ngram_kind(capsys, home, model, corpus):
    for i in range(2):
        code, out, err = run(capsys, "index", "build", str(corpus), "--model", str(model), "--name", "sh",
                             "--shard", f"{i}/2", "-j", "1", "-q")
        assert code == 0, err
        assert f"shard {i}/2" in out
        code, out, _ = run(capsys, "index", "list", "--json")
        assert json.loads(out)[0]["shards"] == f"{i + 1}/2"
    code, out, _ = run(capsys, "index", "query", "sh", "--text", text_of([1, 2, 3]), "--json")
    assert json.loads(out)["occurrences"] == 9

    code, out, err = run(capsys, "index", "build", str(corpus), "--model", str(model), "--name", "ng", "--kind", "ngram",
                         "--n", "2", "--min-count", "1", "--dim", "8", "-j", "1", "--json", "-q")
    assert code == 0, err
    summary = json.loads(out)
    assert summary["kind"] == "ngram" and summary["index"]["faiss"] == "flat"
    code, out, _ = run(capsys, "index", "query", "ng", "--text", text_of([1, 2]), "--json")
    q = json.loads(out)
    assert q["kind"] == "ngram" and q["continuations"][0]["text"] == "w3" and q["neighbours"][0]["similarity"] > 0.99
    code, out, _ = run(capsys, "index", "query", "ng", "--text", text_of([1, 2]))
    assert "exact match" in out


def test_errors_are_one_line(capsys, home, model, corpus, tmp_path):
    def err_of(*argv):
        code, out, err = run(capsys, *argv)
        assert code == 2, (out, err)
        assert err.startswith("graft: error: ") and err.count("\n") == 1
        return err

    base = ("index", "build", str(corpus), "--model", str(model), "-j", "1", "-q")
    assert run(capsys, *base, "--name", "x")[0] == 0
    assert "already exists (use --force" in err_of(*base, "--name", "x")
    assert run(capsys, *base, "--name", "x", "--force")[0] == 0
    assert "only apply to --kind ngram" in err_of(*base, "--name", "y", "--n", "3")
    assert "unknown --kind" in err_of(*base, "--kind", "bloom")
    assert "shard numbers count from 0" in err_of(*base, "--shard", "2/2")
    assert "--shard takes I/N" in err_of(*base, "--shard", "half")
    assert "needs --name or --out" in err_of("index", "build", "-", "--model", str(model))
    (tmp_path / "empty.jsonl").write_text("")
    assert "has no text" in err_of("index", "build", str(tmp_path / "empty.jsonl"), "--model", str(model), "-q", "-j", "1")
    assert "does not exist" in err_of("index", "build", str(tmp_path / "nope.txt"), "--model", str(model), "-q")
    assert "no datastore named nope" in err_of("index", "info", "nope")
    assert "no datastore named nope" in err_of("index", "query", "nope", "--text", "w1")
    not_store = tmp_path / "notastore"
    not_store.mkdir()
    (not_store / "keep.txt").write_text("x")
    assert "not a datastore" in err_of("index", "info", str(not_store))
    assert "does not look like a datastore" in err_of("index", "rm", str(not_store))
    assert (not_store / "keep.txt").exists()
    # a damaged store: info describes it and fails; query refuses it
    sa = home / "datastores" / "x" / "shard-00000-of-00001" / "sa.u32"
    sa.write_bytes(sa.read_bytes()[:-4])
    assert "truncated or damaged: sa.u32" in err_of("index", "query", "x", "--text", "w1 w2")
    code, out, err = run(capsys, "index", "info", "x")
    assert code == 2 and "status" in out and "truncated" in err
    code, out, _ = run(capsys, "index", "list")
    assert "x" in out
    assert run(capsys, "index", "rm", "x")[0] == 0  # damaged stores can still be removed


def test_subprocess_build_from_stdin(tmp_path, model):
    graft = Path(sys.executable).parent / "graft"
    if not graft.exists():
        pytest.skip("console script not installed (pip install -e .)")
    env = dict(os.environ, GRAFT_HOME=str(tmp_path / "home"))
    lines = "\n".join(json.dumps({"messages": [{"role": "user", "content": text_of([1, 2, 3])},
                                               {"role": "assistant", "content": text_of([4, 5, 6])}]}) for _ in range(5))
    proc = subprocess.run([str(graft), "index", "build", "-", "--model", str(model), "--name", "stdin-store"],
                          input=lines + "\nnot json\n", capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "5 documents, 30 tokens" in proc.stdout and "skipped 0 files, 1 records" in proc.stdout
    assert "skipped 1 record(s): 1 invalid JSON" in proc.stderr  # never silent
    proc = subprocess.run([str(graft), "index", "query", "stdin-store", "--text", text_of([2, 3]), "--json"],
                          capture_output=True, text=True, env=env, timeout=60)
    assert proc.returncode == 0, proc.stderr
    q = json.loads(proc.stdout)
    assert q["continuations"][0]["text"] == "w4" and q["match_len"] == 2
