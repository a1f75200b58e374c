"""Corpus reading: directories, JSONL fields and chats, Parquet/Arrow, stdin, and skipped input always counted."""

from __future__ import annotations

import hashlib
import io
import json

import pytest

from datastores import DatastoreError, build_store, open_store
from datastores.corpus import Corpus
from datastores.records import extract_text
from tests.datastore_fixtures import make_model_dir, text_of


def test_extract_text_rules():
    assert extract_text({"text": "a", "x": "b"}) == "a"
    assert extract_text({"instruction": "q", "output": "r", "n": 3}) == "q\nr"
    chat = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": [{"type": "text", "text": "yo"}]}]}
    assert extract_text(chat) == "hi\nyo"
    assert extract_text({"conversations": [{"from": "human", "value": "a"}, {"from": "gpt", "value": "b"}]}) == "a\nb"
    rec = {"data": {"turns": ["t0", "t1"], "meta": {"body": "B"}}, "other": "o"}
    assert extract_text(rec, ["data.turns.1"]) == "t1"
    assert extract_text(rec, ["data.meta.body", "other"]) == "B\n\no"
    assert extract_text(rec, ["data.turns"]) == "t0\nt1"
    assert extract_text(rec, ["missing.path"]) is None
    assert extract_text({"n": 1}) is None


def test_directory_walk_counts_skipped_files(tmp_path):
    root = tmp_path / "src"
    (root / "pkg" / "sub").mkdir(parents=True)
    (root / ".git").mkdir()
    (root / "__pycache__").mkdir()
    (root / "a.py").write_text("def f(): pass\n")
    (root / "pkg" / "b.md").write_text("# title\n")
    (root / "pkg" / "sub" / "c.txt").write_text("plain\n")
    (root / "pkg" / "latin1.txt").write_bytes("caf\xe9 au lait".encode("latin-1"))  # not UTF-8
    (root / "pkg" / "nul.c").write_bytes(b"int x;\0\0\0")  # binary
    (root / "image.png").write_bytes(b"\x89PNG")  # not a text extension: not read at all
    (root / ".git" / "config").write_text("hidden")
    (root / "__pycache__" / "a.py").write_text("cached")
    (root / "empty.txt").write_text("   \n")
    corpus = Corpus([root])
    docs = list(corpus)
    assert docs == ["def f(): pass\n", "# title\n", "plain\n"]  # sorted walk, hidden and cache dirs skipped
    skipped = dict(corpus.stats.skipped_files)
    assert skipped == {str(root / "pkg" / "latin1.txt"): "not UTF-8 text", str(root / "pkg" / "nul.c"): "binary file"}
    assert corpus.stats.skipped_records == {"empty": 1}
    assert len(corpus.stats.sources) == 4  # the whitespace-only file was read (and its empty text counted)
    a = next(s for s in corpus.stats.sources if s.path.endswith("a.py"))
    assert a.sha256 == hashlib.sha256(b"def f(): pass\n").hexdigest() and a.bytes == 14
    only_md = Corpus([root], extensions=["md"])
    assert list(only_md) == ["# title\n"]


def test_big_text_file_is_cut_at_lines_and_late_bad_bytes_are_reported(tmp_path, monkeypatch):
    import datastores.corpus as corpus_mod

    monkeypatch.setattr(corpus_mod, "READ_BLOCK", 1000)  # read in blocks, as a file of many MB would be
    f = tmp_path / "big.txt"
    line = "x" * 99 + "\n"
    f.write_bytes((line * 50).encode() + b"\xff\xfe tail")
    corpus = Corpus([f], chunk_chars=1024)
    corpus_docs = list(corpus)
    assert all(len(d) <= 1024 and d.endswith("\n") for d in corpus_docs)
    assert "".join(corpus_docs) == line * 50  # everything before the bad bytes, cut at line ends
    assert corpus.stats.skipped_files == [(str(f.resolve()), "not UTF-8 after byte 5000; the text before it was kept")]
    # a bad byte in the first block: the whole file is skipped (nothing of it was used)
    f.write_bytes(b"\xff" + (line * 50).encode())
    corpus = Corpus([f], chunk_chars=1024)
    assert list(corpus) == [] and corpus.stats.skipped_files == [(str(f), "not UTF-8 text")]


def test_jsonl_fields_and_bad_records(tmp_path):
    f = tmp_path / "c.jsonl"
    lines = [
        json.dumps({"q": "one", "a": {"text": "uno"}}),
        "not json",
        json.dumps({"q": "two"}),
        json.dumps({"a": {"text": "tres"}}),
        "",
        json.dumps({"q": ""}),
    ]
    f.write_bytes(("\n".join(lines) + "\n").encode() + b'{"q": "\xff"}\n')
    corpus = Corpus([f], fields=["a.text"])
    assert list(corpus) == ["uno", "tres"]
    assert corpus.stats.skipped_records == {"invalid JSON": 1, "no field a.text": 2, "invalid UTF-8": 1}
    src = corpus.stats.sources[0]
    assert src.bytes == f.stat().st_size and src.sha256 == hashlib.sha256(f.read_bytes()).hexdigest()
    assert list(Corpus([f], fields=["q", "a.text"])) == ["one\n\nuno", "two", "tres"]


def test_parquet_and_arrow(tmp_path):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.feather as feather
    import pyarrow.parquet as pq

    table = pa.table(
        {
            "id": [1, 2, 3],
            "text": ["alpha", None, "gamma"],
            "meta": [{"title": "A"}, {"title": "B"}, {"title": None}],
        }
    )
    pq.write_table(table, tmp_path / "t.parquet", row_group_size=2)
    feather.write_feather(table, tmp_path / "t.arrow")
    c = Corpus([tmp_path / "t.parquet"])
    assert list(c) == ["alpha", "gamma"] and c.stats.skipped_records == {"no text": 1}
    assert list(Corpus([tmp_path / "t.arrow"], fields=["meta.title"])) == ["A", "B"]
    c = Corpus([tmp_path / "t.parquet"], fields=["nope"])
    assert list(c) == [] and "no column nope" in c.stats.skipped_files[0][1]
    (tmp_path / "bad.parquet").write_bytes(b"PAR1 garbage")
    c = Corpus([tmp_path / "bad.parquet"])
    assert list(c) == [] and c.stats.skipped_files[0][1].startswith("unreadable parquet")


def test_stdin_jsonl_and_text():
    c = Corpus(["-"], stdin=io.BytesIO(b'\n{"text": "a b"}\n{"text": "c"}\n'))
    assert list(c) == ["a b", "c"] and c.stats.sources[0].kind == "stdin-jsonl"
    c = Corpus(["-"], stdin=io.BytesIO(b"just some\ntext\n"))
    assert list(c) == ["just some\ntext\n"] and c.stats.sources[0].kind == "stdin-text"
    c = Corpus(["-"], stdin=io.BytesIO(b'{"text": "x"}\n'), stdin_format="text")
    assert list(c) == ['{"text": "x"}\n']
    with pytest.raises(DatastoreError, match="only once"):
        Corpus(["-", "-"])


def test_build_records_skips_in_manifest(tmp_path):
    model = make_model_dir(tmp_path / "model")
    root = tmp_path / "docs"
    root.mkdir()
    (root / "a.txt").write_text(text_of([1, 2, 3, 4]))
    (root / "b.txt").write_bytes(b"\xff\xfe\xfd")
    (root / "c.jsonl").write_text(json.dumps({"text": text_of([5, 6, 7])}) + "\nbroken\n")
    m = build_store([root], tmp_path / "s", model_dir=model)
    c = m["corpus"]
    assert c["documents"] == 2 and c["tokens"] == 7
    assert c["skipped_files"] == [{"path": str(root / "b.txt"), "reason": "not UTF-8 text"}]
    assert c["skipped_records"] == {"invalid JSON": 1}
    assert open_store(tmp_path / "s").lookup([2, 3], budget=4).nodes[0].token == 4
